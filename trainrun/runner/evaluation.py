"""Distributed evaluation: every rank scores its shard, rank 0 computes, every rank learns.

A metric keeps one result per sample in the order its rank's sampler dealt them;
``collect_results`` puts all ranks' results back in dataset order and cuts the sampler's
padding, so an uneven last batch neither drops nor duplicates a sample.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from trainrun.dist import broadcast_object_list, collect_results, is_main_process
from trainrun.registry import METRICS


class MetricError(RuntimeError):
    """A metric's computation failed on rank 0; every rank raises it."""


class BaseMetric(ABC):
    """Collects per-sample results with ``process``; ``compute`` turns all of them into numbers.

    Every rank calls ``process`` for each batch of its share of the data; at the end
    ``evaluate`` gathers every rank's ``results`` on rank 0 in dataset order (the sampler's
    padding cut), runs ``compute`` there and gives the values to every rank. So ``process``
    must append exactly one result per sample, in the batch's order, and each result must be
    picklable (plain numbers are best).

    Which metrics score a data set: the runner's ``val_metrics``/``test_metrics``, else the
    registered names the data section lists under ``metrics``, else those its data set class
    declares in ``DEFAULT_METRICS`` (e.g. ``['accuracy']``). Metrics named there are made
    without arguments.

    Attributes:
        names: the keys ``compute`` returns, where the class knows them before it runs (hooks
            such as EarlyStopping check the metric they watch against them); None: not known.
        results: this rank's per-sample results since the last ``evaluate``.

    Args:
        collect_device: how the results reach rank 0: ``'cpu'`` (through pickled objects,
            possibly a shared temporary directory) or ``'gpu'`` (through the communication
            backend).
    """

    names: tuple[str, ...] | None = None

    def __init__(self, collect_device: str = "cpu") -> None:
        self.collect_device = collect_device
        self.results: list[Any] = []

    @abstractmethod
    def process(self, batch: Any, outputs: Any) -> None:
        """Append one result per sample of ``batch`` to ``self.results``.

        Args:
            batch: the batch as the model got it (on its device): for dict items, a dict of
                batched tensors, the true labels under ``batch['labels']`` by convention.
            outputs: what the model's ``val_step``/``test_step`` returned for it
                (``forward(batch, mode='predict')``), one prediction per sample.
        """

    @abstractmethod
    def compute(self, results: list[Any]) -> dict[str, float]:
        """The metric values from every sample's result, in dataset order.

        Called on rank 0 only, with every rank's results.

        Args:
            results: one result per sample of the whole data set, as ``process`` appended
                them.

        Returns:
            The values by name (the keys ``names`` lists, where it does), e.g.
            ``{'accuracy': 0.95}``. With several validation sets each key is reported as
            ``val/<set>/<key>``.
        """

    def evaluate(self, size: int, replicas: int = 1) -> dict[str, float]:
        """Gather every rank's results (``size`` samples in all) and compute on rank 0; the
        values reach every rank.

        Every rank must call this; it empties ``results`` for the next evaluation.

        Args:
            size: the number of samples in the data set (the sampler's padding beyond it is
                cut).
            replicas: how many consecutive ranks were dealt the same samples (tensor-parallel
                peers): their results count once.

        Returns:
            What ``compute`` returned, on every rank.

        Raises:
            MetricError: ``compute`` failed on rank 0 (raised on every rank, naming the
                metric and the error).
        """
        everything = collect_results(self.results, size * replicas, device=self.collect_device)
        if everything is not None and replicas > 1:  # each sample's results side by side
            everything = everything[::replicas]
        self.results = []
        values: list[Any] = [None]
        if is_main_process():
            try:
                values = [self.compute(everything)]
            except Exception as error:  # sent on, so no rank waits in the broadcast for it
                values = [MetricError(f"{type(self).__name__}.compute failed on rank 0: "
                                      f"{type(error).__name__}: {error}")]
        broadcast_object_list(values)
        if isinstance(values[0], MetricError):
            raise values[0]
        return values[0]


class Accuracy(BaseMetric):
    """Top-1 accuracy: ``outputs`` are class indices (or scores, then their argmax) and the
    batch holds the true labels under ``label_key``.

    Registered as ``accuracy``; it computes ``{'accuracy': correct / samples}`` (0.0 for no
    samples).

    Args:
        label_key: the key of ``batch`` that holds the true class indices (``[B]``).
        collect_device: as for ``BaseMetric``.
    """

    names = ("accuracy",)

    def __init__(self, label_key: str = "labels", collect_device: str = "cpu") -> None:
        super().__init__(collect_device)
        self.label_key = label_key

    def process(self, batch: Any, outputs: Any) -> None:
        """Append whether each sample's prediction is its label (a bool per sample).

        Args:
            batch: the batch; ``batch[label_key]`` holds the labels.
            outputs: a tensor of class indices (``[B]``) or of class scores (``[B, classes]``,
                whose argmax over the last dimension is taken).
        """
        predicted = outputs.argmax(-1) if outputs.dim() > 1 else outputs
        labels = batch[self.label_key]
        self.results.extend((predicted == labels.to(predicted.device)).cpu().tolist())

    def compute(self, results: list[Any]) -> dict[str, float]:
        """The share of correct predictions.

        Args:
            results: a bool per sample of the data set.

        Returns:
            ``{'accuracy': ...}``, in [0, 1]; 0.0 when there are no results.
        """
        return {"accuracy": sum(results) / len(results) if results else 0.0}


class MeanOf(BaseMetric):
    """The mean of a per-sample value the model predicts (e.g. its loss), named ``name``.

    Registered as ``mean`` (named ``loss``) and, for the examples, ``val_loss`` and
    ``mode_distance``; it computes ``{name: mean}`` (nan for no samples).

    Args:
        name: the key ``compute`` returns.
        collect_device: as for ``BaseMetric``.
    """

    def __init__(self, name: str = "loss", collect_device: str = "cpu") -> None:
        super().__init__(collect_device)
        self.name = name
        self.names = (name,)

    def process(self, batch: Any, outputs: Any) -> None:
        """Append each sample's value, as a float.

        Args:
            batch: the batch (not read).
            outputs: one number per sample (a tensor of ``[B]``, or anything
                ``torch.as_tensor`` takes); it is flattened.
        """
        self.results.extend(torch.as_tensor(outputs).reshape(-1).double().cpu().tolist())

    def compute(self, results: list[Any]) -> dict[str, float]:
        """The mean of every sample's value.

        Args:
            results: a float per sample of the data set.

        Returns:
            ``{name: mean}``; nan when there are no results.
        """
        return {self.name: sum(results) / len(results) if results else float("nan")}


METRICS.register("accuracy", Accuracy)
METRICS.register("mean", MeanOf)
METRICS.register("val_loss", MeanOf, name="val_loss")

"""Distributed evaluation: every rank scores its shard, rank 0 computes, every rank learns.

A metric keeps one result per sample in the order its rank's sampler dealt them;
`collect_results` puts all ranks' results back in dataset order and cuts the sampler's
padding, so an uneven last batch neither drops nor duplicates a sample.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from trainrun.dist import broadcast_object_list, collect_results, is_main_process


class MetricError(RuntimeError):
    """A metric's computation failed on rank 0; every rank raises it."""


class BaseMetric(ABC):
    """Collects per-sample results with ``process``; ``compute`` turns all of them into numbers.

    ``names``: the keys ``compute`` returns, where the class knows them before it runs (hooks
    such as EarlyStopping check the metric they watch against them); None: not known.
    """

    names: tuple[str, ...] | None = None

    def __init__(self, collect_device: str = "cpu"):
        self.collect_device = collect_device
        self.results: list[Any] = []

    @abstractmethod
    def process(self, batch: Any, outputs: Any) -> None:
        """Append one result per sample of ``batch`` to ``self.results``."""

    @abstractmethod
    def compute(self, results: list[Any]) -> dict[str, float]:
        """The metric values from every sample's result, in dataset order."""

    def evaluate(self, size: int) -> dict[str, float]:
        """Gather every rank's results (``size`` samples in all) and compute on rank 0; the
        values reach every rank."""
        everything = collect_results(self.results, size, device=self.collect_device)
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
    batch holds the true labels under ``label_key``."""

    names = ("accuracy",)

    def __init__(self, label_key: str = "labels", collect_device: str = "cpu"):
        super().__init__(collect_device)
        self.label_key = label_key

    def process(self, batch: Any, outputs: Any) -> None:
        predicted = outputs.argmax(-1) if outputs.dim() > 1 else outputs
        labels = batch[self.label_key]
        self.results.extend((predicted == labels.to(predicted.device)).cpu().tolist())

    def compute(self, results: list[Any]) -> dict[str, float]:
        return {"accuracy": sum(results) / len(results) if results else 0.0}


class MeanOf(BaseMetric):
    """The mean of a per-sample value the model predicts (e.g. its loss), named ``name``."""

    def __init__(self, name: str = "loss", collect_device: str = "cpu"):
        super().__init__(collect_device)
        self.name = name
        self.names = (name,)

    def process(self, batch: Any, outputs: Any) -> None:
        self.results.extend(torch.as_tensor(outputs).reshape(-1).double().cpu().tolist())

    def compute(self, results: list[Any]) -> dict[str, float]:
        return {self.name: sum(results) / len(results) if results else float("nan")}

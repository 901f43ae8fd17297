"""``mmengine.evaluator``: ``BaseMetric`` with MMEngine's method names, and ``Evaluator``.

An MMEngine metric implements ``process(data_batch, data_samples)`` (one entry or more per
batch in ``self.results``) and ``compute_metrics(results)``; its values are logged under
``prefix/name`` when it has a prefix. trainrun's loops call ``process(batch, outputs)`` and
``compute(results)``: the same arguments in the same order, so only ``compute`` is bridged.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from trainrun.runner.evaluation import BaseMetric as _Metric
from trainrun.runner.schema import ConfigError


def plain_value(value: Any) -> Any:
    """A one-element tensor as a Python number (as MMEngine logs it); anything else as it is."""
    return value.item() if isinstance(value, Tensor) and value.numel() == 1 else value


class BaseMetric(_Metric):
    """A metric written for MMEngine.

    Args:
        collect_device: how the results reach rank 0: ``'cpu'`` or ``'gpu'``.
        prefix: put before each value's name (``prefix/name``); None: the class's
            ``default_prefix``, and no prefix when that is None too.
        collect_dir: MMEngine's directory for collecting on ``'cpu'``; refused (trainrun
            collects through the communication backend or a private temporary directory).

    Raises:
        ConfigError: a ``collect_dir`` was given.
    """

    default_prefix: str | None = None

    def __init__(self, collect_device: str = "cpu", prefix: str | None = None,
                 collect_dir: str | None = None) -> None:
        if collect_dir is not None:
            raise ConfigError(f"{type(self).__name__}: collect_dir is not supported by "
                              "trainrun.compat.mmengine; leave it out")
        super().__init__(collect_device)
        self.prefix = prefix or self.default_prefix
        self._dataset_meta: dict | None = None

    @property
    def dataset_meta(self) -> dict | None:
        """The data set's ``metainfo`` (class names and the like), set by the runner."""
        return self._dataset_meta

    @dataset_meta.setter
    def dataset_meta(self, meta: dict | None) -> None:
        self._dataset_meta = meta

    @abstractmethod
    def process(self, data_batch: Any, data_samples: Any) -> None:
        """Append to ``self.results`` what ``compute_metrics`` needs from one batch.

        Args:
            data_batch: the batch as the data loader gave it.
            data_samples: what the model's ``forward(..., mode='predict')`` returned for it.
        """

    @abstractmethod
    def compute_metrics(self, results: list) -> dict[str, Any]:
        """The values by name, from every rank's results (on rank 0)."""

    def compute(self, results: list[Any]) -> dict[str, Any]:
        """``compute_metrics``' values, each name under ``prefix/`` where there is a prefix,
        one-element tensors as numbers."""
        values = self.compute_metrics(results)
        return {(f"{self.prefix}/{name}" if self.prefix else name): plain_value(value)
                for name, value in values.items()}


class Evaluator:
    """Several metrics scored together, as MMEngine's ``val_evaluator`` holds them.

    Args:
        metrics: a metric, a config dict of one, or a list of either (dicts are built by
            the compat ``METRICS`` registry).
    """

    def __init__(self, metrics: Any) -> None:
        from trainrun.compat.mmengine.registry import METRICS

        items = metrics if isinstance(metrics, Sequence) else [metrics]
        self.metrics: list[BaseMetric] = [
            METRICS.build(m) if isinstance(m, Mapping) else m for m in items]
        for metric in self.metrics:
            if not isinstance(metric, _Metric):
                raise TypeError(f"an evaluator's metric must be a BaseMetric or its config "
                                f"dict, got {type(metric).__name__}")

    @property
    def dataset_meta(self) -> dict | None:
        """The data set's ``metainfo``, given to every metric."""
        return self.metrics[0].dataset_meta if self.metrics else None

    @dataset_meta.setter
    def dataset_meta(self, meta: dict | None) -> None:
        for metric in self.metrics:
            if isinstance(metric, BaseMetric):  # trainrun's own metrics have no meta
                metric.dataset_meta = meta

    def process(self, data_samples: Any, data_batch: Any = None) -> None:
        """Give one batch's predictions to every metric."""
        for metric in self.metrics:
            metric.process(data_batch, data_samples)

    def evaluate(self, size: int) -> dict[str, Any]:
        """Every metric's values (``size`` samples in the data set), on every rank.

        Raises:
            ValueError: two metrics give a value of the same name.
        """
        values: dict[str, Any] = {}
        for metric in self.metrics:
            for name, value in metric.evaluate(size).items():
                if name in values:
                    raise ValueError(f"two metrics give a value named {name!r}; give one of "
                                     f"them a prefix")
                values[name] = value
        return values


__all__ = ["BaseMetric", "Evaluator"]

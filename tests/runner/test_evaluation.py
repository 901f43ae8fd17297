"""Distributed evaluation: every sample scored exactly once, in dataset order, whatever the
number of ranks and however uneven the last batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import trainrun.dist as dist
from tests.runner.toy import ToyRegression
from trainrun.runner.evaluation import Accuracy, BaseMetric, MeanOf, MetricError
from trainrun.runner.sampler import ResumableSampler


class Seen(BaseMetric):
    """Keeps (index, value) per sample; ``compute`` reports what rank 0 was handed."""

    def process(self, batch, outputs):
        self.results.extend(zip(batch["index"].tolist(), outputs.tolist(), strict=True))

    def compute(self, results):
        self.seen = list(results)
        return {"count": float(len(results)), "sum": float(sum(v for _, v in results))}


def _evaluate_body(size, batch_size, collect_device):
    rank = dist.get_rank()
    dataset = ToyRegression(size=size)
    loader = DataLoader(dataset, batch_size=batch_size,
                        sampler=ResumableSampler(size, shuffle=False))
    seen, mean, accuracy = Seen(collect_device), MeanOf("y", collect_device), \
        Accuracy("labels", collect_device)
    batches = 0
    for batch in loader:
        batches += 1
        seen.process(batch, batch["targets"])
        mean.process(batch, batch["targets"])
        labels = batch["index"] % 3
        batch["labels"] = labels
        # scores whose argmax is right for every index but those divisible by 4
        scores = torch.nn.functional.one_hot(torch.where(batch["index"] % 4 == 0,
                                                         (labels + 1) % 3, labels), 3)
        accuracy.process(batch, scores.float())
    local = len(seen.results)
    values = {**seen.evaluate(size), **mean.evaluate(size), **accuracy.evaluate(size)}
    handed = getattr(seen, "seen", None) if rank == 0 else None
    return values, handed, local, seen.results, batches


@pytest.mark.parametrize("collect_device", ["cpu", "gpu"])
def test_every_sample_is_scored_once_in_dataset_order(on_ranks, world_size, collect_device):
    size = 21
    results = on_ranks(_evaluate_body, size, 4, collect_device)
    dataset = ToyRegression(size=size)
    targets = dataset.y.tolist()
    expected_accuracy = sum(1 for i in range(size) if i % 4 != 0) / size
    for values, _, _, left, _ in results:  # every rank gets rank 0's values
        assert values == results[0][0]
        assert left == []  # evaluate empties the results for the next round
    values, handed, _, _, _ = results[0]
    assert [index for index, _ in handed] == list(range(size))  # none dropped, none twice
    assert [value for _, value in handed] == targets
    assert values["count"] == size
    assert values["y"] == pytest.approx(sum(targets) / size, rel=1e-12)
    assert values["accuracy"] == expected_accuracy
    # the sampler padded the last rank's share: that duplicate was cut, not counted
    per_rank = -(-size // world_size)
    assert [r[2] for r in results] == [per_rank] * world_size
    assert [r[4] for r in results] == [-(-per_rank // 4)] * world_size  # uneven last batch


def test_metrics_without_a_group():
    metric = MeanOf("loss")
    metric.process({}, torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    assert metric.evaluate(4) == {"loss": 3.0} and metric.results == []
    assert MeanOf().compute([]) != MeanOf().compute([])  # nan for nothing
    accuracy = Accuracy()
    accuracy.process({"labels": torch.tensor([0, 1, 2, 2])}, torch.tensor([0, 1, 1, 2]))
    assert accuracy.evaluate(4) == {"accuracy": 0.75}
    assert accuracy.evaluate(0) == {"accuracy": 0.0}


class _Broken(MeanOf):
    def compute(self, results):
        raise ZeroDivisionError("no samples")


def _broken_body():
    metric = _Broken()
    metric.process(None, torch.ones(3))
    try:
        metric.evaluate(6)
    except MetricError as error:
        return str(error)
    return None


def test_a_metric_failing_on_rank_0_raises_on_every_rank(run_on):
    for message in run_on(2)(_broken_body):
        assert message == "_Broken.compute failed on rank 0: ZeroDivisionError: no samples"

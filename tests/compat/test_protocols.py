"""MMEngine's model, metric and hook protocols under trainrun's own Runner: a model written
for MMEngine (``forward(inputs, labels, mode)``, a data preprocessor) trains to the losses of
the same network written for trainrun, in one process and under DDP on 2 gloo ranks; its
metric and its hook see what MMEngine gives them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from trainrun.compat.mmengine.dataset import DefaultSampler, default_collate, pseudo_collate
from trainrun.compat.mmengine.evaluator import BaseMetric, Evaluator
from trainrun.compat.mmengine.hooks import Hook, HookAdapter
from trainrun.compat.mmengine.model import BaseDataPreprocessor, BaseModel
from trainrun.runner.runner import Runner
from trainrun.runner.schema import ConfigError
from trainrun.wrappers import BaseModel as TrainrunModel


class Points(Dataset):
    """64 points of 6 features in 3 classes, as (features, label) tuples."""

    def __init__(self, size: int = 64):
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(size, 6, generator=generator)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0.5).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def network() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))


class MMNet(BaseModel):
    """Written for MMEngine: the batch arrives unpacked, ``mode`` last."""

    def __init__(self):
        super().__init__()
        self.net = network()

    def forward(self, inputs, labels, mode="tensor"):
        scores = self.net(inputs)
        if mode == "loss":
            return {"loss": F.cross_entropy(scores, labels)}
        if mode == "predict":
            return scores, labels
        return scores


class PlainNet(TrainrunModel):
    """The same network written for trainrun: the batch as one argument."""

    def __init__(self):
        super().__init__()
        self.net = network()

    def forward(self, batch, mode="loss"):
        inputs, labels = batch
        scores = self.net(inputs)
        return {"loss": F.cross_entropy(scores, labels)} if mode == "loss" else (scores, labels)


class Accuracy(BaseMetric):
    """MMEngine's example metric: one result per batch, a tensor value."""

    default_prefix = "cls"

    def process(self, data_batch, data_samples):
        scores, labels = data_samples
        self.results.append({"size": len(labels),
                             "correct": (scores.argmax(dim=1) == labels).sum()})

    def compute_metrics(self, results):
        correct = sum(r["correct"] for r in results)
        return {"accuracy": 100 * correct / sum(r["size"] for r in results)}


class Recorder(Hook):
    """Records the MMEngine hook points it is called at."""

    def __init__(self):
        self.calls: list[tuple] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.calls.append(("after_train_iter", batch_idx, type(data_batch).__name__,
                           sorted(outputs)))

    def after_val_epoch(self, runner, metrics=None):
        self.calls.append(("after_val_epoch", dict(metrics)))

    def after_val(self, runner):
        self.calls.append(("after_val",))


def train(model: nn.Module, work_dir: Path, hooks=()) -> list[dict]:
    """Two epochs of ``model`` on ``Points`` with SGD and momentum; the lines of metrics.jsonl."""
    runner = Runner(
        model=model, work_dir=work_dir,
        train_dataloader={"dataset": Points(), "batch_size": 8},
        val_dataloader={"dataset": Points(24), "batch_size": 8},
        optim={"type": "SGD", "lr": 0.1, "momentum": 0.9}, schedule={"max_epochs": 2},
        val_metrics=[Accuracy()], hooks=list(hooks), randomness={"seed": 5},
        logging={"interval": 1}, checkpoint={"interval": 1})
    runner.train()
    runner.close()
    lines = (work_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(lines: list[dict]) -> list[float]:
    return [line["loss"] for line in lines if "loss" in line and line.get("mode") is None]


def test_an_mmengine_model_trains_to_the_losses_of_the_same_trainrun_model(tmp_path: Path):
    mm, plain = train(MMNet(), tmp_path / "mm"), train(PlainNet(), tmp_path / "plain")
    assert len(losses(mm)) == 16
    assert losses(mm) == losses(plain)


def _losses_on_ranks(work_dir: str, kind: str) -> list[float]:
    from trainrun.dist import get_rank

    model = MMNet() if kind == "mm" else PlainNet()
    lines = train(model, Path(work_dir) / kind) if get_rank() == 0 else None
    if lines is None:
        train(model, Path(work_dir) / kind)
        return []
    return losses(lines)


def test_under_ddp_on_two_ranks_too(run_on, tmp_path: Path):
    mm = run_on(2)(_losses_on_ranks, str(tmp_path), "mm")[0]
    plain = run_on(2)(_losses_on_ranks, str(tmp_path), "plain")[0]
    assert len(mm) == 8
    assert mm == plain


class IndexedPoints(Points):
    """Points as dicts that name their index, for a metric to see which samples it scored."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.x[index], "labels": self.y[index], "index": torch.tensor(index)}


class IndexedNet(MMNet):
    def forward(self, inputs, labels, index=None, mode="tensor"):
        if mode == "predict":
            return self.net(inputs), labels, index
        return super().forward(inputs, labels, mode)


class PerSample(BaseMetric):
    """One result per sample (its index, loss and whether it was right); counts the samples
    this rank scored."""

    def __init__(self):
        super().__init__()
        self.scored = 0

    def process(self, data_batch, data_samples):
        scores, labels, index = data_samples
        losses = F.cross_entropy(scores, labels, reduction="none")
        right = scores.argmax(dim=1) == labels
        self.results.extend(zip(index.tolist(), losses.tolist(), right.tolist(), strict=True))
        self.scored += len(labels)

    def compute_metrics(self, results):
        indices = [index for index, _, _ in results]
        return {"samples": len(results), "distinct": len(set(indices)),
                "in_order": indices == sorted(indices),
                "loss": sum(loss for _, loss, _ in results) / len(results),
                "accuracy": sum(right for _, _, right in results) / len(results)}


def _validate_without_padding(work_dir: str, size: int, split: str) -> tuple[dict, int]:
    from trainrun.compat.mmengine.runner import Runner as CompatRunner
    from trainrun.dist import get_rank

    metric = PerSample()
    loader = {"dataset": IndexedPoints(size), "batch_size": 4,
              "sampler": {"type": "DefaultSampler", "shuffle": False, "round_up": False},
              "collate_fn": {"type": "default_collate"}}
    runner = CompatRunner(model=IndexedNet(), work_dir=f"{work_dir}/rank{get_rank()}",
                          **{f"{split}_dataloader": loader, f"{split}_cfg": {},
                             f"{split}_evaluator": metric})
    try:
        metrics = runner.val() if split == "val" else runner.test()
    finally:
        runner.close()
    return metrics, metric.scored


@pytest.mark.parametrize("split", ["val", "test"])
def test_round_up_false_scores_every_sample_once_on_two_ranks(run_on, tmp_path: Path, split):
    """41 samples on 2 ranks: 21 and 20, in 6 and 5 batches (DDP's eval forward waits for no
    other rank); the metric sees each sample once, in the data set's order, and equals the
    one computed over the whole set in one process."""
    (one, scored), = run_on(1)(_validate_without_padding, str(tmp_path / "one"), 41, split)
    assert scored == 41
    ranks = run_on(2)(_validate_without_padding, str(tmp_path / "two"), 41, split)
    assert [scored for _, scored in ranks] == [21, 20]
    for metrics, _ in ranks:  # every rank learns the values
        assert {k: v for k, v in metrics.items() if k != "loss"} == {
            "samples": 41, "distinct": 41, "in_order": True, "accuracy": one["accuracy"]}
        assert metrics["loss"] == pytest.approx(one["loss"], rel=1e-6)


def test_the_metric_is_logged_under_its_prefix_and_the_hook_sees_mmengine_points(
        tmp_path: Path):
    recorder = Recorder()
    lines = train(MMNet(), tmp_path / "run", hooks=[HookAdapter(recorder)])
    val = [line for line in lines if line.get("mode") == "val"]
    assert len(val) == 2 and all(isinstance(line["cls/accuracy"], float) for line in val)
    first = recorder.calls[0]
    assert first == ("after_train_iter", 0, "list", ["loss"])
    ends = [call for call in recorder.calls if call[0] != "after_train_iter"]
    assert [c[0] for c in ends] == ["after_val_epoch", "after_val"] * 2
    assert ends[0][1]["cls/accuracy"] == val[0]["cls/accuracy"]


def test_the_data_preprocessor_moves_the_batch_and_forward_gets_it_unpacked():
    model = MMNet()
    assert isinstance(model.data_preprocessor, BaseDataPreprocessor)
    assert "data_preprocessor._device_probe" not in model.state_dict()
    args, kwargs = model.forward_arguments({"inputs": torch.ones(2, 6),
                                            "labels": torch.zeros(2, dtype=torch.long)}, "loss")
    assert args == () and set(kwargs) == {"inputs", "labels", "mode"}
    args, kwargs = model.forward_arguments([torch.ones(2, 6), torch.zeros(2)], "predict")
    assert len(args) == 2 and kwargs == {"mode": "predict"}
    with pytest.raises(TypeError, match="dict, a list or a tuple"):
        model.forward_arguments(torch.ones(2, 6), "loss")
    with pytest.raises(ConfigError, match="init_cfg"):
        BaseModel(init_cfg={"type": "Normal"})


def test_the_default_sampler_deals_mmengines_order():
    """MMEngine's order: a permutation seeded with seed + epoch, repeated up to a multiple of
    the world size, rank r taking every N-th index from r."""
    data = Points(10)
    sampler = DefaultSampler(data, shuffle=True, seed=7)
    sampler.num_replicas, sampler.rank = 4, 1
    sampler.set_epoch(2)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(9)).tolist()
    padded = (order * 2)[:12]
    assert list(sampler) == padded[1:12:4]
    exact = DefaultSampler(data, shuffle=True, seed=7, round_up=False)
    exact.set_epoch(2)
    shares = []
    for rank in range(4):  # MMEngine's round_up=False: no padding, nothing twice
        exact.num_replicas, exact.rank = 4, rank
        assert len(exact) == len(range(rank, 10, 4))
        shares.append(list(exact))
    assert shares == [order[rank::4] for rank in range(4)]


def test_collate_functions():
    samples = [{"a": torch.tensor(1), "b": (1, "x")}, {"a": torch.tensor(2), "b": (2, "y")}]
    assert pseudo_collate(samples) == {"a": [torch.tensor(1), torch.tensor(2)],
                                       "b": [[1, 2], ["x", "y"]]}
    assert default_collate(samples)["a"].tolist() == [1, 2]


def test_an_evaluator_scores_with_every_metric():
    evaluator = Evaluator([Accuracy(), Accuracy(prefix="other")])
    evaluator.process((torch.eye(3), torch.tensor([0, 1, 1])))
    assert evaluator.evaluate(3) == {"cls/accuracy": pytest.approx(200 / 3),
                                     "other/accuracy": pytest.approx(200 / 3)}


def test_a_data_section_may_hold_a_built_data_set(tmp_path: Path):
    with pytest.raises(ConfigError, match="either type"):
        Runner(model=MMNet(), work_dir=tmp_path / "a",
               train_dataloader={"dataset": Points(), "type": "digits"})
    with pytest.raises(ConfigError, match="data set object"):
        Runner(model=MMNet(), work_dir=tmp_path / "b", train_dataloader={"dataset": 3})
    with pytest.raises(ConfigError, match="batch_sise"):
        Runner(model=MMNet(), work_dir=tmp_path / "c",
               train_dataloader={"dataset": Points(), "batch_sise": 4})


def test_a_metric_gets_the_data_sets_metainfo(tmp_path: Path):
    from trainrun.compat.mmengine.runner import Runner as CompatRunner

    class Named(Points):
        metainfo = {"classes": ("low", "mid", "high")}

    seen = []

    class Classes(Accuracy):
        def compute_metrics(self, results):
            seen.append(self.dataset_meta)
            return super().compute_metrics(results)

    runner = CompatRunner(
        model=MMNet(), work_dir=str(tmp_path / "run"),
        train_dataloader={"dataset": Points(), "batch_size": 8,
                          "collate_fn": {"type": "default_collate"}},
        train_cfg={"by_epoch": True, "max_epochs": 1},
        optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.1}},
        val_dataloader={"dataset": Named(16), "batch_size": 8,
                        "collate_fn": {"type": "default_collate"}},
        val_cfg={}, val_evaluator={"type": Classes})
    runner.train()
    runner.close()
    assert seen == [{"classes": ("low", "mid", "high")}]

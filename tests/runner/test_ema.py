"""The EMA hook in a run: the average it keeps (momentum, warm-up, interval), validation and
testing on it with training untouched, and its state through a crash and resume on 2 ranks
under ddp, fsdp and ZeRO-3 (each rank keeping its own shard of the average under the
sharded two). SIGKILL and export are tests/tools/test_ema_cli.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainrun.dist as dist
from tests.records import records as _records
from tests.runner.toy import CrashAfter, Killed, ToyModel
from trainrun.checkpoint.read import read_train_state
from trainrun.runner.hooks import EMAHook, Hook
from trainrun.runner.runner import Runner

DATASET = "tests.runner.toy.ToyRegression"


def _runner(work_dir, hooks, *, max_iters=12, strategy="none", resume=False, checkpoint=None):
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": DATASET, "size": 64, "batch_size": 4},
        val_dataloader={"type": DATASET, "size": 21, "seed": 1, "batch_size": 4},
        test_dataloader={"type": DATASET, "size": 21, "seed": 1, "batch_size": 4},
        optim={"type": "AdamW", "lr": 0.05}, strategy=strategy,
        schedule={"max_iters": max_iters, "val_interval": 4},
        randomness={"seed": 3}, logging={"interval": 1, "backends": ["jsonl"]},
        checkpoint=checkpoint or {"interval": 0, "save_last": False}, resume=resume,
        hooks=hooks)


class Snapshots(Hook):
    """The weights before training and after every step, as one flat tensor each."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def _take(self, runner):
        self.seen.append(torch.cat([p.detach().reshape(-1).clone()
                                    for p in runner.model.parameters()]))

    def before_train(self, runner):
        self._take(runner)

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        self._take(runner)


def _average(runner) -> torch.Tensor:
    hook = next(h for h in runner.hooks if isinstance(h, EMAHook))
    return torch.cat([t.reshape(-1) for t in hook.average.values()])


def _trained(work_dir, **ema):
    snapshots = Snapshots()
    runner = _runner(work_dir, [{"type": "EMA", **ema}, snapshots], max_iters=6)
    runner.train()
    return runner, snapshots.seen


def test_the_average_moves_by_the_momentum_at_the_interval(tmp_path):
    runner, seen = _trained(tmp_path / "a", momentum=0.3, interval=2)
    expected = seen[0]
    for step in (2, 4, 6):  # every second step
        expected = expected + 0.3 * (seen[step] - expected)
    torch.testing.assert_close(_average(runner), expected, rtol=0, atol=1e-6)
    runner.close()


def test_warm_up_averages_the_weights_seen_so_far(tmp_path):
    """Momentum 1e-4 alone would leave the average at the starting weights; for the first
    `warmup` updates it is the plain mean instead, then the momentum takes over."""
    runner, seen = _trained(tmp_path / "a", momentum=1e-4, warmup=4)
    expected = torch.stack(seen[:5]).mean(0)
    for step in (5, 6):
        expected = expected + 1e-4 * (seen[step] - expected)
    torch.testing.assert_close(_average(runner), expected, rtol=0, atol=1e-6)
    runner.close()


def _losses_and_vals(work_dir):
    """Each step's loss and each validation's mse (a step replayed after a resume: the later
    line wins)."""
    records = _records(work_dir)
    losses = {r["step"]: r["loss"] for r in records if "mode" not in r}
    vals = {r["step"]: r["mse"] for r in records if r.get("mode") == "val"}
    return list(losses.values()), list(vals.values())


def test_validation_and_test_use_the_average_and_training_is_untouched(tmp_path):
    """Momentum 1 makes the average the weights themselves: validation then scores exactly
    what a run without the hook scores, so the swap in and out is exact; with a small
    momentum validation scores other weights while every training loss stays the same."""
    results = {}
    for name, hooks in (("plain", []), ("same", [{"type": "EMA", "momentum": 1.0}]),
                        ("slow", [{"type": "EMA", "momentum": 0.1}])):
        runner = _runner(tmp_path / name, hooks)
        runner.train()
        results[name] = (*_losses_and_vals(tmp_path / name), runner.test()["mse"])
        runner.close()
    assert results["same"] == results["plain"]
    assert results["slow"][0] == results["plain"][0]  # training losses, bit for bit
    assert results["slow"][1] != results["plain"][1]  # validation on the average
    assert results["slow"][2] == results["slow"][1][-1]  # test (the val set) on it too
    assert results["slow"][2] != results["plain"][2]


def test_evaluate_false_validates_the_trained_weights(tmp_path):
    for name, hooks in (("plain", []), ("off", [{"type": "EMA", "momentum": 0.1,
                                                 "evaluate": False}])):
        runner = _runner(tmp_path / name, hooks)
        runner.train()
        runner.close()
    assert _losses_and_vals(tmp_path / "off") == _losses_and_vals(tmp_path / "plain")


# ---------------------------------------------------------------- resume on 2 ranks

EMA = {"type": "EMA", "momentum": 0.2, "warmup": 3}
STRATEGIES = {"ddp": "ddp", "fsdp": "fsdp", "zero3": {"type": "deepspeed", "zero_stage": 3}}


def _resume_body(work_dir, strategy):
    """A straight run, and one crashed after step 6 (checkpoints every 4, so it resumes from
    step 4 and replays two updates) then resumed: each rank's shard sizes and the whole
    average each ends with."""
    out = {}
    for name, crash in (("straight", None), ("resumed", 6)):
        directory = str(Path(work_dir) / name)
        checkpoint = {"interval": 4, "save_last": True}
        if crash:
            try:
                _runner(directory, [EMA, CrashAfter(crash)], checkpoint=checkpoint,
                        strategy=strategy).train()
            except Killed:
                pass
        runner = _runner(directory, [EMA], checkpoint=checkpoint, strategy=strategy,
                         resume=bool(crash))
        runner.train()
        hook = next(h for h in runner.hooks if isinstance(h, EMAHook))
        shards = sum(t.numel() for t in hook.average.values())
        out[name] = (shards, hook.state_dict(), str(runner.work_dir))
        runner.close()
    return dist.get_rank(), out


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_average_resumes_exactly_on_every_rank(run_on, tmp_path, strategy):
    results = run_on(2)(_resume_body, str(tmp_path), STRATEGIES[strategy])
    whole = sum(p.numel() for p in ToyModel().parameters())
    for _, out in results:
        straight, resumed = out["straight"][1], out["resumed"][1]
        assert straight["updates"] == resumed["updates"] == 12
        assert straight["weights"].keys() == resumed["weights"].keys()
        for name, tensor in straight["weights"].items():
            assert torch.equal(tensor, resumed["weights"][name]), name
        shards = out["straight"][0]
        assert shards == whole if strategy == "ddp" else shards < whole  # its own part only
    assert _losses_and_vals(tmp_path / "resumed") == _losses_and_vals(tmp_path / "straight")
    saved = read_train_state(results[0][1]["straight"][2])["hooks"]["EMAHook"]  # no group
    for name, tensor in results[0][1]["straight"][1]["weights"].items():
        assert torch.equal(saved["weights"][name], tensor), name

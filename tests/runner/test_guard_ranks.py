"""The guard on 2 ranks under every strategy: a sample that makes the loss nan reaches one
rank only (rank 1: without shuffling it holds the odd samples), and both ranks stop at the
same step naming that rank, with the good checkpoints kept; rolled back, both ranks train on
alike and a second run repeats the first bit for bit; with skip_step, the step is skipped on
both and the weights stay finite. The guard itself: test_guard.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import trainrun.dist as dist
from tests.records import records, train_records
from tests.runner.toy import nonfinite_in
from trainrun.runner.hooks.guard import GuardStop
from trainrun.runner.runner import Runner

# sample 131 is rank 1's: its share is samples 1, 3, 5, ..., four a step: step 131 // 8 + 1
BAD_SAMPLE, BAD_STEP = 131, 17
STRATEGIES = {
    "ddp": "ddp",
    "fsdp": "fsdp",
    # both ranks hold half of each split layer and see the same batches: sample 131 is in
    # step 33's batch (4 a step), on both ranks, so rank 0 names it
    "fsdp-tp2": {"type": "fsdp", "tp": 2, "tp_plan": {"net.0": "colwise", "net.3": "rowwise"}},
    # two stages of StackToy, the same batches on both ranks (the loss reaches every stage)
    "fsdp-pp2": {"type": "fsdp", "pp": 2, "pp_microbatches": 2},
    "zero1": {"type": "deepspeed", "zero_stage": 1},
    "zero2": {"type": "deepspeed", "zero_stage": 2},
    "zero3": {"type": "deepspeed", "zero_stage": 3},
}
SLOW = ("zero1", "zero2", "zero3", "fsdp-tp2", "fsdp-pp2")  # the fast tier: ddp and fsdp
ONE_COPY = ("fsdp-tp2", "fsdp-pp2")  # no data parallelism: both ranks see every batch


def _runner(work_dir, strategy, guard, logging=None, precision="fp32"):
    pipeline = isinstance(strategy, dict) and "pp" in strategy
    return Runner(
        model={"type": "tests.runner.toy.StackToy" if pipeline else "tests.runner.toy.ToyModel",
               "dropout": 0.0}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.PoisonedRegression", "bad": [BAD_SAMPLE],
                          "size": 1024, "batch_size": 4, "shuffle": False, "drop_last": True},
        optim={"type": "AdamW", "lr": 0.01}, strategy=strategy, precision=precision,
        schedule={"max_iters": 40}, randomness={"seed": 5},
        logging=logging or {"interval": 10, "backends": ["jsonl"]},
        checkpoint={"interval": 5, "max_keep": 2}, guard=guard)


def _guard_body(root, strategy):
    """A run with the default guard (stop), two alike that roll back (logging each value's
    mean over 3 steps, whose content the checkpoints carry), and one that skips steps: what
    each rank saw of the stop, where the rollbacks left it, and whether its weights are
    finite after skipping."""
    out = {}
    with _runner(f"{root}/stop", strategy, None) as runner:
        try:
            runner.train()
        except GuardStop as stop:
            out["stop"] = (stop.step, stop.rank, stop.detail)
    rolled = []
    for name in ("a", "b"):
        with _runner(f"{root}/{name}", strategy, {"nonfinite": "rollback", "skip_batches": 3},
                     logging={"interval": 10, "backends": ["jsonl"], "window": 3}) as runner:
            runner.train()
            rolled.append((runner.iter, runner.guard.skip_batches))
    out["rolled"] = rolled
    with _runner(f"{root}/skip", strategy, {"nonfinite": "skip_step"}) as runner:
        runner.train()
        out["finite"] = all(bool(torch.isfinite(p).all()) for p in runner.model.parameters())
    return dist.get_rank(), out


def _checkpoint_names(work_dir) -> list[str]:
    return sorted(p.name for p in (Path(work_dir) / "checkpoints").iterdir()
                  if p.name.startswith("iter_") and not p.name.endswith(".sha256"))


@pytest.mark.parametrize("strategy", [pytest.param(name, marks=pytest.mark.slow)
                                      if name in SLOW else name for name in STRATEGIES])
def test_an_event_on_one_rank_is_acted_on_by_every_rank(run_on, tmp_path, strategy):
    results = dict(run_on(2)(_guard_body, str(tmp_path), STRATEGIES[strategy]))
    step, rank = (33, 0) if strategy in ONE_COPY else (BAD_STEP, 1)
    for out in results.values():  # both ranks stopped at the same step, naming the same rank
        assert out["stop"][:2] == (step, rank), out["stop"]
        assert out["stop"][2].startswith("loss is nan; stopped (guard: stop); iter_")
        assert out["rolled"] == [(40, 3), (40, 3)]
        assert out["finite"]
    stop = tmp_path / "stop"
    kept = _checkpoint_names(stop)
    last = (stop / "checkpoints" / "last").read_text().strip()
    newest = f"iter_{(step - 1) // 5 * 5}"
    assert last.startswith(newest) and kept[-1].startswith(newest), (kept, last)
    assert len(kept) == 2  # max_keep: the good ones, not pruned for later bad ones
    for name in kept:
        assert nonfinite_in(stop / "checkpoints" / name) == [], name
    [event] = [r for r in records(stop) if r.get("mode") == "guard"]
    assert (event["step"], event["rank"], event["name"]) == (step, rank, "loss")
    a, b = train_records(tmp_path / "a"), train_records(tmp_path / "b")
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b]
    assert [r["step"] for r in a] == [10, 20, 30, 40]
    [mark] = [r for r in records(tmp_path / "a") if r.get("mode") == "rollback"]
    assert (mark["at_step"], mark["rank"]) == (step, rank)
    for run in ("a", "skip"):
        for name in _checkpoint_names(tmp_path / run):
            assert nonfinite_in(tmp_path / run / "checkpoints" / name) == [], (run, name)
    skipped = [(r["step"], r["skipped_steps"]) for r in records(tmp_path / "skip")
               if r.get("mode") == "guard"]
    assert skipped == [(step, 1)]
    assert all(math.isfinite(r["loss"]) for r in train_records(tmp_path / "skip"))


def _skip_body(root, strategy, precision):
    """A run that skips the bad step: whether each rank's weights are finite at the end."""
    with _runner(root, strategy, {"nonfinite": "skip_step"}, precision=precision) as runner:
        runner.train()
        return all(bool(torch.isfinite(p).all()) for p in runner.model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("strategy, precision", [
    ({"type": "deepspeed", "zero_stage": 0}, "fp32"),  # the gradients dropped before its step
    ({"type": "deepspeed", "zero_stage": 2}, "bf16"),  # ZeRO skips it by itself; counted
    ({"type": "fsdp", "mixed_precision": {"param_dtype": "bf16"}}, "fp32"),
], ids=["zero0-fp32", "zero2-bf16", "fsdp-bf16-params"])
def test_skip_step_under_other_precisions_and_engines(run_on, tmp_path, strategy, precision):
    assert run_on(2)(_skip_body, str(tmp_path), strategy, precision) == [True, True]
    skipped = [(r["step"], r["name"]) for r in records(tmp_path) if r.get("mode") == "guard"]
    assert skipped == [(BAD_STEP, "gradients")]
    for name in _checkpoint_names(tmp_path):
        assert nonfinite_in(tmp_path / "checkpoints" / name) == [], name

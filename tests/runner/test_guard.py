"""The guard: a run whose loss turns nan, or spikes, at a known step (a user's damaged data),
is stopped, warned about, rolled back or has its step skipped as the config says; no
checkpoint holds a value that is not finite and the good ones are kept; rolled-back runs
repeat bit for bit and resume exactly after a kill. Several ranks: tests/runner/
test_guard_ranks.py; the command line's one line: tests/tools/test_guard_cli.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.records import records, train_records
from tests.runner.toy import CrashAfter, Killed, nonfinite_in
from trainrun.checkpoint.read import read_train_state
from trainrun.runner.config import ConfigError
from trainrun.runner.hooks import Hook
from trainrun.runner.hooks.guard import GuardStop, check_guard
from trainrun.runner.optim.wrapper import OptimWrapper
from trainrun.runner.runner import Runner

# without shuffling, sample 130 is in step 33's batch (4 a step); 250 in step 63's
NAN_AT, NAN_SAMPLE = 33, 130


def _runner(work_dir, guard=None, *, bad=(NAN_SAMPLE,), target=float("nan"), max_iters=60,
            resume=False, checkpoint=None, logging=None, hooks=(), precision="fp32"):
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.PoisonedRegression", "bad": list(bad),
                          "target": target, "size": 1024, "batch_size": 4, "shuffle": False},
        optim={"type": "AdamW", "lr": 0.01}, strategy="none", precision=precision,
        schedule={"max_iters": max_iters}, randomness={"seed": 5},
        logging=logging or {"interval": 10, "backends": ["jsonl"]},
        checkpoint=checkpoint or {"interval": 10, "max_keep": 2},
        guard=guard, resume=resume, hooks=list(hooks))


def _checkpoints(work_dir) -> list[str]:
    return sorted(p.name for p in (Path(work_dir) / "checkpoints").glob("iter_*.pth"))


def _last(work_dir) -> str:
    return (Path(work_dir) / "checkpoints" / "last").read_text().strip()


def _guard_records(work_dir) -> list[dict]:
    return [r for r in records(work_dir) if r.get("mode") in ("guard", "rollback")]


def _all_finite(work_dir) -> None:
    for checkpoint in (Path(work_dir) / "checkpoints").glob("*.pth"):
        assert nonfinite_in(checkpoint) == [], checkpoint


# ---------------------------------------------------------------- the config section

def test_the_section_has_defaults_and_refuses_bad_values_by_name():
    assert check_guard("guard", None) == {"nonfinite": "stop", "spike": None,
                                          "skip_batches": 200, "max_rollbacks": 3}
    assert check_guard("guard", {"spike": {}})["spike"] == {"factor": 3.0, "window": 100,
                                                            "action": "rollback"}
    with pytest.raises(ConfigError, match=r"^guard.nonfinite: got 'skip', expected one of "
                                          r"stop, rollback, warn, skip_step; did you mean "
                                          r"'skip_step'\?$"):
        check_guard("guard", {"nonfinite": "skip"})
    with pytest.raises(ConfigError, match=r"^guard.spike.action: got 'skip_step', expected "
                                          r"one of rollback, stop, warn"):
        check_guard("guard", {"spike": {"action": "skip_step"}})
    with pytest.raises(ConfigError, match=r"^guard.spike.factor: got 1, expected a number > 1$"):
        check_guard("guard", {"spike": {"factor": 1}})
    with pytest.raises(ConfigError, match=r"^unknown key 'guard.max_rollback'; did you mean "
                                          r"'guard.max_rollbacks'\?$"):
        check_guard("guard", {"max_rollback": 2})


# ---------------------------------------------------------------- stop (the default)

def test_a_nan_loss_stops_the_run_naming_the_step_with_the_good_checkpoints_kept(tmp_path):
    with _runner(tmp_path) as runner, pytest.raises(GuardStop) as stop:
        runner.train()
    assert (stop.value.step, stop.value.rank) == (NAN_AT, 0)
    assert str(stop.value) == ("step 33, rank 0: loss is nan; stopped (guard: stop); "
                               "iter_30.pth is the newest good checkpoint")
    # found at the logged step 40, before its checkpoint: the good ones are all there
    assert _checkpoints(tmp_path) == ["iter_20.pth", "iter_30.pth"]
    assert _last(tmp_path) == "iter_30.pth"
    _all_finite(tmp_path)
    assert _guard_records(tmp_path) == [{"step": 33, "mode": "guard", "event": "nonfinite",
                                         "name": "loss", "value": "nan", "rank": 0,
                                         "action": "stop"}]
    log = (tmp_path / "train.log").read_text()
    assert "WARNING guard: step 33, rank 0: loss is nan; stopping" in log


class BreakWeights(Hook):
    """Writes inf into a weight after step ``step``, the loss of that step still finite, as
    an optimiser step that overflows does."""

    priority = 55  # after the guard's look at the logged step, before the checkpoint

    def __init__(self, step: int):
        self.step = step

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        if runner.iter == self.step:
            with torch.no_grad():
                next(runner.model.parameters())[0, 0] = math.inf


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    """The look before every checkpoint reads the weights and the optimiser state."""
    with _runner(tmp_path, bad=(), hooks=[BreakWeights(20)]) as runner, \
            pytest.raises(GuardStop, match=r"^step 20, rank 0: the weights hold inf values; "
                                           r"stopped \(guard: stop\); iter_10.pth is the newest "
                                           r"good checkpoint$"):
        runner.train()
    assert _checkpoints(tmp_path) == ["iter_10.pth"]


# ---------------------------------------------------------------- warn

def test_warn_trains_on_and_never_prunes_a_good_checkpoint_for_a_bad_one(tmp_path):
    with _runner(tmp_path, {"nonfinite": "warn"}) as runner:
        runner.train()
    # max_keep 2: steps 40-60 held nan weights and were not written, so 20 and 30 stay
    assert _checkpoints(tmp_path) == ["iter_20.pth", "iter_30.pth"]
    assert _last(tmp_path) == "iter_30.pth"
    _all_finite(tmp_path)
    events = [(r["step"], r["name"], r["action"]) for r in _guard_records(tmp_path)]
    assert events[:2] == [(33, "loss", "warn"), (40, "weights", "warn")]
    assert events[-1][:2] == (60, "weights")  # the last save's too
    log = (tmp_path / "train.log").read_text()
    assert "guard: step 40, rank 0: the weights hold nan values; training goes on, this " \
           "checkpoint is not written" in log


# ---------------------------------------------------------------- skip_step

def test_skip_step_skips_the_bad_step_and_counts_it(tmp_path):
    with _runner(tmp_path, {"nonfinite": "skip_step"}) as runner:
        runner.train()
        assert all(torch.isfinite(p).all() for p in runner.model.parameters())
    assert _checkpoints(tmp_path) == ["iter_50.pth", "iter_60.pth"]
    _all_finite(tmp_path)
    assert _guard_records(tmp_path) == [{"step": 33, "mode": "guard", "event": "nonfinite",
                                         "name": "gradients", "action": "skip_step",
                                         "skipped_steps": 1}]
    assert all(math.isfinite(r["loss"]) for r in train_records(tmp_path))
    assert "guard: step 33 skipped: gradients not finite (1 skipped in all)" in \
        (tmp_path / "train.log").read_text()
    assert read_train_state(tmp_path / "checkpoints" / "iter_60.pth")["hooks"]["GuardHook"] \
        ["per_rank"][0]["skipped_steps"] == 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_skip_step_under_mixed_precision(tmp_path, precision):
    """Under fp16 the gradient scaler's own skips (its scale too high at first) are counted
    too: they are skipped steps as well."""
    with _runner(tmp_path, {"nonfinite": "skip_step"}, precision=precision) as runner:
        runner.train()
        assert all(torch.isfinite(p).all() for p in runner.model.parameters())
    skipped = [r["step"] for r in _guard_records(tmp_path)]
    assert NAN_AT in skipped and (precision == "fp16" or skipped == [NAN_AT])
    _all_finite(tmp_path)


def test_a_skipped_step_changes_neither_weights_nor_optimiser_state():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    wrapper = OptimWrapper(optimizer)
    wrapper.skip_nonfinite = True
    wrapper.set_total(0, 10)
    wrapper.update_params(model(torch.ones(1, 3)).sum())  # a good step first
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    wrapper.update_params(model(torch.full((1, 3), math.nan)).sum())
    assert wrapper.skipped == [2]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(v, optimizer.state[model.weight][k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())  # dropped, as after any step


# ---------------------------------------------------------------- rollback

def _rolled_back(work_dir, kill=None, **options):
    with _runner(work_dir, {"nonfinite": "rollback", "skip_batches": 5}, **options) as runner:
        if kill is not None:
            runner.hooks.append(kill)
        runner.train()
        return runner.guard.in_a_row(runner)


def test_rollback_reloads_the_checkpoint_skips_the_bad_data_and_repeats_bit_for_bit(tmp_path):
    assert _rolled_back(tmp_path / "a") == 0  # reset by the checkpoint written after it
    _rolled_back(tmp_path / "b")
    a, b = train_records(tmp_path / "a"), train_records(tmp_path / "b")
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b]
    assert [r["step"] for r in a] == [10, 20, 30, 40, 50, 60]  # each step once
    assert all(math.isfinite(r["loss"]) for r in a)
    [mark] = _guard_records(tmp_path / "a")
    assert mark == {"step": 30, "mode": "rollback", "event": "nonfinite", "name": "loss",
                    "value": "nan", "at_step": 33, "rank": 0,
                    "checkpoint": str(tmp_path / "a" / "checkpoints" / "iter_30.pth"),
                    "batches_skipped": 8, "rollbacks_in_a_row": 1}
    # the data after the rollback starts past the bad batch and 5 more: step 31 trained on
    # the batch step 33 + 5 + 1 = 39 would have; 60 steps trained, on 68 batches' data
    sampler = read_train_state(tmp_path / "a" / "checkpoints" / "iter_60.pth")["sampler"]
    assert sampler["cursor"] == (60 + 8) * 4
    _all_finite(tmp_path / "a")
    log = (tmp_path / "a" / "train.log").read_text()
    assert ("WARNING guard: step 33, rank 0: loss is nan; rolling back\n" in log)
    assert ("WARNING guard: rolled back to iter_30.pth (step 30); skipping 8 batches "
            "(rollback 1 in a row, of at most 3)\n") in log


class KillAt(CrashAfter):
    """`CrashAfter` the ``times``-th time training reaches step ``step`` (a rollback trains
    steps again)."""

    def __init__(self, step, times=1):
        super().__init__(step)
        self.times = times

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        if runner.iter == self.step:
            self.times -= 1
            if self.times == 0:
                super().after_train_iter(runner, batch_idx, batch, outputs)


@pytest.mark.parametrize("step, times", [(36, 1), (36, 2), (45, 1)],
                         ids=["before-the-look", "after-the-rollback", "after-its-checkpoint"])
def test_a_kill_around_a_rollback_resumes_to_the_unbroken_runs_numbers(tmp_path, step, times):
    """Killed after the bad step before the look that finds it, after the rollback before
    the checkpoint that follows it (both resume from step 30 and roll back again, alike), or
    after that checkpoint (which holds the skipped batches in its sampler's place)."""
    _rolled_back(tmp_path / "straight")
    with pytest.raises(Killed):
        _rolled_back(tmp_path / "killed", kill=KillAt(step, times))
    with _runner(tmp_path / "killed", {"nonfinite": "rollback", "skip_batches": 5},
                 resume=True) as runner:
        runner.train()
    straight = [(r["step"], r["loss"]) for r in train_records(tmp_path / "straight")]
    assert [(r["step"], r["loss"]) for r in train_records(tmp_path / "killed")] == straight
    # the same rollback, once or (killed after it and rolled back again) twice at step 30
    [straight_mark] = _marks(tmp_path / "straight")
    assert _marks(tmp_path / "killed") in ([straight_mark], [straight_mark] * 2)


def _marks(work_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "checkpoint"}
            for r in _guard_records(work_dir) if r["mode"] == "rollback"]


def test_rollbacks_in_a_row_stop_the_run_after_max_rollbacks(tmp_path):
    """Every batch from sample 130 on is bad: each rollback finds another before a
    checkpoint is written. The second skips the batches the first did, and the one its
    step 31 trained on."""
    bad = range(NAN_SAMPLE, 1024)
    with _runner(tmp_path, {"nonfinite": "rollback", "skip_batches": 0, "max_rollbacks": 2},
                 bad=bad) as runner, pytest.raises(GuardStop) as stop:
        runner.train()
    assert str(stop.value).startswith("step 31, rank 0: loss is nan; stopped after 2 "
                                      "rollbacks in a row (guard.max_rollbacks); iter_30.pth "
                                      "is the newest good checkpoint")
    marks = [r for r in _guard_records(tmp_path) if r["mode"] == "rollback"]
    assert [(m["at_step"], m["batches_skipped"]) for m in marks] == [(33, 3), (31, 4)]


def test_a_rollback_with_no_checkpoint_before_the_event_stops(tmp_path):
    with _runner(tmp_path, {"nonfinite": "rollback"}, bad=(10,)) as runner, \
            pytest.raises(GuardStop, match=r"^step 3, rank 0: loss is nan; cannot roll back; "
                                           r"the run has no checkpoint from before it$"):
        runner.train()


# ---------------------------------------------------------------- spikes

def test_a_loss_spike_is_named_against_its_median_and_stops(tmp_path):
    guard = {"spike": {"factor": 5.0, "window": 20, "action": "stop"}}
    with _runner(tmp_path, guard, target=1e4) as runner, pytest.raises(GuardStop) as stop:
        runner.train()
    assert stop.value.step == NAN_AT and stop.value.event.kind == "spike"
    assert str(stop.value).startswith("step 33, rank 0: loss ")
    assert "times its median over the last 20 steps" in str(stop.value)
    [record] = _guard_records(tmp_path)
    assert record["event"] == "spike" and record["value"] > 5 * record["median"]


def test_a_spike_rolled_back_trains_on_without_it(tmp_path):
    guard = {"spike": {"factor": 5.0, "window": 20}, "skip_batches": 2}
    with _runner(tmp_path, guard, target=1e4) as runner:
        runner.train()
    [mark] = _guard_records(tmp_path)
    assert (mark["mode"], mark["event"], mark["at_step"], mark["batches_skipped"]) == \
        ("rollback", "spike", 33, 5)
    # the spike window is each rank's, saved in every checkpoint
    state = read_train_state(tmp_path / "checkpoints" / "iter_60.pth")["hooks"]["GuardHook"]
    assert len(state["per_rank"][0]["losses"]) == 20


def test_warnings_and_a_window_above_one_keep_a_rollback_exact(tmp_path):
    """``logging.window`` means span the rollback: their content is in the checkpoint."""
    logging = {"interval": 5, "backends": ["jsonl"], "window": 3}
    _rolled_back(tmp_path / "a", logging=logging)
    _rolled_back(tmp_path / "b", logging=logging)
    assert [(r["step"], r["loss"]) for r in train_records(tmp_path / "a")] == \
        [(r["step"], r["loss"]) for r in train_records(tmp_path / "b")]

"""Hooks: when the checkpoint hook saves (interval, save_last, save_best), what the logger
hook writes (rank 0 only, the loss averaged over ranks), and when validation runs."""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import trainrun.dist as dist
from trainrun.dist import Handle
from trainrun.runner.hooks import CheckpointHook, Hook, IterTimerHook, LoggerHook, ValidationHook
from trainrun.runner.hooks.logger import (
    Gathering,
    gather_logged,
    peak_memory_mb,
    window_means,
)
from trainrun.runner.hooks.timer import batch_counts
from trainrun.runner.preemption import Preempted
from trainrun.runner.run_dir import MetricsFile
from trainrun.runner.runner import Runner


class FakeRunner:
    """What the hooks read of a runner, recording the saves and validations they ask for."""

    def __init__(self, by_epoch=True, max_epochs=5, iters_per_epoch=4, training=True):
        self.by_epoch = by_epoch
        self.max_epochs = max_epochs
        self.max_iters = max_epochs * iters_per_epoch
        self.epoch = self.iter = 0
        self.training = training
        self.saved: list[tuple[str, bool]] = []
        self.removed: list[Path] = []
        self.validated: list[int] = []
        self.background: list[str] = []  # the saves asked for with background=True
        self.polls = self.finishes = 0
        self.checkpoints = SimpleNamespace(remove=self.removed.append, poll=self._poll,
                                           finish=self._finish)

    def _poll(self):
        self.polls += 1

    def _finish(self):
        self.finishes += 1

    def checkpoint_tag(self):
        return f"epoch_{self.epoch}" if self.by_epoch else f"iter_{self.iter}"

    def save_checkpoint(self, name=None, update_last=True, background=False):
        name = name or self.checkpoint_tag()
        self.saved.append((name, update_last))
        if background:
            self.background.append(name)
        return Path("/ckpt") / f"{name}.pth"

    def val(self):
        self.validated.append(self.epoch if self.by_epoch else self.iter)


def run_schedule(runner, *hooks):
    """Call the hooks as the train loop does, to the end of ``runner``'s schedule."""
    for hook in hooks:
        hook.before_train(runner)
    while (runner.epoch < runner.max_epochs) if runner.by_epoch \
            else (runner.iter < runner.max_iters):
        for batch_idx in range(runner.max_iters // runner.max_epochs):
            runner.iter += 1
            for hook in hooks:
                hook.after_train_iter(runner, batch_idx, None, {})
            if not runner.by_epoch and runner.iter >= runner.max_iters:
                break
        else:
            runner.epoch += 1
            for hook in hooks:
                hook.after_train_epoch(runner)
    for hook in hooks:
        hook.after_train(runner)


# ---------------------------------------------------------------- checkpoint hook


@pytest.mark.parametrize(("interval", "save_last", "max_epochs", "expected"), [
    (2, True, 5, ["epoch_2", "epoch_4", "epoch_5"]),
    (2, True, 4, ["epoch_2", "epoch_4"]),  # the last is not saved twice
    (2, False, 5, ["epoch_2", "epoch_4"]),
    (0, True, 3, ["epoch_3"]),
])
def test_checkpoint_interval_by_epoch(interval, save_last, max_epochs, expected):
    runner = FakeRunner(by_epoch=True, max_epochs=max_epochs)
    run_schedule(runner, CheckpointHook(interval, save_last))
    assert runner.saved == [(name, True) for name in expected]


@pytest.mark.parametrize(("interval", "save_last", "expected"), [
    (3, True, ["iter_3", "iter_6", "iter_7"]),
    (3, False, ["iter_3", "iter_6"]),
    (7, True, ["iter_7"]),
])
def test_checkpoint_interval_by_iteration(interval, save_last, expected):
    runner = FakeRunner(by_epoch=False, max_epochs=2)
    runner.max_iters = 7  # stops inside the second epoch
    run_schedule(runner, CheckpointHook(interval, save_last))
    assert runner.saved == [(name, True) for name in expected]


def test_async_checkpoints_are_periodic_ones_and_the_end_waits():
    """checkpoint.async: periodic saves go to the background and are polled after every
    step; the last one is written in the foreground and the end waits for any write."""
    runner = FakeRunner(by_epoch=False, max_epochs=2)
    runner.max_iters = 7
    run_schedule(runner, CheckpointHook(3, True, background=True))
    assert runner.saved == [("iter_3", True), ("iter_6", True), ("iter_7", True)]
    assert runner.background == ["iter_3", "iter_6"]
    assert runner.polls == 7 and runner.finishes == 1


@pytest.mark.parametrize(("metric", "rule", "values", "kept"), [
    ("mse", "less", [0.5, 0.3, 0.4, 0.2], [0, 1, 3]),
    ("mse", "greater", [0.5, 0.3, 0.6, 0.2], [0, 2]),
    ("val_loss", None, [0.5, 0.3, 0.4, 0.2], [0, 1, 3]),  # a loss: lower is better
    ("accuracy", None, [0.5, 0.3, 0.6, 0.2], [0, 2]),  # anything else: higher
    ("mse", "less", [math.nan, 0.4, math.nan, 0.5], [1]),  # nan never improves
])
def test_save_best_keeps_only_the_best(metric, rule, values, kept):
    runner = FakeRunner(by_epoch=False)
    hook = CheckpointHook(interval=0, save_last=False, save_best=metric, best_rule=rule)
    for step, value in enumerate(values, start=1):
        runner.iter = step
        hook.after_val(runner, {metric: value, "other": 1.0})
    names = [f"best_{metric}_iter_{k + 1}" for k in kept]
    assert runner.saved == [(name, False) for name in names]  # `last` never moves to a best
    assert runner.removed == [Path("/ckpt") / f"{name}.pth" for name in names[:-1]]
    assert hook.state_dict() == {"best_value": values[kept[-1]],
                                 "best_path": f"/ckpt/{names[-1]}.pth"}
    fresh = CheckpointHook(save_best=metric, best_rule=rule)
    fresh.load_state_dict(hook.state_dict())
    runner.iter = 99
    fresh.after_val(runner, {metric: values[kept[-1]]})  # a tie is no improvement
    assert len(runner.saved) == len(names)


@pytest.mark.parametrize(("first", "rule", "values", "kept"), [
    ("accuracy", None, [0.5, 0.3, 0.6], [0, 2]),
    ("val_loss", None, [0.5, 0.6, 0.4], [0, 2]),  # a loss: lower is better
    ("accuracy", "less", [0.5, 0.3, 0.6], [0, 1]),
])
def test_save_best_auto_keeps_the_best_of_the_first_metric_reported(first, rule, values, kept):
    runner = FakeRunner(by_epoch=False)
    hook = CheckpointHook(interval=0, save_last=False, save_best="auto", best_rule=rule)
    for step, value in enumerate(values, start=1):
        runner.iter = step
        hook.after_val(runner, {first: value, "other": 1.0 - value})
    assert hook.save_best == first
    assert runner.saved == [(f"best_{first}_iter_{k + 1}", False) for k in kept]


def test_save_best_outside_training_or_on_a_missing_metric_saves_nothing(caplog):
    runner = FakeRunner(training=False)
    hook = CheckpointHook(save_best="mse")
    hook.after_val(runner, {"mse": 0.1})
    assert runner.saved == []
    runner.training = True
    hook = CheckpointHook(save_best="mAP")
    logger = logging.getLogger("trainrun")
    logger.addHandler(caplog.handler)
    try:
        hook.after_val(runner, {"mse": 0.1})
    finally:
        logger.removeHandler(caplog.handler)
    assert "checkpoint.save_best='mAP' is not among the validation metrics ['mse']" in caplog.text
    assert hook.save_best is None and runner.saved == []


def _save_best_runner(work_dir, rule):
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32, "batch_size": 8},
        val_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 21, "seed": 1,
                        "batch_size": 8},
        optim={"type": "SGD", "lr": 0.05}, strategy="none", schedule={"max_epochs": 4},
        logging={"interval": 4, "backends": ["jsonl"]},
        checkpoint={"interval": 0, "max_keep": 1, "save_best": "mse", "best_rule": rule},
    )


@pytest.mark.parametrize("rule", ["less", "greater"])
def test_save_best_in_a_run(tmp_path, rule):
    runner = _save_best_runner(tmp_path, rule)
    runner.train()
    runner.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"] // 4, r["mse"]) for r in records if r.get("mode") == "val"]
    assert [epoch for epoch, _ in val] == [1, 2, 3, 4]
    pick = min if rule == "less" else max
    best_epoch = pick(val, key=lambda item: item[1])[0]
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(  # each with its manifest
        [f"best_mse_epoch_{best_epoch}.pth", f"best_mse_epoch_{best_epoch}.pth.sha256",
         "epoch_4.pth", "epoch_4.pth.sha256", "last"])
    assert (checkpoints / "last").read_text().strip() == "epoch_4.pth"


# ---------------------------------------------------------------- logger hook


def _logger_runner(work_dir, max_iters, step_metrics=True):
    """What the logger reads of a runner, for ``max_iters`` steps writing into ``work_dir``."""
    return SimpleNamespace(iter=0, epoch=0, max_iters=max_iters, max_epochs=1, by_epoch=False,
                           work_dir=work_dir, device=torch.device("cpu"), cfg=None,
                           start_from=None,
                           metrics_file=MetricsFile(work_dir / "metrics.jsonl"),
                           optim_wrapper=SimpleNamespace(get_lr=lambda: 0.125),
                           timer=IterTimerHook(count_batches=step_metrics))


def _logger_body(base, step_metrics=True):
    rank = dist.get_rank()
    work_dir = Path(base) / f"rank{rank}"
    work_dir.mkdir()
    runner = _logger_runner(work_dir, 5, step_metrics)
    hook = LoggerHook(interval=2, backends=["jsonl"], progress_bar=False,
                      step_metrics=step_metrics)
    hook.before_train(runner)
    for step in range(1, 6):
        runner.iter = step
        outputs = {"loss": torch.tensor(0.1 * step + rank), "loss_x": torch.tensor(rank * 3.0)}
        hook.after_train_iter(runner, step - 1, None, outputs)
    hook.after_val(runner, {"mse": 0.25, "accuracy": 0.5})
    hook.after_train(runner)
    return rank


def _logged(base):
    lines = (Path(base) / "rank0" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_logger_writes_rank_means_from_rank_zero_only(run_on, tmp_path):
    run_on(2)(_logger_body, str(tmp_path))
    assert not (tmp_path / "rank1" / "metrics.jsonl").exists()
    records = _logged(tmp_path)
    train = [r for r in records if "mode" not in r]
    assert [r["step"] for r in train] == [2, 4, 5]  # every 2 steps and the last
    for record in train:
        step = record["step"]
        mean = ((torch.tensor(0.1 * step) + torch.tensor(0.1 * step + 1)) / 2).item()
        assert record["loss"] == mean  # the float32 mean, to the last bit
        assert record["loss_x"] == 1.5 and record["lr"] == 0.125 and record["epoch"] == 1
        assert {"time", "data_time", "compute_time", "samples_per_s", "peak_memory_mb"} \
            <= set(record)
        assert "grad_norm" not in record  # this wrapper measures none
    assert records[-1] == {"step": 5, "mode": "val", "mse": 0.25, "accuracy": 0.5}


def _preempted_logger_body(base):
    """Steps 1-4 logged every 2, a checkpoint after step 2; a preemption after step 4, whose
    numbers are on their way."""
    rank = dist.get_rank()
    work_dir = Path(base) / f"rank{rank}"
    work_dir.mkdir()
    runner = _logger_runner(work_dir, 10)
    hook = LoggerHook(interval=2, backends=["jsonl"], progress_bar=False)
    hook.before_train(runner)
    written = []
    for step in range(1, 5):
        runner.iter = step
        hook.after_train_iter(runner, step - 1, None, {"loss": torch.tensor(float(step))})
        if step == 2:
            hook.before_checkpoint_save(runner)  # a checkpoint of step 2 comes next
        written.append(_steps(work_dir) if rank == 0 else [])
    hook.on_error(runner, Preempted(4, "SIGTERM", "iter_4.pth", False))
    runner.metrics_file.close()
    return written, _steps(work_dir) if rank == 0 else []


def _steps(work_dir):
    path = work_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] \
        if path.exists() else []


def test_the_logger_writes_a_step_a_step_later_or_before_its_checkpoint(run_on, tmp_path):
    """Each rank's numbers travel while the next step trains; a step's line is on disk before
    its checkpoint (a run killed after it resumes from the next step); a preemption (every
    rank alive, the checkpoint of that step written) still gets the step's line."""
    written, final = run_on(2)(_preempted_logger_body, str(tmp_path))[0]
    assert written == [[], [2], [2], [2]]
    assert final == [2, 4]


def test_without_a_checkpoint_a_logged_step_is_written_once_the_next_one_is_done(tmp_path):
    runner = _logger_runner(tmp_path, 10)
    hook = LoggerHook(interval=2, backends=["jsonl"], progress_bar=False)
    written = []
    for step in range(1, 5):
        runner.iter = step
        hook.after_train_iter(runner, step - 1, None, {"loss": torch.tensor(float(step))})
        written.append(_steps(tmp_path))
    hook.after_train(runner)
    assert written == [[], [], [2], [2]] and _steps(tmp_path) == [2, 4]


class _Stuck:
    """A gather some rank never joined."""

    def is_completed(self):
        return False

    def result(self):
        raise AssertionError("waited for a gather that cannot finish")


def test_after_a_failure_the_logger_drops_a_line_whose_numbers_are_not_all_in(tmp_path):
    runner = SimpleNamespace(metrics_file=MetricsFile(tmp_path / "metrics.jsonl"))
    hook = LoggerHook(interval=1, backends=["jsonl"], progress_bar=False)
    hook._pending = SimpleNamespace(gathering=_Stuck(), record=_Stuck().result)
    hook.on_error(runner, RuntimeError("rank 1 is gone"))  # returns at once
    assert hook._pending is None and not (tmp_path / "metrics.jsonl").exists()


def _gather_logged_body():
    rank, world = dist.get_dist_info()
    values = {"loss": torch.tensor(0.1 + rank / 3), "aux": torch.tensor(1.5 + rank,
                                                                      dtype=torch.bfloat16),
              "count": 2.0 * rank}
    if rank % 2:  # a dict of the same keys in another order
        values = dict(reversed(values.items()))
    kept = values["loss"].clone()
    gathered = gather_logged(values, [8.0, 0.0, 100.0 + rank])
    assert torch.equal(values["loss"], kept)  # the outputs are left as they were
    if rank != 0:
        assert gathered is None
        return None
    means, counts = gathered
    return means, counts


def test_gather_logged_means_each_value_in_its_dtype_and_keeps_every_ranks_counts(on_ranks,
                                                                                   world_size):
    means, counts = on_ranks(_gather_logged_body)[0]
    assert list(means) == ["loss", "aux", "count"]  # rank 0's order
    losses = torch.tensor([0.1 + r / 3 for r in range(world_size)])  # float32, as logged
    exact = losses.double().sum() / world_size  # the float64 sum of float32s is exact
    assert means["loss"] == exact.float().item()  # to the bit: rounded once
    if world_size <= 2:  # and what an all_reduce of the loss gives
        assert means["loss"] == torch.true_divide(losses.sum(), world_size).item()
    aux = torch.tensor([1.5 + r for r in range(world_size)], dtype=torch.bfloat16)
    assert means["aux"] == torch.true_divide(aux.sum(), world_size).item()
    assert means["count"] == pytest.approx(world_size - 1)
    assert counts == [[8.0, 0.0, 100.0 + r] for r in range(world_size)]


def test_a_logged_mean_is_rounded_once_whatever_the_rows_hold():
    # four ranks' float32 losses whose float32 sum loses bits (1 + 2**-24 rounds to 1): the
    # mean is the exact one rounded once, the same with or without other columns beside it
    tiny = 2.0 ** -24
    losses = [1.0, tiny, tiny, tiny]
    expected = torch.tensor((1.0 + 3 * tiny) / 4, dtype=torch.float32).item()
    assert expected != torch.tensor(losses).sum().item() / 4  # float32 addition would differ
    for extra in ([], [[5.0, 1.0]] * 4):
        rows = torch.tensor([[loss, *(extra[i] if extra else [])]
                             for i, loss in enumerate(losses)], dtype=torch.float64)
        keys = ["loss", "a", "b"][:rows.shape[1]]
        dtypes = [torch.float32, torch.float64, torch.float32][:rows.shape[1]]
        gathering = Gathering(Handle(finish=lambda rows=rows: rows), keys, dtypes, keys, False)
        means, _ = gathering.result()
        assert means["loss"] == expected


def test_without_step_metrics_the_logger_writes_the_same_means_and_no_metrics(run_on, tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    on.mkdir(), off.mkdir()
    run_on(2)(_logger_body, str(on))
    run_on(2)(_logger_body, str(off), False)
    train_on = [r for r in _logged(on) if "mode" not in r]
    train_off = [r for r in _logged(off) if "mode" not in r]
    for a, b in zip(train_on, train_off, strict=True):
        assert list(b) == ["step", "epoch", "loss", "loss_x", "lr", "time", "data_time"]
        assert {k: a[k] for k in ("step", "epoch", "loss", "loss_x", "lr")} \
            == {k: b[k] for k in ("step", "epoch", "loss", "loss_x", "lr")}


def test_the_logger_asks_for_the_gradient_norm_of_the_logged_steps_only():
    asked: list[bool] = []

    class Wrapper:
        measure_grad_norm = None

        def __setattr__(self, name, value):
            asked.append(value)  # each time the logger tells it

    runner = SimpleNamespace(iter=0, max_iters=7, optim_wrapper=Wrapper(),
                             timer=IterTimerHook(), device=torch.device("cpu"))
    hook = LoggerHook(interval=3, backends=["jsonl"], progress_bar=False)
    wanted = []
    for step in range(1, 8):
        hook.before_train_iter(runner, step - 1, None)
        wanted.append(asked[-1])
        runner.iter = step
    assert wanted == [False, False, True, False, False, True, True]  # steps 3, 6 and the last
    assert asked == [False, True, False, True]  # told when the answer changes only
    off = LoggerHook(interval=3, backends=["jsonl"], progress_bar=False, step_metrics=False)
    runner.iter, asked[:] = 2, []
    off.before_train_iter(runner, 2, None)
    assert asked == []


class LossSpy(Hook):
    priority = 5

    def __init__(self):
        self.losses: list[float] = []

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        self.losses.append(outputs["loss"].item())


class LateLossSpy(LossSpy):
    priority = 30  # after the logger


def _run_logging_body(work_dir, step_metrics=True, clip_grad=None, window=1, max_iters=3):
    spy, late = LossSpy(), LateLossSpy()
    runner = Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32, "batch_size": 4},
        optim={"type": "SGD", "lr": 0.01, "clip_grad": clip_grad}, strategy="ddp",
        schedule={"max_iters": max_iters}, randomness={"seed": 1, "diff_rank_seed": True},
        logging={"interval": 1, "backends": ["jsonl"], "step_metrics": step_metrics,
                 "window": window},
        checkpoint={"interval": 0},
        hooks=[spy, late],
    )
    runner.train()
    runner.close()
    assert late.losses == spy.losses  # the logger averaged copies: later hooks see their own
    return spy.losses


def test_a_run_logs_the_loss_averaged_over_ranks(run_on, tmp_path):
    """With diff_rank_seed the ranks' losses differ; rank 0 alone logs their mean (the test
    that test_runner.py had of this asserted nothing of the mean)."""
    own0, own1 = run_on(2)(_run_logging_body, str(tmp_path))
    assert [p.name for p in tmp_path.glob("metrics.jsonl*")] == ["metrics.jsonl"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["loss"] for line in lines if '"mode"' not in line]
    assert len(logged) == 3 and own0 != own1
    expected = [((torch.tensor(a) + torch.tensor(b)) / 2).item()
                for a, b in zip(own0, own1, strict=True)]
    assert logged == expected


def test_a_run_without_step_metrics_logs_the_same_losses_without_them(run_on, tmp_path):
    """The switch changes what is logged, not what is trained: with clipping (which measures
    the norm anyway) and without, the losses and learning rates are the same bits, and
    grad_norm, the rates and the memory are absent."""
    for clip in (None, 1e-3):
        lines = {}
        for on in (True, False):
            work_dir = tmp_path / f"{clip}-{on}"
            run_on(2)(_run_logging_body, str(work_dir), on, clip)
            lines[on] = [json.loads(line) for line in
                         (work_dir / "metrics.jsonl").read_text().splitlines()]
        for a, b in zip(lines[True], lines[False], strict=True):
            assert {"grad_norm", "samples_per_s", "peak_memory_mb"} <= set(a)
            # the counts averaged while the step computed: 2 ranks' batches of 4 a step
            assert a["samples_per_s"] * a["time"] == pytest.approx(8.0)
            assert a["peak_memory_mb"] > 0
            assert set(b) == {"step", "epoch", "loss", "lr", "time", "data_time"}
            assert (a["loss"], a["lr"]) == (b["loss"], b["lr"])


def _window_mean(losses, step, window):
    """The mean of the losses of steps ``step - window + 1`` to ``step`` (from 1), as float32."""
    last = torch.tensor(losses[max(0, step - window):step])
    return torch.true_divide(last.sum(0), len(last))


def test_a_window_logs_each_ranks_mean_of_its_last_steps_averaged_over_the_ranks(run_on,
                                                                                  tmp_path):
    """logging.window 3: each line holds each rank's mean of its last three losses (of the
    steps there were, at steps 1 and 2), then their mean over the ranks, to the last bit; the
    step metrics are the step's own as ever."""
    own0, own1 = run_on(2)(_run_logging_body, str(tmp_path), True, None, 3, 6)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [line["loss"] for line in lines if "mode" not in line]
    expected = [((_window_mean(own0, step, 3) + _window_mean(own1, step, 3)) / 2).item()
                for step in range(1, 7)]
    assert logged == expected
    per_step = [((torch.tensor(a) + torch.tensor(b)) / 2).item()
                for a, b in zip(own0, own1, strict=True)]
    assert logged[0] == per_step[0]
    assert all(a != b for a, b in zip(logged[1:], per_step[1:], strict=True))
    assert all(line["samples_per_s"] * line["time"] == pytest.approx(8.0) for line in lines)


def test_a_window_of_one_logs_each_steps_own_values_and_keeps_nothing(tmp_path):
    """The default: the step's own numbers (today's path, no mean of one value), no values
    kept, nothing in the checkpoint."""
    runner = _logger_runner(tmp_path, 4)
    hook = LoggerHook(interval=1, backends=["jsonl"], progress_bar=False)
    assert hook.window == 1
    for step in range(1, 5):
        runner.iter = step
        hook.after_train_iter(runner, step - 1, None, {"loss": torch.tensor(0.1 * step)})
    hook.after_train(runner)
    logged = [json.loads(line)["loss"] for line in
              (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [torch.tensor(0.1 * step).item() for step in range(1, 5)]
    assert not hook._recent and hook.state_dict() == {}


def test_a_window_averages_each_value_over_the_steps_that_returned_it(tmp_path):
    """Tensors and plain numbers alike; a value some steps leave out is the mean of the steps
    in the window that returned it; lr and the times are not averaged."""
    runner = _logger_runner(tmp_path, 6)
    hook = LoggerHook(interval=2, backends=["jsonl"], progress_bar=False, window=3)
    for step in range(1, 7):
        runner.iter = step
        outputs = {"loss": torch.tensor(float(step)), "count": 10.0 * step}
        if step % 2 == 0:
            outputs["aux"] = torch.tensor(float(step))
        hook.after_train_iter(runner, step - 1, None, outputs)
    hook.after_train(runner)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["count"], r["aux"], r["lr"]) for r in lines] == [
        (2, 1.5, 15.0, 2.0, 0.125), (4, 3.0, 30.0, 3.0, 0.125), (6, 5.0, 50.0, 5.0, 0.125)]


def test_a_windows_state_loads_as_a_checkpoint_is_read_and_gives_the_same_means(tmp_path):
    """Tensors on the CPU and plain numbers (a NumPy scalar too), which a checkpoint read with
    weights_only holds; the hook that loads them logs what the one that saved them would."""
    runner = _logger_runner(tmp_path, 4)
    hooks = [LoggerHook(interval=1, backends=["jsonl"], progress_bar=False, window=3)
             for _ in range(2)]
    for step in (1, 2):
        runner.iter = step
        hooks[0].after_train_iter(runner, step - 1, None, {"loss": torch.tensor(0.1 * step),
                                                           "n": np.float64(step / 3)})
    path = tmp_path / "state.pth"
    torch.save(hooks[0].state_dict(), path)
    hooks[1].load_state_dict(torch.load(path, weights_only=True))
    outputs = {"loss": torch.tensor(0.3), "n": np.float64(1.0)}
    means = [window_means(hook._recent + deque([outputs]), outputs) for hook in hooks]
    assert means[0]["loss"].item() == means[1]["loss"].item() and \
        means[0]["n"] == means[1]["n"]


def test_a_window_saved_by_another_number_of_ranks_starts_empty(tmp_path, caplog):
    hook = LoggerHook(interval=1, backends=["jsonl"], progress_bar=False, window=3)
    saved = [[{"loss": torch.tensor(1.0)}], [{"loss": torch.tensor(3.0)}]]  # two ranks'
    logger = logging.getLogger("trainrun")
    logger.addHandler(caplog.handler)
    try:
        hook.load_state_dict({"recent": saved})
    finally:
        logger.removeHandler(caplog.handler)
    assert not hook._recent
    assert "the checkpoint holds the last steps' values of 2 ranks, this job has 1" \
        in caplog.text
    hook.load_state_dict({"recent": saved[:1]})
    assert list(hook._recent) == saved[0]
    assert hook.state_dict() == {"recent": saved[:1]}
    LoggerHook(window=1, backends=["jsonl"], progress_bar=False).load_state_dict(
        {"recent": saved[:1]})  # a window of 1 has nothing to take


# ---------------------------------------------------------------- validation and timing


def test_validation_runs_on_the_interval_and_at_the_end():
    runner = FakeRunner(by_epoch=True, max_epochs=5)
    run_schedule(runner, ValidationHook(2))
    assert runner.validated == [2, 4, 5]
    runner = FakeRunner(by_epoch=False, max_epochs=2)
    runner.max_iters = 7
    run_schedule(runner, ValidationHook(3))
    assert runner.validated == [3, 6, 7]


def test_validation_begins_at_val_begin():
    runner = FakeRunner(by_epoch=True, max_epochs=6)
    run_schedule(runner, ValidationHook(2, begin=3))
    assert runner.validated == [4, 6]
    runner = FakeRunner(by_epoch=False, max_epochs=2)
    runner.max_iters = 7
    run_schedule(runner, ValidationHook(1, begin=6))
    assert runner.validated == [6, 7]


def test_iter_timer_averages_over_its_window(monkeypatch):
    clock = iter([0.0, 0.5, 1.0, 1.25, 3.0])
    monkeypatch.setattr("trainrun.runner.hooks.timer.time.perf_counter", lambda: next(clock))
    timer = IterTimerHook(window=2)
    assert timer.iter_time == 0.0 and timer.eta_seconds(10) == 0.0
    timer.before_train_epoch(None)  # 0.0
    timer.before_train_iter(None, 0, None)  # 0.5: waited 0.5 for data
    timer.after_train_iter(None, 0, None, {})  # 1.0: an iteration of 1.0
    timer.before_train_iter(None, 1, None)  # 1.25
    timer.after_train_iter(None, 1, None, {})  # 3.0: an iteration of 2.0
    assert timer.iter_time == 1.5 and timer.data_time == 0.375
    assert timer.eta_seconds(4) == 6.0


@pytest.mark.parametrize(("batch", "counts"), [
    ({"inputs": torch.zeros(5, 3), "labels": torch.zeros(5)}, (5, None)),
    ([torch.zeros(()), (torch.zeros(4, 2),)], (4, None)),  # the first with a batch dimension
    ({"num_tokens": torch.tensor([7, 9]), "x": {"ids": torch.zeros(2, 9)}}, (2, 16)),
    ({"num_tokens": 100, "x": torch.zeros(3)}, (3, 100)),
    ((torch.zeros(6, 2), torch.zeros(6)), (6, None)),
    ({"scale": torch.zeros(()), "x": [torch.zeros(7)]}, (7, None)),  # a 0-d tensor first
    ([], (0, None)),
    ({}, (0, None)),
    ("text", (0, None)),
])
def test_batch_counts_samples_and_stated_tokens(batch, counts):
    assert batch_counts(batch) == counts


def test_the_timer_window_counts_tokens_only_when_every_batch_states_them():
    timer = IterTimerHook(window=2)
    timer.before_train_epoch(None)
    for batch in ({"x": torch.zeros(2)}, {"x": torch.zeros(3), "num_tokens": 6},
                  {"x": torch.zeros(4), "num_tokens": 8}):
        timer.before_train_iter(None, 0, batch)
        timer.after_train_iter(None, 0, batch, {})
        seconds, samples, tokens = timer.window_counts()
    assert (samples, tokens) == (7, 14) and seconds == sum(timer.iter_times)
    timer.before_train_iter(None, 0, {"x": torch.zeros(1)})
    assert timer.window_counts()[2] is None


def test_the_timer_counts_no_batches_when_told_not_to():
    timer = IterTimerHook(count_batches=False)
    timer.before_train_epoch(None)
    timer.before_train_iter(None, 0, {"x": torch.zeros(2), "num_tokens": 4})
    timer.after_train_iter(None, 0, None, {})
    assert timer.window_counts()[1:] == (0, None) and len(timer.data_times) == 1


def test_peak_memory_on_cpu_is_the_process_peak_rss():
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert peak_memory_mb(torch.device("cpu")) == pytest.approx(peak, rel=0.01)


def test_a_metrics_line_cut_short_by_a_kill_is_ended_before_the_next_run_writes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo')  # killed mid-write
    metrics = MetricsFile(path)
    metrics.write({"step": 2, "loss": 2.25})
    metrics.write({"step": 3, "loss": 2.0})
    lines = path.read_text().splitlines()
    assert lines[1] == '{"step": 2, "lo' and [json.loads(x)["step"] for x in lines[2:]] == [2, 3]

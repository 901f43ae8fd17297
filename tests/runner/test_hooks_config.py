"""Hooks from the config (``hooks:``): the checks, the order, EarlyStopping and Profiler in a
run, and a hook's state through a checkpoint on 2 ranks under ddp, fsdp and ZeRO-3."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import trainrun.dist as dist
from tests.records import records as _records
from tests.runner.toy import CrashAfter, Killed
from trainrun.runner.config import ConfigError, load_config
from trainrun.runner.hooks import EarlyStoppingHook, ProfilerHook
from trainrun.runner.hooks.from_config import planned_order, priority_value
from trainrun.runner.hooks.logger import NOT_REPRODUCIBLE
from trainrun.runner.runner import Runner

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "digits_ddp.yaml"
COUNTER = "tests.tools.models.CountingHook"


def _hooks(value: str) -> list[dict]:
    return load_config(CONFIG, [f"hooks={value}"]).hooks


# ---------------------------------------------------------------- the config's checks

def test_no_hooks_is_an_empty_list():
    assert list(load_config(CONFIG).hooks) == []
    assert list(_hooks("null")) == []


def test_shipped_hooks_get_their_defaults_and_a_rule_from_the_metric():
    hooks = _hooks("[{type: EarlyStopping, metric: val_loss}, {type: EarlyStopping, "
                   "metric: accuracy, rule: less}, {type: Profiler, priority: 5}]")
    assert dict(hooks[0]) == {"type": "EarlyStopping", "metric": "val_loss", "rule": "less",
                              "patience": 5, "min_delta": 0.0}  # a loss: lower is better
    assert hooks[1].rule == "less"  # as written
    assert dict(hooks[2]) == {"type": "Profiler", "priority": 5, "wait": 1, "warmup": 1,
                              "active": 3, "repeat": 1, "ranks": [0], "record_shapes": False,
                              "profile_memory": False, "with_stack": False}


def test_a_users_hook_by_import_path_keeps_its_options():
    assert dict(_hooks(f"[{{type: {COUNTER}, weight: 3}}]")[0]) == {"type": COUNTER,
                                                                    "weight": 3}


@pytest.mark.parametrize(("value", "words"), [
    ("{type: EarlyStopping}", "hooks: got {'type': 'EarlyStopping'}, expected a list of hooks"),
    ("[{metric: accuracy}]", "hooks[0].type: missing"),
    ("[{type: earlystopping, metric: x}]", "did you mean 'EarlyStopping'?"),
    ("[{type: Profiler}, {type: Profilr}]", "hooks[1].type: unknown hook type 'Profilr'"),
    ("[{type: trainrun.runner.runner.Runner}]", "a subclass of trainrun.runner.hooks.Hook"),
    ("[{type: EarlyStopping, metric: accuracy, patience: 1.5}]",
     "hooks[0].patience: got 1.5, expected an int >= 1"),
    ("[{type: EarlyStopping, metric: accuracy, min_delta: fast}]", "hooks[0].min_delta"),
    ("[{type: Profiler, ranks: [0, -1]}]", "hooks[0].ranks: got [0, -1]"),
    ("[{type: Profiler, priority: after_lunch}]", "hooks[0].priority: got 'after_lunch'"),
    ("[{type: Profiler, priority: true}]", "hooks[0].priority: got true"),
    (f"[{{type: {COUNTER}, weight: 1, extra: 2}}]", "unknown key 'hooks[0].extra'"),
])
def test_bad_hooks_are_config_errors_naming_the_key(value, words):
    with pytest.raises(ConfigError) as error:
        _hooks(value)
    assert words in str(error.value)


def test_priority_names_place_a_hook_around_a_built_in_slot():
    assert [priority_value(v) for v in (7, "before_checkpoint", "after_validation",
                                        "after_preemption")] == [7, 59, 41, 71]
    rows = planned_order([("timer", 10), ("checkpoint", 60)], [
        {"type": "Profiler", "ranks": [0]}, {"type": COUNTER, "priority": 60},
        {"type": "EarlyStopping", "priority": "before_timer"}])
    assert [(n, item["type"]) for n, item in rows] == [
        (9, "EarlyStopping"), (10, "timer"), (60, "checkpoint"), (60, COUNTER), (80, "Profiler")]


# ---------------------------------------------------------------- EarlyStopping alone

def _stopping(values, **options):
    """Feed validations of ``values`` (one every 10 steps); the steps a stop was asked at."""
    stops: list[str] = []
    runner = SimpleNamespace(iter=0, training=True, request_stop=stops.append)
    hook = EarlyStoppingHook(**options)
    for i, value in enumerate(values, start=1):
        runner.iter = 10 * i
        hook.after_val(runner, {"acc": value, "other": 0.0})
    return hook, stops


def test_early_stopping_counts_validations_without_an_improvement():
    hook, stops = _stopping([0.5, 0.6, 0.6, 0.55, 0.7, 0.7, 0.69, 0.65], metric="acc",
                            patience=3)
    assert stops == ["early stopping at step 80: acc has not improved on 0.7 (step 50) for "
                     "3 validations"]
    assert hook.state_dict() == {"best": 0.7, "best_step": 50, "count": 3}


def test_early_stopping_min_delta_and_the_less_rule_and_nan():
    _, stops = _stopping([0.5, 0.52, 0.54, 0.545], metric="acc", patience=3, min_delta=0.05)
    assert stops == ["early stopping at step 40: acc has not improved on 0.5 (step 10) by "
                     "more than 0.05 for 3 validations"]
    _, stops = _stopping([0.5, 0.4, 0.45, 0.3], metric="acc", rule="less", patience=2)
    assert stops == []
    _, stops = _stopping([float("nan")], metric="acc", patience=1)
    assert stops == ["early stopping at step 10: acc has been nan for 1 validation"]


def test_early_stopping_state_resumes_the_count_and_a_stopped_run_stays_stopped():
    hook, _ = _stopping([0.5, 0.4], metric="acc", patience=3)
    fresh = EarlyStoppingHook(metric="acc", patience=3)
    fresh.load_state_dict(hook.state_dict())
    stops: list[str] = []
    runner = SimpleNamespace(iter=30, training=True, request_stop=stops.append)
    fresh.before_train(runner)
    assert stops == []
    fresh.after_val(runner, {"acc": 0.45})  # the 2nd without improvement
    runner.iter = 40
    fresh.after_val(runner, {"acc": 0.45})
    assert len(stops) == 1
    again = EarlyStoppingHook(metric="acc", patience=3)
    again.load_state_dict(fresh.state_dict())
    again.before_train(runner)  # resumed from where it stopped: stops before a step
    assert len(stops) == 2 and stops[1] == stops[0]


def test_early_stopping_refuses_bad_values_in_python_too():
    with pytest.raises(ValueError, match="patience: got 0"):
        EarlyStoppingHook(metric="acc", patience=0)
    with pytest.raises(ValueError, match="ranks: got"):
        ProfilerHook(ranks=[])


# ---------------------------------------------------------------- in a run

DATASET = "tests.runner.toy.ToyRegression"


def _runner(work_dir, hooks, *, max_iters=40, checkpoint=None, strategy="none", resume=False,
            val_interval=4):
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": DATASET, "size": 64, "batch_size": 4},
        val_dataloader={"type": DATASET, "size": 21, "seed": 1, "batch_size": 4},
        optim={"type": "AdamW", "lr": 0.01}, strategy=strategy,
        schedule={"max_iters": max_iters, "val_interval": val_interval},
        randomness={"seed": 3}, logging={"interval": 1, "backends": ["jsonl"]},
        checkpoint=checkpoint or {"interval": 0, "save_last": False}, resume=resume,
        hooks=hooks,
    )


def test_early_stopping_ends_the_run_with_a_checkpoint_and_one_line(tmp_path):
    """No periodic checkpoint and no save_last, yet the stop's step is saved; train.log says
    why in one line; the run ends as a finished one."""
    runner = _runner(tmp_path, [{"type": "EarlyStopping", "metric": "mse", "patience": 2,
                                 "min_delta": 1e9}])
    runner.train()
    runner.close()
    steps = [r["step"] for r in _records(tmp_path) if "mode" not in r]
    assert steps == list(range(1, 13))  # validations at 4, 8, 12: the best, then 2 without
    assert (tmp_path / "checkpoints" / "last").read_text().strip() == "iter_12.pth"
    log = (tmp_path / "train.log").read_text()
    lines = [line for line in log.splitlines() if "early stopping" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "for 2 validations; checkpoint iter_12.pth written"), log
    assert "early stopping at step 12: mse has not improved on " in lines[0]
    assert "(step 4) by more than 1e+09" in lines[0]


def test_hook_refusals_found_by_the_built_run_write_nothing(tmp_path):
    with pytest.raises(ConfigError, match=r"hooks\[0\].metric: got 'mes', expected one of "
                                          r"the validation metrics: mse; did you mean 'mse'"):
        _runner(tmp_path / "a", [{"type": "EarlyStopping", "metric": "mes"}])
    with pytest.raises(ConfigError, match=r"hooks\[1\].ranks: got \[0, 2\], expected ranks "
                                          r"below the world size \(1\)"):
        _runner(tmp_path / "a", [{"type": "Profiler"}, {"type": "Profiler", "ranks": [0, 2]}])
    with pytest.raises(ConfigError, match=r"hooks\[0\].weight: got 0"):
        _runner(tmp_path / "a", [{"type": COUNTER, "weight": 0}])
    assert not (tmp_path / "a").exists()


def test_priority_from_the_config_places_the_hook(tmp_path):
    runner = _runner(tmp_path, [{"type": COUNTER, "priority": "before_logger"},
                                {"type": "EarlyStopping", "metric": "mse"}])
    assert [type(h).__name__ for h in runner.hooks] == [
        "IterTimerHook", "CountingHook", "LoggerHook", "GuardHook", "ValidationHook",
        "EarlyStoppingHook", "CheckpointHook", "PreemptionHook"]
    runner.close()


def test_the_profiler_writes_a_trace_and_changes_no_loss(tmp_path):
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    for work_dir, hooks in ((plain, []), (profiled, [{"type": "Profiler", "wait": 2,
                                                      "warmup": 1, "active": 2}])):
        runner = _runner(work_dir, hooks, max_iters=8)
        runner.train()
        runner.close()
    def reproducible(work_dir):  # the records less the clock's and the memory's numbers
        return [{k: v for k, v in r.items() if k not in NOT_REPRODUCIBLE}
                for r in _records(work_dir)]

    assert reproducible(plain) == reproducible(profiled)
    traces = list((profiled / "profile" / "rank0").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1 and "traceEvents" in json.loads(traces[0].read_text())
    log = (profiled / "train.log").read_text()
    assert f"profiler: 1 trace(s) in {profiled / 'profile'}: rank0/{traces[0].name} " \
           f"(steps 4-5)" in log


def test_the_profiler_stops_when_training_fails(tmp_path):
    runner = _runner(tmp_path, [CrashAfter(4), ProfilerHook(wait=0, warmup=1, active=10)])
    profiler = next(h for h in runner.hooks if isinstance(h, ProfilerHook))
    with pytest.raises(Killed):
        runner.train()
    runner.close()
    assert profiler._profiler is None  # stopped; the window cut short is written
    assert len(profiler.written) == 1 and profiler.written[0][1:] == (2, 4)


# ---------------------------------------------------------------- state through a checkpoint

HOOKS = [{"type": "EarlyStopping", "metric": "mse", "patience": 3, "min_delta": 1e9},
         {"type": COUNTER, "weight": 2}]
STRATEGIES = {"ddp": "ddp", "fsdp": "fsdp", "zero3": {"type": "deepspeed", "zero_stage": 3}}


def _state_body(work_dir, strategy):
    """A straight run to its early stop (at step 8: validations every 2 steps, the first the
    best, then 3 without), then a run crashed after step 4 (checkpoints every 2) and resumed:
    each rank's hook states and where they stopped. Had the resumed run not restored
    EarlyStopping's count, it would stop at step 12."""
    ends = {}
    for name, crash in (("straight", None), ("resumed", 4)):
        directory = str(Path(work_dir) / name)
        checkpoint = {"interval": 2, "save_last": False}
        if crash:
            try:
                _runner(directory, [*HOOKS, CrashAfter(crash)], checkpoint=checkpoint,
                        strategy=strategy, val_interval=2).train()
            except Killed:
                pass
        runner = _runner(directory, HOOKS, checkpoint=checkpoint, strategy=strategy,
                         resume=bool(crash), val_interval=2)
        runner.train()
        ends[name] = (runner.iter, [h.state_dict() for h in runner.hooks
                                    if type(h).__name__ in ("EarlyStoppingHook",
                                                            "CountingHook")])
        runner.close()
    return dist.get_rank(), ends


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_hook_state_resumes_exactly_on_every_rank(run_on, tmp_path, strategy):
    results = run_on(2)(_state_body, str(tmp_path), STRATEGIES[strategy])
    for rank, ends in results:
        step, states = ends["straight"]
        assert step == 8
        assert ends["resumed"] == ends["straight"]  # the same step, the same states
        assert states[1] == {"count": 2 * (rank + 1) * step}  # each rank's own count
    assert results[0][1]["straight"][1][0] == results[1][1]["straight"][1][0]
    losses = [(r["step"], r["loss"]) for r in _records(tmp_path / "straight")
              if "mode" not in r]
    resumed = [(r["step"], r["loss"]) for r in _records(tmp_path / "resumed")
               if "mode" not in r]
    assert losses == resumed  # bit for bit, each step once

"""Hooks from the config through the command line, as a user runs it: 2 processes under
torchrun with EarlyStopping, the Profiler and a hook of the user's own (by import path, with
state of each rank's own); SIGKILL mid-run and --resume stop at the same step with the same
losses. Bad values of the new keys are test_bad_input.py's cases."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli import CONFIG, env, kill_tree, run
from tests.records import train_records, val_records
from tests.runs import COUNTER, EARLY, PROFILER, hooks_command
from trainrun.cli.train import main as train_main

# (the run nobody stops, with EARLY, COUNTER and PROFILER, is the fixture hooks_run: the
# hooks, the options and the command are tests/runs.py's)
STOP_LINE = ("early stopping at step 40: accuracy has not improved on {best} (step 10) by "
             "more than 0.5 for 3 validations; checkpoint iter_40.pth written")


def _stop_lines(stderr: str) -> list[str]:
    return [line.split(" INFO ", 1)[1] for line in stderr.splitlines()
            if "early stopping" in line]


def _ends(work_dir: Path) -> list[dict]:
    """What CountingHook wrote on each rank: the step training ended at, and its count."""
    return [json.loads((work_dir / f"hook_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_early_stopping_stops_every_rank_after_the_same_validation(hooks_run):
    work_dir, done = hooks_run
    best = f"{val_records(work_dir)[0]['accuracy']:.6g}"
    assert _stop_lines(done.stderr) == [STOP_LINE.format(best=best)]
    assert [r["step"] for r in val_records(work_dir)] == [10, 20, 30, 40]
    assert max(r["step"] for r in train_records(work_dir)) == 40
    assert (work_dir / "checkpoints" / "last").read_text().strip() == "iter_40.pth"
    assert _ends(work_dir) == [{"step": 40, "count": 40}, {"step": 40, "count": 80}]
    assert "training done: step 40/200" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_profiler_writes_a_trace_per_rank_and_says_where(hooks_run):
    work_dir, done = hooks_run
    root = work_dir / "profile"
    traces = {rank: list((root / f"rank{rank}").glob(f"rank{rank}.*.pt.trace.json"))
              for rank in (0, 1)}
    assert all(len(found) == 1 for found in traces.values()), traces
    for found in traces.values():
        trace = json.loads(found[0].read_text())
        assert trace["traceEvents"]  # what TensorBoard's profiler plugin and Perfetto read
    lines = [line for line in done.stderr.splitlines() if "profiler:" in line]
    assert len(lines) == 1, lines
    assert f"profiler: 2 trace(s) in {root}: rank0/{traces[0][0].name} (steps 3-4), " \
           f"rank1/{traces[1][0].name} (steps 3-4)" in lines[0]


@pytest.mark.slow
def test_sigkill_and_resume_stop_at_the_same_step_with_the_same_losses(hooks_run, tmp_path):
    """Killed (launcher and workers, SIGKILL) after its step-20 checkpoint, when
    EarlyStopping had counted one validation without improvement: the resumed run stops at
    step 40 as the unbroken one did, logging its losses bit for bit (the unbroken run also
    had the profiler: tracing changes no loss)."""
    expected, _ = hooks_run
    work_dir = tmp_path / "run"
    proc = subprocess.Popen(hooks_command(work_dir, EARLY, COUNTER), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = work_dir / "checkpoints" / "last"
    deadline = time.monotonic() + 120
    try:
        while not (last.exists() and last.read_text().strip() == "iter_20.pth"):
            assert proc.poll() is None, "the run ended before iter_20.pth"
            assert time.monotonic() < deadline, "no iter_20.pth within 120 s"
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    killed_at = int(last.read_text().strip()[5:-4])
    assert killed_at < 40 and not (work_dir / "hook_rank0.json").exists()

    done = run(hooks_command(work_dir, EARLY, COUNTER, resume=True))
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"iter_{killed_at}.pth at epoch 1, step {killed_at}" in done.stderr
    best = f"{val_records(expected)[0]['accuracy']:.6g}"
    assert _stop_lines(done.stderr) == [STOP_LINE.format(best=best)]
    assert _ends(work_dir) == _ends(expected)  # each rank's own count, restored
    straight_losses = {r["step"]: r["loss"] for r in train_records(expected)}
    resumed = {r["step"]: r["loss"] for r in train_records(work_dir)}  # later lines win
    assert resumed == straight_losses  # steps 1-40, bit for bit
    assert val_records(work_dir)[-1] == val_records(expected)[-1]


def test_the_dry_run_lists_the_hooks_in_the_order_they_run(capsys, clean_env):
    code = train_main([str(CONFIG), "--dry-run", "--launcher", "none", "--world-size", "2",
                       "--cfg-options", f"hooks=[{PROFILER}, {{type: EarlyStopping, "
                       f"metric: accuracy, priority: before_validation}}]"])
    out = capsys.readouterr().out
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.strip().startswith("hooks")]
    assert line.split(None, 1)[1] == (
        "timer [10], logger [20], guard [30], EarlyStopping (metric=accuracy, rule=greater, "
        "patience=5, min_delta=0.0) [39], validation [40], checkpoint [60], preemption [70], "
        "Profiler (wait=1, warmup=1, active=2, repeat=1, ranks=[0, 1], record_shapes=false, "
        "profile_memory=false, with_stack=false) [80]")


# what only building the hooks tells: the run and its dry run refuse each the same way
BUILT_REFUSALS = [
    (["hooks=[{type: EarlyStopping, metric: acuracy}]"],
     "error: hooks[0].metric: got 'acuracy', expected one of the validation metrics: "
     "accuracy; did you mean 'accuracy'?"),
    (["hooks=[{type: EarlyStopping, metric: accuracy}]", "data.val=null"],
     "error: hooks[0].metric: 'accuracy' is a validation metric, and this run has no "
     "validation (data.val is null)"),
    (["hooks=[{type: Profiler}, {type: Profiler, ranks: [0, 2]}]"],
     "error: hooks[1].ranks: got [0, 2], expected ranks below the world size (1): no rank 2"),
    (["hooks=[{type: tests.tools.models.CountingHook, weight: 0}]"],
     "error: hooks[0].weight: got 0, expected an int >= 1"),  # the constructor's ValueError
]


@pytest.mark.parametrize(("options", "line"), BUILT_REFUSALS)
def test_the_dry_run_refuses_what_building_the_hooks_refuses_in_the_same_line(
        tmp_path, capfd, clean_env, options, line):
    work_dir = tmp_path / "run"
    for dry_run in (["--dry-run"], []):
        code = train_main([str(CONFIG), "--launcher", "none", "--work-dir", str(work_dir),
                           *dry_run, "--cfg-options", *options])
        err = capfd.readouterr().err
        assert code == 2, err
        assert err.strip().splitlines() == [line], err
        assert not work_dir.exists()


def test_the_dry_run_leaves_to_the_run_what_it_cannot_know(capfd, clean_env):
    """Profiler ranks beyond a world size the launcher's variables do not give (not started
    by torchrun): planned; with --world-size the ranks are checked against it."""
    options = ["--cfg-options", "hooks=[{type: Profiler, ranks: [0, 1]}]"]
    assert train_main([str(CONFIG), "--dry-run", "--launcher", "pytorch", *options]) == 0
    assert train_main([str(CONFIG), "--dry-run", "--launcher", "pytorch", "--world-size", "2",
                       *options]) == 0
    capfd.readouterr()
    assert train_main([str(CONFIG), "--dry-run", "--launcher", "pytorch", "--world-size", "1",
                       *options]) == 2
    assert capfd.readouterr().err.strip() == (
        "error: hooks[0].ranks: got [0, 1], expected ranks below the world size (1): no rank 1")

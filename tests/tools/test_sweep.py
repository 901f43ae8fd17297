"""tools/sweep.py: grids, names, refusals, summaries and the local loop in process (fast); a
real 2x2 sweep interrupted and rerun, and a SLURM job array, end to end (slow)."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import CONFIG, REPO, env, kill_tree, run, use_env
from tests.records import train_records
from tests.slurm_cluster import client_env
from trainrun.cli.sweep import local, parser, prepare
from trainrun.cli.sweep import main as sweep_main
from trainrun.cli.sweep.grid import Sweep, make_points, parse_grid, short_keys, split_values
from trainrun.cli.sweep.slurm import sbatch_script, task_main
from trainrun.cli.sweep.status import write_manifest, write_status
from trainrun.cli.sweep.summary import write_summary

SWEEP = REPO / "tools" / "sweep.py"
GRID = ["optim.lr=1e-3,3e-3", "model.hidden=32,64"]
# 20 steps, a checkpoint and a validation every 5, every step logged
SHORT = ["schedule.max_epochs=null", "schedule.max_iters=20", "schedule.val_interval=5",
         "checkpoint.interval=5", "logging.interval=1"]
PNG = b"\x89PNG\r\n\x1a\n"


def sweep_args(work_dir: Path, *more: str, grid: list[str] = GRID,
               options: list[str] = SHORT) -> list[str]:
    return [str(CONFIG), "--work-dir", str(work_dir), "--grid", *grid, "--cfg-options",
            *options, *more]


def summary_rows(directory: Path) -> list[dict[str, str]]:
    with open(directory / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- in process

def test_grid_values_names_and_short_keys(tmp_path):
    assert split_values("1e-3, 3e-3") == ["1e-3", "3e-3"]
    assert split_values("[64,64],{a: 1, b: 2},'x,y'") == ["[64,64]", "{a: 1, b: 2}", "'x,y'"]
    assert short_keys(["optim.lr", "model.hidden", "optim.per_module.head.lr"]) == {
        "optim.lr": "optim.lr", "model.hidden": "hidden", "optim.per_module.head.lr": "head.lr"}

    grid, written = parse_grid(["optim.lr=1e-3,0.003", "model.widths=[64,64],[32, 32]"])
    assert grid == {"optim.lr": ["0.001", "0.003"], "model.widths": ["[64,64]", "[32,32]"]}
    assert written["optim.lr"] == ["1e-3", "0.003"]  # passed on as written
    points = make_points("digits", tmp_path, grid, written)
    assert [p.name for p in points] == [
        "digits-lr=0.001-widths=64_64", "digits-lr=0.001-widths=32_32",
        "digits-lr=0.003-widths=64_64", "digits-lr=0.003-widths=32_32"]
    assert points[1].label == "lr=0.001 widths=[32,32]"
    assert points[1].work_dir == tmp_path / "digits-lr=0.001-widths=32_32"
    assert points[1].overrides == ["optim.lr=1e-3", "model.widths=[32, 32]",
                                   "name=digits-lr=0.001-widths=32_32"]


@pytest.mark.parametrize(("grid", "more", "names"), [
    (["optim.lrr=1e-3"], [], ["optim.lrr", "'optim.lr'"]),
    (["optim.lr=1e-3,-1"], [], ["point lr=-1", "optim.lr: got -1"]),
    (["optim.lr"], [], ["--grid 'optim.lr'", "KEY=V1,V2"]),
    (["optim.lr=1e-3", "optim.lr=3e-3"], [], ["--grid optim.lr", "twice"]),
    (["optim.lr=1e-3,0.001"], [], ["--grid optim.lr", "0.001 is given twice"]),
    (["optim.lr=1e-3,"], [], ["--grid optim.lr", "empty value"]),
    (["name=a,b"], [], ["--grid name", "sets name"]),
    (["optim.lr=1e-3"], ["--nproc", "0"], ["--nproc", "got 0"]),
    (["optim.lr=1e-3"], ["--wait"], ["--wait", "--launcher slurm"]),
])
def test_bad_grids_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, grid, more, names):
    work_dir = tmp_path / "sweep"
    code = sweep_main(sweep_args(work_dir, *more, grid=grid))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for name in names:
        assert name in errors[0], errors[0]
    assert not work_dir.exists()


def test_another_grid_into_the_same_directory_is_refused(tmp_path, capsys):
    work_dir = tmp_path / "sweep"
    grid = ["optim.lr=1e-3,3e-3"]
    write_manifest(prepare(parser().parse_args(sweep_args(work_dir, grid=grid)),
                           []))
    for other, options in ((["optim.lr=1e-3,1e-2"], SHORT),
                           (grid, [*SHORT, "optim.weight_decay=0"])):
        code = sweep_main(sweep_args(work_dir, "--summary-only", grid=other, options=options))
        err = capsys.readouterr().err
        assert code == 2 and "holds another sweep" in err, err
    # the same grid written differently is the same sweep
    code = sweep_main(sweep_args(work_dir, "--summary-only", grid=["optim.lr=0.001,0.003"]))
    assert code == 0
    assert "[2/2] lr=0.003: not started" in capsys.readouterr().out
    assert [r["status"] for r in summary_rows(work_dir)] == ["not started"] * 2
    code = sweep_main(sweep_args(tmp_path / "other", "--summary-only", grid=grid))
    assert code == 2 and "holds no sweep yet" in capsys.readouterr().err


def test_dry_run_prints_the_torchrun_and_slurm_plans_and_writes_nothing(tmp_path, capsys):
    work_dir = tmp_path / "sweep"
    assert sweep_main(sweep_args(work_dir, "--dry-run", "--nproc", "2")) == 0
    out = capsys.readouterr().out
    assert out.count("would train") == 4
    assert out.count("-m torch.distributed.run --standalone --nproc_per_node 2") == 4
    assert "--launcher pytorch" in out and "--resume" in out
    assert f"--work-dir {work_dir}/digits_ddp-lr=0.003-hidden=64" in out
    assert out.rstrip().endswith("name=digits_ddp-lr=0.003-hidden=64")
    assert sweep_main(sweep_args(work_dir, "--dry-run", "--launcher", "slurm")) == 0
    assert "one job array" in capsys.readouterr().out
    assert not work_dir.exists()


def _write_metrics(work_dir: Path, records: list[dict | str]) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    with open(work_dir / "metrics.jsonl", "a") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def test_summary_counts_a_resumed_attempt_once(tmp_path, capsys):
    """A point cut short after step 4 (its last line half written) and resumed from step 2:
    where both attempts logged a step, the resumed one's values count; the best of a metric
    is its highest (a loss: its lowest), with the step."""
    grid = {"optim.lr": ["0.1", "0.2", "0.3"]}
    points = make_points("toy", tmp_path, grid, grid)
    sweep = Sweep(CONFIG, [], grid, "toy", tmp_path, points, "local", None)
    resumed, failed, _ = points
    _write_metrics(resumed.work_dir, [
        *({"step": s, "epoch": 1, "loss": 3.0 - s / 10, "lr": 0.1} for s in (1, 2)),
        {"step": 2, "mode": "val", "accuracy": 0.5, "nll_loss": 0.9},
        *({"step": s, "epoch": 1, "loss": 9.0, "lr": 0.1} for s in (3, 4)),
        {"step": 4, "mode": "val", "accuracy": 0.95, "nll_loss": 0.1}, '{"step": 5, "lo',
        *({"step": s, "epoch": 1, "loss": 2.0 - s / 10, "lr": 0.1} for s in (3, 4)),
        {"step": 4, "mode": "val", "accuracy": 0.7, "nll_loss": 0.6},
        *({"step": s, "epoch": 2, "loss": 2.0 - s / 10, "lr": 0.1} for s in (5, 6)),
        {"step": 6, "mode": "val", "accuracy": 0.6, "nll_loss": 0.4}])
    write_status(resumed.work_dir, 0, 12.0)
    failed.work_dir.mkdir()
    write_status(failed.work_dir, 1, 3.0)

    write_summary(sweep)
    rows = summary_rows(tmp_path)
    assert [r["status"] for r in rows] == ["finished", "failed (exit 1)", "not started"]
    assert rows[0]["point"] == "toy-lr=0.1" and rows[0]["optim.lr"] == "0.1"
    assert float(rows[0]["final_loss"]) == 2.0 - 6 / 10 and rows[0]["step"] == "6"
    assert (rows[0]["final_accuracy"], rows[0]["best_accuracy"],
            rows[0]["best_accuracy_step"]) == ("0.6", "0.7", "4")
    assert (rows[0]["best_nll_loss"], rows[0]["best_nll_loss_step"]) == ("0.4", "6")
    assert rows[1]["final_loss"] == "" and rows[2]["best_accuracy"] == ""
    markdown = (tmp_path / "summary.md").read_text().splitlines()
    assert markdown[0] == "# Sweep toy: 3 points"
    assert "| optim.lr | status | step | final_loss | final_accuracy | best_accuracy |" in \
        markdown[4]
    assert markdown[6].startswith("| 0.1 | finished | 6 | 1.4 | 0.6 | 0.7 | 4 |")
    assert markdown[7].startswith("| 0.2 | failed (exit 1) | - | - |")
    image = (tmp_path / "summary.png").read_bytes()
    assert image[:8] == PNG and len(image) > 10_000
    assert "metrics.jsonl:7 is not JSON" in capsys.readouterr().err  # the half-written line


STAND_IN = Path(__file__).parent / "scripts" / "stand_in_train.py"


def test_the_local_loop_goes_on_after_a_failure_and_reruns_only_unfinished_points(
        tmp_path, capsys, monkeypatch):
    """Every point trains in a process of its own (here a stand-in for tools/train.py): a
    failing point does not stop the others, the sweep exits 1, and a rerun trains only that
    point again, with --resume; a point whose status is removed trains again too."""
    command = local.local_command
    monkeypatch.setattr(local, "local_command", lambda sweep, point: [
        sys.executable, str(STAND_IN), *command(sweep, point)[2:]])
    code = sweep_main(sweep_args(tmp_path))
    out = capsys.readouterr().out
    assert code == 1, out
    assert out.count(": done in ") == 3
    failed = tmp_path / "digits_ddp-lr=0.003-hidden=64"
    assert "[4/4] lr=0.003 hidden=64: failed (exit 1) after " in out
    assert (f" s: rank 0, step 3: RuntimeError: injected failure; see {failed}/sweep.log"
            in out)
    assert "stand-in training" in (failed / "sweep.log").read_text()
    rows = summary_rows(tmp_path)
    assert [r["status"] for r in rows] == ["finished"] * 3 + ["failed (exit 1)"]
    assert [r["best_accuracy"] for r in rows] == ["0.25", "0.25", "0.75", ""]

    first = tmp_path / "digits_ddp-lr=0.001-hidden=32"
    (first / "sweep_status.json").unlink()
    assert sweep_main(sweep_args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.count("skipped (finished)") == 2 and out.count(": done in ") == 2
    calls = {p.name: (p / "calls.txt").read_text().splitlines() for p in tmp_path.iterdir()
             if p.is_dir()}
    assert sorted(len(c) for c in calls.values()) == [1, 1, 2, 2]
    assert len(calls[failed.name]) == len(calls[first.name]) == 2
    assert all(" --resume " in call for c in calls.values() for call in c)
    assert [r["status"] for r in summary_rows(tmp_path)] == ["finished"] * 4


def test_the_array_task_runs_through_the_package(tmp_path, capsys):
    """sweep.sbatch's command (``python -m trainrun.cli.sweep SWEEP_DIR TASK_ID``) reaches the
    package's task entry, which skips a finished point; a task id past the points is exit 2.
    (Training under srun is the SLURM test's.)"""
    write_manifest(prepare(parser().parse_args(sweep_args(tmp_path, grid=["optim.lr=1e-3,3e-3"])),
                           []))
    write_status(tmp_path / "digits_ddp-lr=0.001", 0, 1.0)
    script = tmp_path / "sweep.sbatch"
    script.write_text(sbatch_script())
    assert '-m trainrun.cli.sweep "$1" "$SLURM_ARRAY_TASK_ID"' in script.read_text()
    done = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env={**env(), "SLURM_ARRAY_TASK_ID": "0"})
    assert done.returncode == 0, done
    assert "[1/2] lr=0.001: skipped (finished)" in done.stdout
    assert task_main([str(tmp_path), "2"]) == 2
    assert "holds no point 2" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end

def _stop_all(proc: subprocess.Popen) -> None:
    """The sweep and every process below it (its points run in sessions of their own)."""
    kill_tree(proc.pid)
    proc.communicate()


def _sigint_as_from_a_shell() -> None:
    """In the sweep's process before it starts: SIGINT at its default and unblocked, as in a
    command a shell starts, whatever this test process's state (in full runs of the suite
    the sweep sometimes never saw the SIGINT sent to it; alone it always did)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


@pytest.mark.slow
def test_a_2x2_sweep_stopped_by_ctrl_c_resumes_and_summarises(tmp_path):
    """Ctrl-C while the second point trains: it writes a checkpoint and stops, the summary
    says so and the sweep exits 130. The same command again skips the finished point,
    resumes the stopped one from its checkpoint (each step logged once), trains the rest and
    writes the summary and the plot of all four."""
    slow = [*SHORT, "model.type=tests.tools.models.SlowDigitsMLP", "model.step_seconds=0.04"]
    cmd = [sys.executable, str(SWEEP), *sweep_args(tmp_path, options=slow)]
    second = tmp_path / "digits_ddp-lr=0.001-hidden=64"
    last = second / "checkpoints" / "last"
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_sigint_as_from_a_shell)
    try:
        deadline = time.monotonic() + 120
        while not (last.exists() and last.read_text().strip() == "iter_5.pth"):
            if proc.poll() is not None:
                pytest.fail(f"the sweep ended before point 2's iter_5.pth:\n"
                            f"{proc.communicate()}")
            assert time.monotonic() < deadline, "no iter_5.pth in point 2 within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _stop_all(proc)
    assert proc.returncode == 130, out + err
    assert "[1/4] lr=0.001 hidden=32: done in" in out
    assert "[2/4] lr=0.001 hidden=64: stopped (exit 75, checkpoint written)" in out
    assert "[3/4]" not in out and "interrupted; run the same command again" in out
    stopped_at = max(r["step"] for r in train_records(second))
    assert 5 <= stopped_at < 20
    rows = summary_rows(tmp_path)
    assert [r["status"] for r in rows] == [
        "finished", "stopped (exit 75, checkpoint written)", "not started", "not started"]
    assert rows[1]["step"] == str(stopped_at)

    done = run(cmd, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[1/4] lr=0.001 hidden=32: skipped (finished)" in done.stdout
    assert f"[2/4] lr=0.001 hidden=64: resuming from iter_{stopped_at}.pth" in done.stdout
    assert done.stdout.count(": done in ") == 3
    assert f"step {stopped_at}" in (second / "train.log").read_text()  # "resumed from ..."
    assert [r["step"] for r in train_records(second)] == list(range(1, 21))  # each step once

    rows = summary_rows(tmp_path)
    assert [(r["optim.lr"], r["model.hidden"], r["status"], r["step"]) for r in rows] == [
        (lr, hidden, "finished", "20") for lr in ("0.001", "0.003") for hidden in ("32", "64")]
    for row in rows:
        records = (tmp_path / row["point"] / "metrics.jsonl").read_text().splitlines()
        val = [r for r in map(json.loads, records) if r.get("mode") == "val"]
        best = max(val, key=lambda r: (r["accuracy"], -r["step"]))
        assert float(row["final_loss"]) == train_records(tmp_path / row["point"])[-1]["loss"]
        assert float(row["best_accuracy"]) == best["accuracy"]
        assert int(row["best_accuracy_step"]) == best["step"]
    markdown = (tmp_path / "summary.md").read_text()
    assert "| optim.lr | model.hidden | status | step | final_loss |" in markdown
    assert markdown.count("| finished | 20 |") == 4
    image = (tmp_path / "summary.png").read_bytes()
    assert image[:8] == PNG and len(image) > 20_000


@pytest.mark.slow
def test_a_slurm_sweep_is_one_job_array(slurm, tmp_path, capsys, monkeypatch):
    """Two points as one job array on the local SLURM, waited for: the failing point is
    reported with its error, the other trains under srun, and the summary has both. (The
    sweep runs in this process: its jobs get this environment, pointed at the test cluster.)"""
    use_env(monkeypatch, client_env(slurm.conf, env()))
    options = ["schedule.max_epochs=null", "schedule.max_iters=6", "schedule.val_interval=6",
               "checkpoint.interval=3", "logging.interval=1", "model.fail_rank=0",
               "model.type=tests.tools.models.FailingDigitsMLP"]
    code = sweep_main(sweep_args(tmp_path, "--launcher", "slurm", "--wait",
                                 "--sbatch-args=--time=5", grid=["model.fail_at=2,1000"],
                                 options=options))
    out = capsys.readouterr().out
    assert code == 1, out + slurm.logs()
    job, spec = (tmp_path / "slurm_jobs.txt").read_text().split()
    assert spec == "0-1"  # one array of both points
    assert f"[1/2] fail_at=2: submitted as job {job}_0" in out
    assert f"[2/2] fail_at=1000: submitted as job {job}_1" in out
    assert "[1/2] fail_at=2: failed (exit 1) after " in out
    assert " s: rank 0, step 2: RuntimeError: injected failure" in out
    assert "[2/2] fail_at=1000: done in" in out
    assert [r["status"] for r in summary_rows(tmp_path)] == ["failed (exit 1)", "finished"]
    trained = tmp_path / "digits_ddp-fail_at=1000"
    assert [r["step"] for r in train_records(trained)] == list(range(1, 7))
    assert "launcher: slurm" in (trained / "config.yaml").read_text()
    task_out = (tmp_path / f"slurm-{job}_1.out").read_text()
    assert f"[2/2] fail_at=1000: training in job {job}_1 on " in task_out

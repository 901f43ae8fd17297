"""Trackers and step metrics through the command line, as a user runs them: a tracker of
one's own by import path, W&B offline and MLflow's file store in the run directory (2
processes under torchrun: only rank 0 tracks), the step metrics in metrics.jsonl, a tracker
whose package is missing refused before anything is written, and plot_metrics drawing a step
metric.

The first three tests read one run tracked by all those trackers at once (``tracked_run``,
tests/runs.py); the MLflow test resumes a copy of it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import REPO, env, run
from tests.records import train_records
from tests.runs import tracked_command
from tests.tools.trackers import CALLS

SINGLE = REPO / "configs" / "digits_single.yaml"
NEW_FIELDS = {"grad_norm", "compute_time", "samples_per_s", "peak_memory_mb"}


def needs(package: str):
    import importlib.util

    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"{package} is not installed (pip install "
                                     f"trainrun[{package}])")


@pytest.mark.slow
def test_a_tracker_by_import_path_gets_start_log_finish_on_rank_0_only(tracked_run):
    work_dir = tracked_run
    calls = [json.loads(line) for line in (work_dir / CALLS).read_text().splitlines()]
    assert {c["rank"] for c in calls} == {0}
    assert [c["call"] for c in calls] == ["start", "log", "log", "log", "finish"]  # 5, 10, val
    start = calls[0]
    assert start["run_dir"] == str(work_dir) and start["resume"] is False
    assert start["config"]["name"] == "digits_ddp" and start["config"]["schedule"]["max_iters"] \
        == 10 and start["config"]["work_dir"] == str(work_dir)  # resolved, overrides applied
    records = train_records(work_dir)
    for call, record in zip(calls[1:3], records, strict=True):
        assert call["step"] == record["step"]
        assert call["values"] == {f"train/{k}": v for k, v in record.items()
                                  if k not in ("step", "epoch")}
    assert calls[3]["step"] == 10 and set(calls[3]["values"]) == {"val/accuracy"}
    # the step metrics: global throughput (2 ranks x 32 samples, 64 pixel tokens each)
    for record in records:
        assert NEW_FIELDS | {"tokens_per_s", "time", "data_time"} <= set(record)
        assert record["grad_norm"] > 0 and record["peak_memory_mb"] > 10
        assert record["samples_per_s"] * record["time"] == pytest.approx(64, rel=1e-9)
        assert record["tokens_per_s"] == pytest.approx(64 * record["samples_per_s"], rel=1e-9)
        assert record["data_time"] + record["compute_time"] + record["comm_time"] \
            == pytest.approx(record["time"])
        assert record["comm_time_max_rank"] in (0, 1)  # 2 ranks


def _wandb_records(path: Path) -> bytes:
    """The bytes of the offline run's .wandb file (protobuf records: names and JSON values
    appear in it as written)."""
    found = list(path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(found) == 1, found
    return found[0].read_bytes()


@pytest.mark.slow
@needs("wandb")
def test_wandb_writes_an_offline_run_into_the_run_directory(tracked_run):
    work_dir = tracked_run
    run_id = (work_dir / "wandb_run_id").read_text().strip()
    data = _wandb_records(work_dir)
    assert run_id.encode() in data and b"digits_ddp" in data
    assert b"0.00125" in data and b"max_iters" in data  # the config
    assert b"train/loss" in data and b"train/grad_norm" in data and b"val/accuracy" in data
    assert not list(Path.cwd().glob("wandb"))  # nothing beside the run directory


def _mlflow_run(work_dir: Path):
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(work_dir / "mlruns").absolute().as_uri())
    experiment = client.get_experiment_by_name("digits_ddp")
    runs = client.search_runs([experiment.experiment_id])
    return client, runs


@pytest.mark.slow
@needs("mlflow")
def test_mlflow_file_store_in_the_run_directory_holds_params_and_metrics(tracked_run, tmp_path):
    work_dir = tracked_run
    client, runs = _mlflow_run(work_dir)
    assert len(runs) == 1  # rank 0's only
    mlrun = runs[0]
    assert mlrun.info.run_id == (work_dir / "mlflow_run_id").read_text().strip()
    assert mlrun.info.status == "FINISHED"
    params = mlrun.data.params
    assert params["optim.type"] == "AdamW" and params["schedule.max_iters"] == "10"
    assert params["data.val.metrics"] == '["accuracy"]' and params["name"] == "digits_ddp"
    records = train_records(work_dir)
    losses = client.get_metric_history(mlrun.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in losses] == [(r["step"], r["loss"]) for r in records]
    norms = client.get_metric_history(mlrun.info.run_id, "train/grad_norm")
    assert [m.value for m in norms] == [r["grad_norm"] for r in records]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "val/accuracy")] \
        == [10]
    # resumed (from the step-10 checkpoint, the run's end): the same MLflow run continues
    # (in a copy of the run directory, which the other tests read as the first run left it)
    copy = shutil.copytree(work_dir, tmp_path / "run")
    done = run(tracked_command(copy, "--resume"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resumed from {copy / 'checkpoints' / 'iter_10.pth'}" in done.stderr
    _, again = _mlflow_run(copy)
    assert [r.info.run_id for r in again] == [mlrun.info.run_id]


@pytest.mark.parametrize("name", ["wandb", "tensorboard"])
def test_a_tracker_whose_package_is_missing_exits_2_before_anything_is_written(tmp_path, name):
    """The package hidden from the process (a sys.modules entry None: not importable, not
    found), so that this runs whether it is installed or not; tensorboard is refused as
    wandb is (it was once skipped with a warning, logging nothing there)."""
    hide = (f"import sys; sys.modules[{name!r}] = None; from trainrun.cli.train import main; "
            "sys.exit(main())")
    for extra in ([], ["--dry-run"]):
        work_dir = tmp_path / f"run{len(extra)}"
        done = subprocess.run(
            [sys.executable, "-c", hide, str(SINGLE), "--work-dir", str(work_dir), *extra,
             "--cfg-options", f"logging.backends=[console,{name}]"],
            capture_output=True, text=True, timeout=120, env=env())
        assert done.returncode == 2, done.stderr[-2000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: logging.backends[1]: got {name!r}, but {name} is not "
                          f"installed; pip install trainrun[{name}]"], done.stderr
        assert "Traceback" not in done.stderr and not work_dir.exists()


def test_plot_metrics_plots_a_step_metric(digits_run, tmp_path):
    work_dir, _ = digits_run
    assert NEW_FIELDS <= set(train_records(work_dir)[0])
    out = tmp_path / "curves.png"
    done = run([sys.executable, str(REPO / "tools" / "plot_metrics.py"), str(work_dir), "-o",
                str(out), "--keys", "grad_norm", "samples_per_s", "data_time"])
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "3 panels" in done.stdout


"""Trackers: the config's checks of ``logging.backends`` entries, the config flattened into
MLflow parameters, the trackers the logger makes (rank 0's), and each way a run ends closing
their runs with its outcome (MLflow's status, W&B's exit code, TensorBoard's events on
disk)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import struct
from pathlib import Path

import pytest

from tests.records import train_records
from trainrun.runner.hooks.logger import check_logging
from trainrun.runner.schema import ConfigError
from trainrun.runner.trackers import (
    METHODS,
    MLflowTracker,
    Tracker,
    WandbTracker,
    make_trackers,
    params,
)


def backends(*names):
    return check_logging("logging", {"backends": list(names)}, [])["backends"]


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_shipped_tracker_whose_package_is_missing_names_the_entry_and_the_extra(
        monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda module, *a: None if module == name else real(module, *a))
    with pytest.raises(ConfigError) as caught:
        backends("console", name)
    assert str(caught.value) == (f"logging.backends[1]: got {name!r}, but {name} is not "
                                 f"installed; pip install trainrun[{name}]")


def test_a_tracker_by_import_path_is_kept_and_made_without_arguments():
    path = "tests.tools.trackers.RecordingTracker"
    assert backends("jsonl", path, path) == ["jsonl", path]  # duplicates dropped
    made = make_trackers(["console", "jsonl", path])
    assert [type(t).__name__ for t in made] == ["RecordingTracker"]


def test_the_interface_is_three_methods():
    assert METHODS == ("start", "log", "finish")
    for cls in (Tracker, WandbTracker, MLflowTracker):
        assert all(callable(getattr(cls, method)) for method in METHODS)


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                    reason="mlflow is not installed (pip install trainrun[mlflow])")
def test_the_config_flattens_into_mlflow_params_cut_to_its_limit():
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH  # noqa: F401 (needs mlflow)

    config = {"name": "x", "optim": {"lr": 0.001, "clip_grad": None, "per_module": {}},
              "data": {"train": {"files": ["a.py", "b.py"]}}, "bad key!": "long" * 5000,
              "schedule": {"max_iters": 10, "by": True}}
    flat = params(config)
    assert flat["name"] == "x" and flat["optim.lr"] == "0.001"
    assert flat["optim.clip_grad"] == "null" and flat["optim.per_module"] == "{}"
    assert json.loads(flat["data.train.files"]) == ["a.py", "b.py"]
    assert flat["schedule.max_iters"] == "10" and flat["schedule.by"] == "true"
    assert len(flat["bad key_"]) == MAX_PARAM_VAL_LENGTH



def test_trackers_see_only_training_a_validation_alone_tracks_nothing(tmp_path):
    from types import SimpleNamespace

    from tests.tools.trackers import CALLS
    from trainrun.runner.hooks.logger import LoggerHook

    hook = LoggerHook(backends=["tests.tools.trackers.RecordingTracker"], progress_bar=False)
    runner = SimpleNamespace(iter=0, max_iters=4, work_dir=tmp_path, cfg={"name": "x"},
                             start_from=("resume", tmp_path / "iter_2.pth"))
    hook.after_val(runner, {"accuracy": 0.5})  # runner.val() on its own
    assert not (tmp_path / CALLS).exists()
    hook.before_train(runner)
    hook.after_val(runner, {"accuracy": 0.75})
    hook.after_train(runner)  # the run is not over: after_run may still fail
    assert "finish" not in (tmp_path / CALLS).read_text()
    hook.close_trackers()
    hook.close_trackers()  # finished once
    calls = [json.loads(line) for line in (tmp_path / CALLS).read_text().splitlines()]
    assert [c["call"] for c in calls] == ["start", "log", "finish"]
    assert calls[0]["config"] == {"name": "x"} and calls[0]["resume"] is True
    assert calls[1]["values"] == {"val/accuracy": 0.75} and calls[1]["step"] == 0


def test_training_that_fails_closes_the_trackers_runs(tmp_path):
    """on_error closes each tracker's run: with its `fail` where it has one, else `finish`
    (RecordingTracker has none); one that cannot close its run is logged, not raised."""
    from types import SimpleNamespace

    from tests.tools.trackers import CALLS
    from trainrun.runner.hooks.logger import LoggerHook

    hook = LoggerHook(backends=["tests.tools.trackers.RecordingTracker"], progress_bar=False)
    runner = SimpleNamespace(iter=0, max_iters=4, work_dir=tmp_path, cfg={"name": "x"},
                             start_from=None)
    hook.before_train(runner)
    hook.on_error(runner, RuntimeError("boom"))
    hook.on_error(runner, RuntimeError("again"))  # closed once
    calls = [json.loads(line)["call"] for line in (tmp_path / CALLS).read_text().splitlines()]
    assert calls == ["start", "finish"]


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                    reason="mlflow is not installed (pip install trainrun[mlflow])")
@pytest.mark.parametrize(("error", "status"), [(RuntimeError("boom"), "FAILED"),
                                               (KeyboardInterrupt(), "KILLED")])
def test_an_mlflow_run_ended_by_an_error_is_failed_or_killed(tmp_path, error, status):
    tracker = MLflowTracker()
    tracker.start(tmp_path, {"name": "x"}, resume=False)
    tracker.fail(error)
    assert tracker.client.get_run(tracker.run_id).info.status == status


# ---------------------------------------------------------------- each ending, in real runs

INSTALLED = [name for name in ("mlflow", "wandb", "tensorboard")
             if importlib.util.find_spec(name) is not None]
RECORDING = "tests.tools.trackers.RecordingTracker"


class RaiseAt:
    """Raises ``error`` at the hook point ``point`` (at step ``step`` for a step's point)."""

    def __init__(self, point, error=None, step=3, priority=50):
        self.point, self.step, self.priority = point, step, priority
        self.error = error or RuntimeError("injected")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._raise if name == self.point else lambda *args: None

    def _raise(self, runner, *args):
        if not self.point.endswith("_iter") or runner.iter == self.step:
            raise self.error


class SignalAt:
    """Sends ``signum`` to this process after step ``step`` (the preemption tests' way)."""

    priority = 30  # before the preemption hook looks

    def __init__(self, step, signum):
        self.step, self.signum = step, signum

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args: None

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        if runner.iter == self.step:
            os.kill(os.getpid(), self.signum)


class FailsToStart:
    """A tracker whose ``start`` raises: the trackers started before it must still close."""

    def start(self, run_dir, config, resume):
        raise RuntimeError("cannot start")

    def log(self, values, step): ...
    def finish(self): ...


def _train(work_dir, hooks=(), extra_backends=()):
    """Six steps of the toy model in this process (validation at 3 and 6), tracked by every
    installed tracker and the recording one: the exception that ended it, or None."""
    from trainrun.runner.runner import Runner

    runner = Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                          "batch_size": 4},
        val_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 8, "batch_size": 4},
        optim={"type": "AdamW", "lr": 0.01}, strategy="none",
        schedule={"max_iters": 6, "val_interval": 3}, randomness={"seed": 5},
        logging={"interval": 1, "backends": ["jsonl", *INSTALLED, RECORDING,
                                             *extra_backends]},
        checkpoint={"interval": 100}, hooks=list(hooks))
    try:
        with runner:
            runner.train()
    except BaseException as error:  # noqa: BLE001 - what ended the run is the result
        return error
    return None


def _mlflow_status(work_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(work_dir / "mlruns").absolute().as_uri())
    return client.get_run((work_dir / "mlflow_run_id").read_text().strip()).info.status


def _wandb_exit_code(work_dir):
    """The exit code in the offline run's exit record (its .wandb file: LevelDB-style log
    blocks of 32 KiB, each record a 7-byte header and a protobuf ``Record``)."""
    from wandb.proto import wandb_internal_pb2

    [path] = Path(work_dir).glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, chunk, codes = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7]) if left >= 7 else (0, 0)
        if length == 0 and kind == 0:  # a block's padding
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "exit":
                codes.append(record.exit.exit_code)
    return codes


def _tensorboard_steps(work_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work_dir / "tensorboard"))
    events.Reload()
    return [event.step for event in events.Scalars("train/loss")]


ENDINGS = {  # name: (hooks, the exception type, MLflow's status, W&B's exit code)
    "finished": ([], None, "FINISHED", 0),
    "failed in a step": ([RaiseAt("after_train_iter")], RuntimeError, "FAILED", 1),
    "failed in validation": ([RaiseAt("after_val")], RuntimeError, "FAILED", 1),
    # after the logger's own after_train, which once closed the trackers as finished
    "failed in after_train": ([RaiseAt("after_train")], RuntimeError, "FAILED", 1),
    "failed in after_run": ([RaiseAt("after_run")], RuntimeError, "FAILED", 1),
    "stopped by SIGTERM": ([SignalAt(3, signal.SIGTERM)], "Preempted", "KILLED", 75),
    "Ctrl-C": ([RaiseAt("after_train_iter", KeyboardInterrupt())], KeyboardInterrupt,
               "KILLED", 130),
}


@pytest.mark.skipif(not INSTALLED, reason="no tracker package is installed")
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_each_ending_closes_every_trackers_run_with_its_outcome(tmp_path, ending):
    from tests.tools.trackers import CALLS

    hooks, raised, status, code = ENDINGS[ending]
    error = _train(tmp_path, hooks)
    assert (error is None) if raised is None else (
        type(error).__name__ == raised if isinstance(raised, str) else isinstance(error, raised))
    calls = [json.loads(line)["call"] for line in (tmp_path / CALLS).read_text().splitlines()]
    assert calls[0] == "start" and calls[-1] == "finish" and calls.count("finish") == 1
    if "mlflow" in INSTALLED:
        assert _mlflow_status(tmp_path) == status
    if "wandb" in INSTALLED:
        assert _wandb_exit_code(tmp_path) == [code]
    if "tensorboard" in INSTALLED:  # flushed: every step in metrics.jsonl is on disk
        assert _tensorboard_steps(tmp_path) == [r["step"] for r in train_records(tmp_path)]


@pytest.mark.skipif("mlflow" not in INSTALLED, reason="mlflow is not installed")
def test_a_tracker_that_fails_to_start_leaves_the_started_ones_closed(tmp_path):
    error = _train(tmp_path, extra_backends=["tests.runner.test_trackers.FailsToStart"])
    assert isinstance(error, RuntimeError) and str(error) == "cannot start"
    assert _mlflow_status(tmp_path) == "FAILED"  # it stayed RUNNING


@pytest.mark.skipif("mlflow" not in INSTALLED, reason="mlflow is not installed")
def test_the_heartbeat_closes_the_trackers_before_it_ends_a_stuck_rank(tmp_path, monkeypatch):
    """What ``before_process_end`` gives the heartbeat, called as it would before it ends a
    rank stuck in a collective: the runs fail with the heartbeat's reason; afterwards the
    logger is off its list."""
    from types import SimpleNamespace

    from trainrun.dist import heartbeat
    from trainrun.runner.hooks.logger import LoggerHook

    monkeypatch.setattr(heartbeat, "_last_words", [])
    exited = []
    monkeypatch.setattr(heartbeat.os, "_exit", exited.append)
    hook = LoggerHook(backends=["mlflow"], progress_bar=False)
    runner = SimpleNamespace(iter=0, max_iters=4, work_dir=tmp_path, cfg={"name": "x"},
                             start_from=None)
    hook.before_train(runner)
    heartbeat._end_process("rank 1 failed at step 3 in forward: RuntimeError: boom")
    assert exited == [heartbeat.RANK_LOST_EXIT]
    assert hook.trackers[0].client.get_run(hook.trackers[0].run_id).info.status == "FAILED"
    assert heartbeat._last_words == []

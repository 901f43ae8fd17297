"""Trackers: the config's checks of ``logging.backends`` entries, the config flattened into
MLflow parameters, and the trackers the logger makes (rank 0's)."""

from __future__ import annotations

import importlib.util
import json

import pytest

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


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
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
    hook.after_train(runner)
    hook.after_train(runner)  # finished once
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

"""Several validation sets given to the runner as objects or sections: each scored with its
own metrics, named ``val/<name>/<metric>``, on one and on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runner.toy import MSE
from trainrun.runner.builder import build_dataloader
from trainrun.runner.evaluation import MeanOf
from trainrun.runner.runner import Runner
from trainrun.runner.schema import ConfigError

DATASET = "tests.runner.toy.ToyRegression"
MODEL = {"type": "tests.runner.toy.ToyModel"}


def _section(seed: int, size: int) -> dict:
    return {"type": DATASET, "size": size, "seed": seed, "batch_size": 4}


def _runner(work_dir, val, val_metrics=None, **kwargs) -> Runner:
    return Runner(model=MODEL, work_dir=work_dir, val_dataloader=val, val_metrics=val_metrics,
                  randomness={"seed": 3}, logging={"backends": ["jsonl"]}, **kwargs)


def _val_sets_body(work_dir: str) -> tuple[dict, dict, dict]:
    """The same two sets scored together (one a loader object, one a section; one with
    metrics given, one with its data set's) and each alone."""
    loader = build_dataloader(_section(2, 13), seed=3, train=False, key="data.val.small")
    together = _runner(work_dir, {"small": loader, "big": _section(1, 21)},
                       val_metrics={"small": [MSE(), MeanOf("mean_prediction")]})
    both = together.val()
    together.close()
    alone = {}
    for name, section, metrics in (("small", _section(2, 13), [MSE(), MeanOf("mean_prediction")]),
                                   ("big", _section(1, 21), None)):
        runner = _runner(f"{work_dir}-{name}", section, metrics)
        alone[name] = runner.val()
        runner.close()
    return both, alone["small"], alone["big"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_set_is_scored_as_it_would_be_alone(run_on, tmp_path, world_size):
    for both, small, big in run_on(world_size)(_val_sets_body, str(tmp_path / "run")):
        assert both == {"val/small/mse": small["mse"],
                        "val/small/mean_prediction": small["mean_prediction"],
                        "val/big/mse": big["mse"]}
    record = json.loads((Path(tmp_path) / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record == {"step": 0, "mode": "val", **both}


def test_save_best_must_name_a_set_and_metrics_a_known_set(tmp_path):
    sets = {"clean": _section(1, 8), "noisy": _section(2, 8)}
    with pytest.raises(ConfigError, match=r"^checkpoint.save_best: got 'val/clen/mse', .*"
                                          r"did you mean 'val/clean/mse'\?"):
        _runner(tmp_path / "a", sets, train_dataloader=_section(0, 8),
                checkpoint={"save_best": "val/clen/mse"})
    with pytest.raises(ConfigError, match=r"^checkpoint.save_best: got 'mse', expected "
                                          r"val/<name>/<metric>"):
        _runner(tmp_path / "b", sets, train_dataloader=_section(0, 8),
                checkpoint={"save_best": "mse"})
    with pytest.raises(ValueError, match=r"val_metrics names sets \['other'\]"):
        _runner(tmp_path / "c", sets, val_metrics={"other": [MSE()]})
    with pytest.raises(ConfigError, match=r"^data.val.a/b: got 'a/b'"):
        _runner(tmp_path / "d", {"a/b": _section(1, 8)})
    assert not any(tmp_path.iterdir())


class _Tracked:
    """A stand-in tracker (`trainrun.runner.trackers`): the keys it was given."""

    def __init__(self):
        self.tags: list[str] = []

    def log(self, values, step):
        self.tags.extend(values)


@pytest.mark.parametrize(("loaders", "metrics", "tags"), [
    (object(), {"mse": 1.0}, ["val/mse"]),
    ({"a": object(), "b": object()}, {"val/a/mse": 1.0, "val/b/mse": 2.0},
     ["val/a/mse", "val/b/mse"])])
def test_tracker_tags_of_one_set_and_of_several(loaders, metrics, tags):
    from types import SimpleNamespace

    from trainrun.runner.hooks.logger import LoggerHook

    hook = LoggerHook(backends=["console"], progress_bar=False)
    hook.trackers = hook._open = [_Tracked()]  # as before_train leaves them
    hook.after_val(SimpleNamespace(val_dataloader=loaders, iter=3), metrics)
    assert hook.trackers[0].tags == tags

"""The run directory: one place names its files, a resume leaves each step once in
metrics.jsonl, a test writes a directory of its own, and nothing else writes the record."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.limits import files_limited_to
from trainrun.checkpoint.files import TMP_PREFIX
from trainrun.checkpoint.manager import CHECKPOINTS_DIR, LAST
from trainrun.cli.sweep.status import LOG as SWEEP_LOG
from trainrun.cli.sweep.status import STATUS as SWEEP_STATUS
from trainrun.runner import run_dir as run_dir_module
from trainrun.runner.lock import LOCK_NAME
from trainrun.runner.run_dir import (
    MetricsFile,
    RunDir,
    TestDir,
    is_resume_mark,
    run_owning,
)

PACKAGE = Path(__file__).resolve().parents[2] / "trainrun"
# Every file name a run directory holds; "test" (the tests' directory) and "resume" (the
# mark's mode) are left out: they are also a data split's name and a config key.
NAMES = (run_dir_module.CONFIG, run_dir_module.METRICS, run_dir_module.TRAIN_LOG,
         run_dir_module.TEST_LOG, run_dir_module.SCORES, run_dir_module.PROFILE, LOCK_NAME,
         CHECKPOINTS_DIR, LAST, SWEEP_STATUS, SWEEP_LOG)
# the same words where they name no file: the dry run's row label
NOT_PATHS = {("runner/plan.py", CHECKPOINTS_DIR)}


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module, less docstrings and ``docs=`` arguments (the name
    of a docs page, e.g. docs/checkpoints.md)."""
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg == "docs":
            skip.add(id(node.value))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in skip]


def test_each_name_of_the_run_directory_is_written_once_in_the_package():
    """``"metrics.jsonl"`` and the others appear as a string once in trainrun/: where the
    name is defined; every other module asks a RunDir (or the constant) for it."""
    places: dict[str, list[str]] = {name: [] for name in NAMES}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for node in _string_constants(ast.parse(path.read_text(encoding="utf-8"))):
            if node.value in places and (relative, node.value) not in NOT_PATHS:
                places[node.value].append(f"{relative}:{node.lineno}")
    repeated = {name: where for name, where in places.items() if len(where) != 1}
    assert not repeated, repeated


def test_a_run_dir_names_every_path_and_creates_nothing(tmp_path):
    run = RunDir(tmp_path / "run")
    assert (run.config.name, run.metrics.name, run.log.name, run.lock_file.name) == (
        "config.yaml", "metrics.jsonl", "train.log", "run.lock")
    assert run.checkpoints == tmp_path / "run" / "checkpoints"
    assert run.profile == tmp_path / "run" / "profile"
    test = run.test_dir(tmp_path / "run" / "checkpoints" / "epoch_2.pth")
    assert isinstance(test, TestDir) and test.path == tmp_path / "run" / "test" / "epoch_2"
    assert (test.log.name, test.scores.name) == ("test.log", "scores.json")
    assert not (tmp_path / "run").exists() and not run.holds_record()


def test_acquire_makes_the_directory_and_holds_its_lock(tmp_path):
    """(Another job's refusal is tests/runner/test_lock.py's.)"""
    run = RunDir(tmp_path / "a" / "run")
    lock = run.acquire()
    try:
        assert lock.path == run.lock_file
        assert json.loads(run.lock_file.read_text())["token"] == lock.holder.token
    finally:
        lock.release()
    assert not run.lock_file.exists() and run.path.is_dir()


def test_write_config_keeps_a_changed_config_of_a_resumed_run_aside(tmp_path):
    run = RunDir(tmp_path)
    cfg = OmegaConf.create({"work_dir": str(tmp_path), "launcher": "none", "name": "run",
                            "tag": "${name}", "schedule": {"max_iters": 4}, "lr": 0.1})
    run.write_config(cfg)
    assert yaml.safe_load(run.config.read_text())["tag"] == "run"  # resolved
    before = run.config.read_bytes()
    run.write_config(OmegaConf.merge(cfg, {"launcher": "pytorch"}), resumed=True)
    assert run.config.read_bytes() == before  # only how the processes start changed
    longer = OmegaConf.merge(cfg, {"schedule": {"max_iters": 8}})
    assert run.config_changes(longer) == []  # a resume may train longer
    run.write_config(longer, resumed=True)
    kept = [p.name for p in tmp_path.glob("config.*.yaml")]
    assert len(kept) == 1 and (tmp_path / kept[0]).read_bytes() == before
    assert yaml.safe_load(run.config.read_text())["schedule"]["max_iters"] == 8
    assert run.config_changes(OmegaConf.merge(longer, {"lr": 0.5})) == ["lr: 0.1 -> 0.5"]
    assert RunDir(tmp_path / "new").config_changes(cfg) == []  # no config.yaml yet


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resume_drops_the_lines_of_the_lost_steps_and_marks_itself(tmp_path):
    """Killed after its step-4 checkpoint, a run had logged steps 5 and 6 and cut a line
    short: the resume keeps every line up to step 4 (its validation, and a line without a
    step that came after it), drops the rest, and ends the file with its mark."""
    path = tmp_path / "metrics.jsonl"
    kept = [{"step": s, "epoch": 1, "loss": 1.0 / s} for s in range(1, 5)] + [
        {"step": 4, "mode": "val", "accuracy": 0.5}, {"note": "of step 4"}]
    lost = [{"step": 5, "epoch": 1, "loss": 0.2}, {"note": "of step 5"},
            {"step": 6, "mode": "val", "accuracy": 0.7}]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept + lost) + '{"step": 7, "lo')
    inode = path.stat().st_ino
    metrics = MetricsFile(path)
    assert metrics.resume(4, "run/checkpoints/iter_4.pth") == 4
    records = _lines(path)
    assert records[:-1] == kept
    assert records[-1] == {"step": 4, "mode": "resume", "from": "run/checkpoints/iter_4.pth"}
    assert is_resume_mark(records[-1]) and not any(map(is_resume_mark, records[:-1]))
    assert path.stat().st_ino != inode  # a new file renamed over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary
    metrics.write({"step": 5, "epoch": 1, "loss": 0.25})
    metrics.close()
    assert _lines(path)[-1] == {"step": 5, "epoch": 1, "loss": 0.25}

    # resumed again, from an earlier checkpoint: the mark of step 4 goes too
    assert MetricsFile(path).resume(2, "iter_2.pth") == 6  # steps 3-5, their lines, the mark
    assert [r.get("mode") for r in _lines(path)] == [None, None, "resume"]


def test_a_resume_into_a_new_directory_starts_its_metrics_with_the_mark(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert MetricsFile(path).resume(10, "other/iter_10.pth") == 0
    assert _lines(path) == [{"step": 10, "mode": "resume", "from": "other/iter_10.pth"}]


def test_a_line_the_disk_refuses_names_the_file(tmp_path):
    """The OSError of a write names no file; the one raised names metrics.jsonl, and closing
    the file after it (as a failing run does) raises nothing more."""
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsFile(path)
    metrics.write({"step": 1, "loss": 1.0})
    with files_limited_to(path.stat().st_size + 8), pytest.raises(OSError) as refused:
        metrics.write({"step": 2, "loss": 0.5, "note": "x" * 200})
    assert refused.value.filename == str(path)
    assert str(refused.value).endswith(f": '{path}'")
    metrics.close()


def test_read_metrics_skips_a_line_cut_short_and_says_which(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_metrics() == []
    run.metrics.write_text('{"step": 1, "loss": 2.5}\n\n[1, 2]\n{"step": 2, "lo')
    bad: list[int] = []
    assert run.read_metrics(on_bad_line=bad.append) == [{"step": 1, "loss": 2.5}]
    assert bad == [3, 4]


def test_a_test_dir_writes_its_scores_as_json(tmp_path):
    test = RunDir(tmp_path).test_dir("epoch_3.pth")
    test.path.mkdir(parents=True)
    data = OmegaConf.create({"type": "digits", "batch_size": "${size}", "size": 64})
    path = test.write_scores("ckpt/epoch_3.pth", data, {"accuracy": 0.75, "nll": float("nan")})
    scores = json.loads(path.read_text())
    assert scores["checkpoint"] == "ckpt/epoch_3.pth"
    assert scores["data"] == {"type": "digits", "batch_size": 64, "size": 64}
    assert scores["metrics"] == {"accuracy": 0.75, "nll": "nan"}
    assert scores["time"][:2] == "20" and "T" in scores["time"]
    assert not list(test.path.glob(TMP_PREFIX + "*"))


def test_the_record_of_a_training_run_is_known_from_any_path_into_it(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run_owning(tmp_path / "run" / "config.yaml") is None  # nothing trained there yet
    run.checkpoints.mkdir(parents=True)
    (tmp_path / "run" / "train.log").write_text("")
    assert run.holds_record()
    for part in ("config.yaml", "metrics.jsonl", "train.log", "run.lock", "checkpoints",
                 "checkpoints/last", "checkpoints/iter_4.pth/shard"):
        assert run_owning(tmp_path / "run" / part).path == run.path, part
    for other in ("model.safetensors", "test/epoch_2/scores.json", "config.2026.yaml"):
        assert run_owning(tmp_path / "run" / other) is None, other
    os.symlink(tmp_path / "run", tmp_path / "link")
    assert run_owning(tmp_path / "link" / "metrics.jsonl") is not None

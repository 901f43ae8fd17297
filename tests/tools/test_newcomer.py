"""What a newcomer bringing their own model meets (issue 22): ``type:`` paths imported from the
working directory under every way of starting trainrun, classes that take any keyword left to
their constructor, and help that fits on a screen and names the page that says more."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import REPO, TRAIN, env
from tests.records import train_records
from tests.tools.newcomer import user_project
from trainrun import cli
from trainrun.cli.train import main as train_main

SINGLE = REPO / "configs" / "digits_single.yaml"
TWO_STEPS = ["schedule.max_epochs=null", "schedule.max_iters=2", "schedule.val_interval=2",
             "checkpoint.interval=2", "logging.interval=1"]


def console_script() -> Path:
    """The ``trainrun`` console script beside this interpreter."""
    script = Path(sys.executable).parent / "trainrun"
    if not script.exists():
        pytest.skip("the trainrun console script is not installed beside this python")
    return script


@pytest.mark.parametrize("start", ["trainrun", "tools/train.py"])
def test_a_type_beside_the_config_is_imported_from_the_working_directory(tmp_path, start):
    project = user_project(tmp_path / "project")
    command = [str(console_script())] if start == "trainrun" else [sys.executable, str(TRAIN)]
    if start == "trainrun":
        command.append("train")
    done = subprocess.run([*command, str(SINGLE), "--work-dir", str(tmp_path / "run"),
                           "--cfg-options", "model.type=my_model.Net", *TWO_STEPS],
                          cwd=project, env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 2]
    assert "type: my_model.Net" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_missing_module_says_where_types_are_imported_from(tmp_path):
    project = user_project(tmp_path / "project")
    done = subprocess.run([str(console_script()), "train", str(SINGLE), "--dry-run",
                           "--cfg-options", "model.type=my_modl.Net"],
                          cwd=project, env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: model.type: model type 'my_modl.Net': no module named 'my_modl' (type: paths "
        f"are imported from the working directory, {os.path.realpath(project)}, and "
        f"PYTHONPATH; run trainrun from the directory that holds my_modl.py, or add its "
        f"directory to PYTHONPATH)"]


def test_classes_taking_any_keyword_are_not_refused(tmp_path, capfd):
    """A model and a data set with ``**extra`` get the keys they are given; a key near a
    loader option is still pointed out (it goes to the data set)."""
    code = train_main([str(SINGLE), "--dry-run", "--launcher", "none", "--work-dir",
                       str(tmp_path / "run"), "--cfg-options",
                       "model.type=tests.tools.newcomer.OpenDigitsMLP", "model.colour=blue",
                       "data.train.type=tests.tools.newcomer.OpenDigits",
                       "data.train.batch_sise=8"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "warning: data.train.batch_sise is passed to the data set; did you mean " \
           "'data.train.batch_size'?" in err
    assert "OpenDigitsMLP" in out and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- help

PAGES = {"": "getting-started", "train": "cli", "plan": "cli", "test": "cli",
         "sweep": "sweeps", "export": "checkpoints", "verify-resume": "checkpoints"}


@pytest.mark.parametrize("subcommand", list(PAGES), ids=lambda name: name or "trainrun")
def test_help_fits_on_a_screen_with_examples_and_its_docs_page(subcommand, capsys,
                                                               monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # a terminal's default width
    monkeypatch.setattr(sys, "argv", ["trainrun"])
    assert cli.main([subcommand, "--help"] if subcommand else ["--help"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    assert len(lines) <= 30, "\n".join(lines)
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    assert lines[-1] == f"docs: docs/{PAGES[subcommand]}.md"
    examples = lines.index("examples:")
    assert lines[examples + 1].startswith(f"  trainrun {subcommand or 'train'} ")
    assert "--local-rank" not in "\n".join(lines)  # hidden: only older launchers pass it

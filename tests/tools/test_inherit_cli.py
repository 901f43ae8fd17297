"""Config inheritance through the command line: a user's config built on a shipped one trains,
its run directory's config.yaml is the merged config, a base changed under a run is a config
change for --resume, and every bad ``_base_``/``_delete_`` is exit 2 with one ``error:`` line
naming the chain of files or the key, before anything is written, in every command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from tests.cli import TRAIN, env, file_bytes
from trainrun.cli import plan as plan_tool
from trainrun.cli import sweep as sweep_tool
from trainrun.cli import test as test_tool
from trainrun.cli import verify_resume as verify_tool
from trainrun.cli.train import main as train_main
from trainrun.examples.digits import DigitsMLP
from trainrun.runner.config import load_config

REPO = Path(__file__).resolve().parents[2]
SINGLE = REPO / "configs" / "digits_single.yaml"
# A run of 4 steps: the schedule replaces the inherited one (20 epochs) instead of merging
# into it, which would leave both lengths set.
RUN = """\
_base_: mid/lr.yaml
schedule: {_delete_: true, max_iters: 4, val_interval: 2}
checkpoint: {interval: 2}
logging: {interval: 2}
"""


@pytest.fixture
def clean_cwd(clean_env, monkeypatch, tmp_path):
    """No launcher's variables (clean_env), and tmp_path the working directory: where
    default run directories would go."""
    monkeypatch.chdir(tmp_path)


def user_config(root: Path, lr: str = "2.0e-3") -> Path:
    """root/run.yaml on root/mid/lr.yaml on the shipped digits_single.yaml (and its bases)."""
    (root / "mid").mkdir(parents=True, exist_ok=True)
    (root / "mid" / "lr.yaml").write_text(f"_base_: {SINGLE}\noptim: {{lr: {lr}}}\n")
    (root / "run.yaml").write_text(RUN)
    return root / "run.yaml"


@pytest.mark.slow
def test_a_config_on_bases_trains_and_config_yaml_is_the_merged_config(tmp_path, capfd,
                                                                       clean_cwd):
    config = user_config(tmp_path / "cfg")
    work_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, str(TRAIN), str(config), "--work-dir", str(work_dir)],
                          capture_output=True, text=True, timeout=120, env=env())
    assert done.returncode == 0, done.stderr[-3000:]
    saved = yaml.safe_load((work_dir / "config.yaml").read_text())
    assert saved == OmegaConf.to_container(load_config(config, values={"work_dir": str(work_dir)}))
    assert saved["name"] == "run"  # the stem of the file given, not a base's
    assert saved["optim"]["lr"] == 2.0e-3 and saved["optim"]["type"] == "AdamW"
    assert saved["model"] == {"type": "DigitsMLP", "hidden": 256, "dropout": 0.1}
    assert saved["schedule"] == {"max_epochs": None, "max_iters": 4, "val_interval": 2,
                                 "val_begin": 1}
    assert saved["data"]["val"]["val_fraction"] == 0.2  # resolved across the files
    text = (work_dir / "config.yaml").read_text()
    assert "_base_" not in text and "_delete_" not in text and "${" not in text
    assert (work_dir / "checkpoints" / "last").read_text().strip() == "iter_4.pth"

    # a value changed in a base is a changed config for the run it started (in this process,
    # as tools/train.py runs it)
    user_config(tmp_path / "cfg", lr="3.0e-3")
    before = file_bytes(work_dir)
    assert train_main([str(config), "--work-dir", str(work_dir), "--resume",
                       "--cfg-options", "schedule.max_iters=6"]) == 2
    assert "optim.lr: 0.002 -> 0.003; pass --force" in capfd.readouterr().err
    assert file_bytes(work_dir) == before


def test_the_dry_run_and_plan_show_the_merged_config(tmp_path, capsys, clean_cwd):
    config = user_config(tmp_path / "cfg")
    before = file_bytes(tmp_path)
    for main, args in [(train_main, ["--dry-run"]), (plan_tool.main, [])]:
        assert main([str(config), *args]) == 0
        out = capsys.readouterr().out
        assert "plan for 'run'" in out and "work_dirs/run (not created" in out, out
        assert "model        DigitsMLP" in out and "lr=0.002, weight_decay=0.01" in out, out
        assert "iterations   40 per epoch; 4 in all" in out, out
    assert file_bytes(tmp_path) == before


# (files to write under the config's folder, extra arguments, words the error line holds)
BAD = [
    ({"run.yaml": "_base_: [mid/lr.yaml, nope.yaml]\n"}, [],
     ["_base_: ", "run.yaml -> ", "nope.yaml: base config not found"]),
    ({"mid/lr.yaml": "_base_: ../nope/x.yaml\n"}, [],
     ["_base_: ", "run.yaml -> ", "mid/lr.yaml -> ", "nope/x.yaml: base config not found"]),
    ({"mid/lr.yaml": "_base_: ../run.yaml\n"}, [],
     ["_base_: cycle: ", "run.yaml -> ", "mid/lr.yaml -> ", "run.yaml"]),
    ({"mid/lr.yaml": "- a\n- b\n"}, [],
     ["_base_: ", "run.yaml -> ", "mid/lr.yaml: got a ListConfig at the top level, expected "
      "a mapping"]),
    ({"mid/lr.yaml": "optim: {lr: 1\n"}, [], ["_base_: ", "run.yaml -> ", "mid/lr.yaml:2: "]),
    ({"run.yaml": "_base_: 3\n"}, [], ["run.yaml: _base_: got 3, expected a path"]),
    ({"run.yaml": "_base_: [mid/lr.yaml, {x: 1}]\n"}, [],
     ["run.yaml: _base_[1]: got {'x': 1}, expected a path"]),
    ({"run.yaml": RUN.replace("_delete_: true", "_delete_: 'yes'")}, [],
     ["run.yaml: schedule._delete_: got 'yes', expected true or false"]),
    ({"mid/lr.yaml": f"_base_: {SINGLE}\noptim: {{_delete_: 0}}\n"}, [],
     ["mid/lr.yaml: optim._delete_: got 0, expected true or false"]),
    ({"run.yaml": "_delete_: true\n" + RUN}, [], ["run.yaml: _delete_ at the top level"]),
    ({"run.yaml": RUN + "model: {_base_: x.yaml}\n"}, [],
     ["run.yaml: model._base_: _base_ is read only at the top level"]),
    ({}, ["--cfg-options", "_base_=x.yaml"], ["override '_base_=x.yaml': _base_ works only"]),
    ({}, ["--cfg-options", "optim._delete_=true"], ["override 'optim._delete_=true'"]),
    ({"run.yaml": RUN.replace("_delete_: true, ", "")}, [],  # both lengths left set
     ["max_epochs", "max_iters"]),
]


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
def test_bad_inheritance_is_exit_2_naming_the_chain_and_nothing_written(tmp_path, capfd,
                                                                         clean_cwd, dry_run):
    work_dir = tmp_path / "run"
    failures = []
    for index, (texts, args, words) in enumerate(BAD):
        root = tmp_path / f"case{index}"
        config = user_config(root)
        for name, text in texts.items():
            (root / name).write_text(text)
        before = file_bytes(tmp_path)
        code = train_main([str(config), "--work-dir", str(work_dir), *args,
                           *(["--dry-run"] if dry_run else [])])
        err = capfd.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        missing = [w for w in words if not any(w in line for line in errors)]
        if code != 2 or len(errors) != 1 or missing or "Traceback" in err:
            failures.append(f"{texts} {args}: exit {code}, missing {missing}: {err[-600:]}")
        if file_bytes(tmp_path) != before or work_dir.exists():
            failures.append(f"{texts} {args}: wrote something")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("command", ["test", "plan", "sweep", "verify-resume"])
def test_every_command_refuses_a_missing_base_naming_the_chain(tmp_path, capfd, clean_cwd,
                                                               command):
    config = user_config(tmp_path / "cfg")
    (tmp_path / "cfg" / "mid" / "lr.yaml").write_text("_base_: gone.yaml\n")
    checkpoint = tmp_path / "weights.pth"  # a readable one: the config is what fails
    torch.save({"model": DigitsMLP().state_dict()}, checkpoint)
    main, args = {
        "test": (test_tool.main, [str(checkpoint), "--work-dir", str(tmp_path / "run")]),
        "plan": (plan_tool.main, ["--work-dir", str(tmp_path / "run")]),
        "sweep": (sweep_tool.main, ["--grid", "optim.lr=1e-3,2e-3",
                                    "--work-dir", str(tmp_path / "run")]),
        "verify-resume": (verify_tool.main, ["--steps", "4", "--work-dir",
                                             str(tmp_path / "run")]),
    }[command]
    before = file_bytes(tmp_path)
    assert main([str(config), *args]) == 2
    errors = [line for line in capfd.readouterr().err.splitlines()
              if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].endswith(
        f"run.yaml -> {tmp_path}/cfg/mid/lr.yaml -> {tmp_path}/cfg/mid/gone.yaml: "
        f"base config not found"), errors
    assert file_bytes(tmp_path) == before and not (tmp_path / "run").exists()

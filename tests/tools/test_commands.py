"""The ``trainrun`` command: its subcommands, and the names their usage lines give."""

from __future__ import annotations

import subprocess
import sys

import trainrun.cli as cli
from tests.cli import CONFIG, REPO, env


def test_python_m_trainrun_runs_a_subcommand_under_its_name():
    done = subprocess.run([sys.executable, "-m", "trainrun", "verify-resume", "--help"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: trainrun verify-resume ")


def test_an_error_line_names_the_subcommand_as_it_was_started(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainrun", "export", str(tmp_path / "none.pt"),
                           str(tmp_path / "out.pt")],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("trainrun export: error: "), done.stderr
    assert not (tmp_path / "out.pt").exists()


def test_no_subcommand_or_an_unknown_one_is_exit_2_listing_them(capsys):
    assert cli.main([]) == 2
    assert "train " in capsys.readouterr().err
    assert cli.main(["trian", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown subcommand 'trian'; expected one of train, plan, test, ")
    assert cli.main(["--help"]) == 0 and "verify-resume" in capsys.readouterr().out


def test_plan_prints_what_train_would_do_and_refuses_what_it_would_refuse(capsys):
    assert cli.main(["plan", str(CONFIG), "--cfg-options", "optim.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan for 'digits_ddp' (dry run") and "lr=0.5" in out
    assert cli.main(["plan", str(CONFIG), "--cfg-options", "optim.lr=-1"]) == 2
    assert "optim.lr: got -1" in capsys.readouterr().err

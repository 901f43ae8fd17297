"""trainrun installed as a package (pip install . into a fresh virtual environment): the
subcommands that start training by themselves (sweep, verify-resume) work from anywhere,
through the installed copy alone."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHORT = ["schedule.max_epochs=null", "schedule.max_iters=4", "schedule.val_interval=4",
         "checkpoint.interval=2", "logging.interval=1", "data.train.batch_size=128"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """trainrun built from a copy of the checkout's sources and installed, not editable, into a
    fresh virtual environment outside the checkout; its Python and the environment to run it.

    The new environment reaches the libraries trainrun needs (torch, omegaconf, ...) through a
    path file naming a folder of links to this environment's packages, trainrun's own (the
    editable install of the checkout) left out; so trainrun can only come from the install.
    """
    root = tmp_path_factory.mktemp("install")
    source = root / "source"  # a build in the checkout would leave build/ there
    shutil.copytree(REPO / "trainrun", source / "trainrun",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    libraries = root / "libraries"
    libraries.mkdir()
    for site_dir in map(Path, site.getsitepackages()):
        for entry in site_dir.iterdir():
            if not entry.name.startswith(("trainrun", "__editable__")) \
                    and not entry.name.endswith(".pth"):
                (libraries / entry.name).symlink_to(entry)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    new_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    (Path(new_site) / "libraries.pth").write_text(f"{libraries}\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                           "--no-deps", "--no-build-isolation", str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return python, env


def trainrun(python: Path, env: dict[str, str], cwd: Path, *args: str
             ) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "trainrun", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_installed_package_sweeps_and_verifies_a_resume_outside_the_checkout(
        installed, tmp_path):
    python, env = installed
    venv = python.parents[1]
    config = tmp_path / "digits.yaml"  # the user's own config file, beside nothing of trainrun
    shutil.copy(REPO / "configs" / "digits_single.yaml", config)  # but the bases it names
    shutil.copytree(REPO / "configs" / "_base_", tmp_path / "_base_")
    where = subprocess.run([str(python), "-c", "import trainrun, trainrun.cli.sweep as s; "
                            "print(trainrun.__file__); print(s.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    files = where.stdout.split()
    assert len(files) == 2, where.stdout + where.stderr
    assert all(Path(f).is_relative_to(venv) for f in files), files

    swept = trainrun(python, env, tmp_path, "sweep", str(config), "--grid", "optim.lr=1e-3,3e-3",
                     "--work-dir", str(tmp_path / "sweep"), "--cfg-options", *SHORT)
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    points = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(points) == 2
    for point in points:
        steps = [json.loads(line).get("step") for line in
                 (point / "metrics.jsonl").read_text().splitlines()]
        assert max(steps) == 4, point

    verified = trainrun(python, env, tmp_path, "verify-resume", str(config), "--steps", "4",
                        "--cfg-options", "data.train.batch_size=128")
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]

    script = venv / "bin" / "trainrun"  # the console script pip wrote
    helped = subprocess.run([str(script), "verify-resume", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: trainrun verify-resume "), helped.stdout
    assert not (REPO / "build").exists()

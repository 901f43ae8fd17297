"""The mpi4py object backend in a real `mpirun -np 2` job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "mpi4py_check.py"


def _mpirun() -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (Debian: apt-get install openmpi-bin libopenmpi-dev)")
    flags = ["--allow-run-as-root", "--oversubscribe"] if os.geteuid() == 0 else []
    return [mpirun, "-np", "2", *flags]


@pytest.mark.slow
def test_mpi4py_backend_under_mpirun(tmp_path):
    pytest.importorskip("mpi4py")
    done = subprocess.run([*_mpirun(), sys.executable, str(SCRIPT), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert [line["rank"] for line in lines] == [0, 1]
    for line in lines:
        assert line["world_size"] == 2 and line["initialized"]
        assert line["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert line["broadcast"] == "from 1"


def test_mpi4py_backend_alone_is_a_world_of_one():
    """Without mpirun, MPI runs as a singleton: rank 0 of 1, objects returned as they are."""
    pytest.importorskip("mpi4py")
    script = ("from trainrun.dist import get_dist_backend as g; b = g('mpi4py'); "
              "print(b.rank, b.world_size, b.is_initialized, b.all_gather_object('x'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "False", "['x']"]

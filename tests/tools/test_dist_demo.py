"""`make train`'s job (tools/dist_demo.py) trains on 2 ranks under torchrun and alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainrun.dist.launch import free_port

DEMO = Path(__file__).parents[2] / "tools" / "dist_demo.py"


def _accuracy(output: str) -> float:
    match = re.search(r"validation accuracy ([0-9.]+)", output)
    assert match, output
    return float(match.group(1))


@pytest.mark.slow
def test_demo_trains_on_two_ranks_under_torchrun():
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(DEMO), "--steps", "150"],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size 2" in done.stderr
    assert "(mean of 2 ranks)" in done.stderr
    assert _accuracy(done.stderr) >= 0.9
    assert "[rank 1]" not in done.stderr  # only rank 0 logs


def test_demo_trains_without_a_launcher():
    done = subprocess.run([sys.executable, str(DEMO), "--launcher", "none", "--steps", "150"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size 1" in done.stderr and _accuracy(done.stderr) >= 0.9

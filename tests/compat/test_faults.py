"""What trainrun adds still holds under the compat Runner: a job SIGKILLed mid-run resumes
(MMEngine's ``resume=True``) with the losses of the run that was never stopped, bit for bit;
and a second job into a work directory in use is refused by its lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch import nn

from tests.cli import env, kill_tree, run, worker_pid
from trainrun.compat.mmengine.runner import Runner
from trainrun.dist.launch import free_port
from trainrun.runner.schema import ConfigError

SCRIPT = Path(__file__).parent / "scripts" / "compat_train.py"


def torchrun(work_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()), str(SCRIPT), "--launcher", "pytorch",
            "--work-dir", str(work_dir), *args]


def losses(work_dir: Path) -> list[tuple[int, float]]:
    lines = (work_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.slow
def test_a_job_killed_mid_run_resumes_with_the_unbroken_runs_losses(tmp_path: Path):
    straight = run(torchrun(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = dict(losses(tmp_path / "straight"))
    assert sorted(expected) == list(range(1, 41))

    work_dir = tmp_path / "killed"
    job = subprocess.Popen(torchrun(work_dir, "--step-seconds", "0.3"), env=env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (work_dir / "last_checkpoint").exists():
            assert job.poll() is None, "the job ended before its first checkpoint"
            time.sleep(0.01)
        with pytest.raises(ConfigError, match="is in use by another job"):
            Runner(model=nn.Linear(2, 2), work_dir=str(work_dir))  # while the job trains there
        victim = worker_pid(job.pid, 1)
        assert victim is not None, "rank 1's process ended before it was killed"
        os.kill(victim, signal.SIGKILL)
        job.communicate(timeout=90)
    finally:
        kill_tree(job.pid)
    logged = max(step for step, _ in losses(work_dir))
    assert 10 <= logged < 40, logged  # the kill landed mid-run
    resumed = run(torchrun(work_dir, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(work_dir)
    assert [step for step, _ in after] == list(range(1, 41))  # each step once
    assert all(loss == expected[step] for step, loss in after)  # bit for bit

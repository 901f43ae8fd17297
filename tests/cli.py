"""Running the tools as a user runs them, for the tests: the repository's paths, the shipped
digits config made short, the environment the tools' processes get, torchrun commands, and
stopping the processes a test started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from trainrun.cli.processes import descendants
from trainrun.dist.launch import free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "tools" / "train.py"
CONFIG = REPO / "configs" / "digits_ddp.yaml"
# 2 epochs of 20 steps (2 processes of 32), a checkpoint each, logged every 5 steps
SHORT = ["schedule.max_epochs=2", "checkpoint.interval=1", "logging.interval=5"]
# 40 steps of a model that takes its time (0.03 s a step), every step logged, a checkpoint
# every 10: a job can be signalled or killed between its checkpoints
SLOW = [*SHORT, "schedule.max_epochs=null", "schedule.max_iters=40", "schedule.val_interval=20",
        "checkpoint.interval=10", "logging.interval=1",
        "model.type=tests.tools.models.SlowDigitsMLP", "model.step_seconds=0.03"]

# what launchers tell the processes they start (torchrun, SLURM, Open MPI, MPICH)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_")


def is_launcher_variable(name: str) -> bool:
    """Whether ``name`` is one of the variables a launcher sets for its processes."""
    return name in TORCHRUN_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def env() -> dict[str, str]:
    """This environment for a tool's processes: without any launcher's variables (each test's
    launcher sets its own, whatever started pytest), with the repository importable (test
    models live in tests/) and one thread per process (2 processes share 2 cores)."""
    out = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
    out["OMP_NUM_THREADS"] = "1"
    return out


def use_env(monkeypatch: pytest.MonkeyPatch, wanted: Mapping[str, str]) -> None:
    """Make this process's environment ``wanted`` exactly (until the test ends): a tool run
    in process starts its own processes with it."""
    for key in set(os.environ) - set(wanted):
        monkeypatch.delenv(key)
    for key, value in wanted.items():
        monkeypatch.setenv(key, value)


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    """``tools/train.py ARGS`` on ``nproc`` processes under torchrun, on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), str(TRAIN), *args]


def run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``cmd`` with ``env``, its output and errors captured as text."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (in sessions of their own too)."""
    for each in [*descendants(pid), pid]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker of ``rank`` (the one with RANK=rank in its environment)."""
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def file_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: what "left as it was" compares."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}

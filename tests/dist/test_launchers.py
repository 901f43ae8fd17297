"""`init_dist` under the real launchers: torchrun, mpirun, and srun / sbatch on a local SLURM.

Each test starts tests/dist/scripts/launch_check.py as 2 processes, which join a gloo group,
run collectives and print one JSON report per rank. Every command runs under a hard timeout,
so a launcher that hangs fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

# a job's environment: this one without any launcher's variables (each test's launcher sets
# its own), one thread a rank (2 cores, 2 ranks), the repository importable
from tests.cli import env as job_env
from tests.runs import shared_run
from tests.slurm_cluster import SlurmCluster
from trainrun.dist.launch import free_port, slurm_port

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "launch_check.py"
TIMEOUT_S = 120  # per launcher command; a healthy one takes a few seconds


def start(cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session, so that a timeout can kill all of it."""
    return subprocess.Popen(cmd, env=env or job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, deadline: float) -> subprocess.CompletedProcess:
    """Wait for ``proc`` until ``deadline`` (monotonic); past it, kill it and fail the test."""
    try:
        stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{proc.args[0]} did not finish in time\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(cmd: Sequence[str], timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return finish(start(cmd), time.monotonic() + timeout)


def reports(output: str) -> list[dict[str, Any]]:
    """The JSON lines launch_check.py printed, by rank."""
    found = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return sorted(found, key=lambda report: report["rank"])


def ok_reports(*results: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    """The reports of commands that must have succeeded."""
    for result in results:
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return reports("".join(result.stdout for result in results))


def torchrun(*args: str, port: int, script: Path = SCRIPT) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(port), str(script), *args]


def run_two_ranks(*args: str, timeout: float = TIMEOUT_S, script: Path = SCRIPT
                  ) -> list[dict[str, Any]]:
    """launch_check.py (or ``script``, given ``args`` alone) as 2 processes given torchrun's
    variables by hand, as `accelerate launch` does (a few seconds faster than torchrun, which
    imports torch first)."""
    port = str(free_port())
    command = [str(SCRIPT), "pytorch", *args] if script == SCRIPT else [str(script), *args]
    procs = [
        start([sys.executable, *command],
              {**job_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        for rank in range(2)
    ]
    deadline = time.monotonic() + timeout
    return ok_reports(*(finish(proc, deadline) for proc in procs))


def assert_two_ranks(found: list[dict[str, Any]], launcher: str) -> None:
    """Both ranks joined one group of 2, ran the collectives, and exported torchrun's variables."""
    assert [r["rank"] for r in found] == [0, 1], found
    for rank, report in enumerate(found):
        assert report["inferred"] == launcher
        assert (report["world_size"], report["local_rank"], report["local_size"]) == (2, rank, 2)
        assert report["sum"] == 1 + 2
        assert [item["rank"] for item in report["gathered"]] == [0, 1]
        assert report["local_from_env"] == [rank, 2]
        assert report["local_from_group"] == [rank, 2]
        assert report["local_group_size"] == 2
        assert report["left"]
        env = report["env"]
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "2")
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "2")
    assert found[0]["env"]["MASTER_ADDR"] == found[1]["env"]["MASTER_ADDR"]
    assert found[0]["env"]["MASTER_PORT"] == found[1]["env"]["MASTER_PORT"]


@shared_run
def torchrun_run() -> tuple[int, list[dict[str, Any]]]:
    """The master port and the reports of one `torchrun --nproc_per_node 2` run (once a
    session: the tests asking for it share an xdist worker)."""
    port = free_port()
    return port, ok_reports(run(torchrun("pytorch", port=port)))


def test_torchrun(torchrun_run: tuple[int, list[dict[str, Any]]]) -> None:
    port, found = torchrun_run
    assert_two_ranks(found, "pytorch")
    assert {r["env"]["MASTER_PORT"] for r in found} == {str(port)}


def test_rank_check_names_what_disagreed(
    torchrun_run: tuple[int, list[dict[str, Any]]],
) -> None:
    """Every rank refuses a group whose ranks were told different world sizes."""
    _, found = torchrun_run
    assert [r["rank"] for r in found] == [0, 1]
    for report in found:
        assert report["rank_check"]["error"] == "DistInitError"
        assert "disagree on the world size" in report["rank_check"]["message"]
        assert "[2, 3]" in report["rank_check"]["message"]


def mpirun() -> list[str]:
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (Debian: apt-get install openmpi-bin)")
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return ["mpirun", "-np", "2", *as_root, "--oversubscribe"]


def test_mpirun() -> None:
    port = free_port()  # the mpi launcher's default, 29500, may be taken on a shared machine
    cmd = [*mpirun(), "-x", f"MASTER_PORT={port}", sys.executable, str(SCRIPT), "mpi"]
    found = ok_reports(run(cmd))
    assert_two_ranks(found, "mpi")
    for report in found:
        assert report["env"]["OMPI_COMM_WORLD_RANK"] == str(report["rank"])
        assert report["env"]["MASTER_ADDR"] == "127.0.0.1"  # one node: loopback
        assert report["env"]["MASTER_PORT"] == str(port)


def assert_slurm_ranks(found: list[dict[str, Any]], cluster: SlurmCluster,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks are SLURM's task ids, the master is the node, the port comes from the job id."""
    assert_two_ranks(found, "slurm")
    job_ids = {r["env"]["SLURM_JOB_ID"] for r in found}
    assert len(job_ids) == 1
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", job_ids.pop())
    for report in found:
        assert report["env"]["SLURM_PROCID"] == str(report["rank"])
        assert report["env"]["MASTER_ADDR"] == cluster.host
        assert report["env"]["MASTER_PORT"] == str(slurm_port())


def test_srun(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    result = slurm.srun("-n", "2", sys.executable, str(SCRIPT), "slurm", env=job_env(),
                        timeout=TIMEOUT_S)
    assert_slurm_ranks(ok_reports(result), slurm, monkeypatch)


def test_sbatch_runs_srun_and_refuses_the_batch_step(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The usual batch script works; running the job in the batch step itself fails clearly."""
    check = f"{sys.executable} {SCRIPT} slurm"
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
echo "batch step SLURM_STEP_ID=${{SLURM_STEP_ID-unset}}"
{check} 2> batch_step.err &  # beside the srun step, to save a python start
srun {check}
wait $!
echo "batch step exit $?"
""")
    output = tmp_path / "job.out"
    job = slurm.submit(script, "-n", "2", f"--chdir={tmp_path}", f"--output={output}",
                       env=job_env())
    info = slurm.wait_job(job, timeout=TIMEOUT_S)
    log = output.read_text() if output.exists() else ""
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert_slurm_ranks(reports(log), slurm, monkeypatch)
    assert "batch step SLURM_STEP_ID=unset" in log
    assert "batch step exit 1" in log
    assert "SLURM_STEP_ID is not set" in (tmp_path / "batch_step.err").read_text()


def test_collective_timeout_names_the_operation(tmp_path: Path) -> None:
    """Rank 1 all_reduces alone: it gets DistTimeoutError after the 3 s timeout, not a hang."""
    found = run_two_ranks("timeout", str(tmp_path / "rank1-done"))
    assert [r["rank"] for r in found] == [0, 1]
    waited = found[1]
    assert waited["error"] == "DistTimeoutError", waited
    assert "all_reduce" in waited["message"]
    assert "timed out after 3 s" in waited["message"]
    # it waited for the timeout, and not much longer (a loaded 2-core machine takes seconds)
    assert 2.5 < waited["elapsed"] < 30


REJOIN = SCRIPT.parent / "rejoin_check.py"


def test_a_process_joins_a_group_again_after_leaving_one() -> None:
    """Three groups one after the other in each process, under torchrun (its agent's store
    serves them all) and given torchrun's variables by hand (rank 0's does): each group
    works. The second join read the first group's addresses, left in the same store, and
    timed out connecting to them about one time in two (as a second Runner did)."""
    for found in (ok_reports(run(torchrun("dist", port=free_port(), script=REJOIN))),
                  run_two_ranks("dist", script=REJOIN)):
        assert [r["rank"] for r in found] == [0, 1], found
        assert all(r["found"] == [3.0, 3.0, 3.0] for r in found), found


def test_a_second_runner_in_one_process_trains(tmp_path: Path) -> None:
    """Two Runners (launcher: pytorch) one after the other in each process under torchrun:
    the second joins a group of its own and trains to its end, as the first did."""
    done = run(torchrun("runner", str(tmp_path), port=free_port(), script=REJOIN))
    assert done.returncode == 0, done.stderr[-3000:]
    found = reports(done.stdout)
    assert [(r["rank"], r["found"]) for r in found] == [(0, [20, 20]), (1, [20, 20])], found
    assert (tmp_path / "run2" / "checkpoints" / "last").exists()


def test_pytorch_launcher_without_torchrun_fails_fast() -> None:
    """`--launcher pytorch` without torchrun: a clear error at once, not a wait for peers."""
    began = time.monotonic()
    result = run([sys.executable, str(SCRIPT), "pytorch"], timeout=60)
    assert result.returncode != 0
    assert "DistInitError: RANK is not set: start this with torchrun" in result.stderr
    assert time.monotonic() - began < 30

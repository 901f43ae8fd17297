"""A real one-node SLURM cluster (munged, slurmctld, slurmd) started inside a temporary directory.

Tests that need `srun`, `sbatch`, requeues or signals use it through a session-scoped fixture:

    @pytest.fixture(scope="session")
    def slurm(tmp_path_factory):
        yield from slurm_cluster.session_cluster(tmp_path_factory)

Everything the daemons write (config, munge key and socket, state, spool, logs) stays in that
directory, the daemons listen on free ports, and only the processes started here are stopped,
so a cluster of another test run on the same machine is left alone. Settings follow
DESIGN.md ("A real one-node SLURM runs here"). There is no accounting database: job states come
from `squeue` / `scontrol show job`, not `sacct`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainrun.dist.launch import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scontrol",
            "scancel")
START_TIMEOUT_S = 30.0
END_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                        "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


class SlurmUnavailable(RuntimeError):
    """SLURM cannot run here; the message says why (tests skip with it)."""


def slurm_conf(root: Path, host: str, cpus: int, ctld_port: int, slurmd_port: int,
               first_job_id: int = 1) -> str:
    """slurm.conf for one node ``host`` with ``cpus`` CPUs; every path lies inside ``root``;
    job ids count from ``first_job_id``."""
    return f"""\
ClusterName=trainrun
FirstJobId={first_job_id}
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
NodeName={host} CPUs={cpus} RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def client_env(conf: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) pointed at ``conf``, without the SLURM_*
    variables of an outer job, which would send commands to another cluster's job."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    return env


@dataclass
class SlurmCluster:
    """A running one-node cluster; client commands go through `run` (or `srun` / `sbatch`)."""

    root: Path
    host: str
    cpus: int
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(self, *args: str, timeout: float = 60, env: Mapping[str, str] | None = None,
            **kwargs) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster, in ``env`` (default: this
        process's environment; jobs inherit it), and capture its output as text."""
        return subprocess.run(args, env=client_env(self.conf, env), capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    def srun(self, *args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess[str]:
        """``srun ARGS``; gives up (instead of queueing forever) when the node cannot take it."""
        return self.run("srun", "--immediate=20", "--time=5", *args, timeout=timeout, **kwargs)

    def sbatch(self, script: Path, *args: str, timeout: float = 60,
               script_args: Sequence[str] = (), **kwargs) -> subprocess.CompletedProcess[str]:
        """``sbatch ARGS SCRIPT SCRIPT_ARGS``. Prefer `submit` + `wait_job` to ``--wait``:
        sbatch polls every 10 s, which turns a 1 s job into an 11 s one."""
        return self.run("sbatch", "--time=5", *args, str(script), *script_args,
                        timeout=timeout, **kwargs)

    def submit(self, script: Path, *args: str, **kwargs) -> int:
        """Submit ``script`` with sbatch ``args`` (and ``script_args=``) and return its job
        id."""
        result = self.sbatch(script, "--parsable", *args, timeout=30, **kwargs)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job_info(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...); no sacct here."""
        result = self.run("scontrol", "-o", "show", "job", str(job_id), timeout=10)
        if result.returncode != 0:
            raise LookupError(f"no job {job_id}: {result.stderr.strip()}")
        return dict(word.split("=", 1) for word in result.stdout.split() if "=" in word)

    def job_state(self, job_id: int | str) -> str:
        """A job's state: PENDING, RUNNING, COMPLETED, FAILED, ..."""
        return self.job_info(job_id)["JobState"]

    def wait_job(self, job_id: int | str, timeout: float = 60) -> dict[str, str]:
        """Wait until the job has ended and return its fields; cancel it and raise on timeout."""
        deadline = time.monotonic() + timeout
        while (info := self.job_info(job_id))["JobState"] not in END_STATES:
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id), timeout=10)
                raise TimeoutError(f"job {job_id} still {info['JobState']} after {timeout:g} s")
            time.sleep(0.1)
        return info

    def node_state(self) -> str:
        """The node's state as `sinfo` prints it ('idle', 'mixed', ...; '' when unknown)."""
        try:
            result = self.run("sinfo", "-h", "-o", "%T", "-n", self.host, timeout=10)
        except subprocess.TimeoutExpired:
            return ""
        return result.stdout.strip() if result.returncode == 0 else ""

    def job_ids(self) -> list[str]:
        """The jobs slurmctld still knows as pending or running."""
        result = self.run("squeue", "-h", "-o", "%A", timeout=10)
        return result.stdout.split() if result.returncode == 0 else []

    def cancel_all(self, timeout: float = 10) -> None:
        """Cancel every job of this cluster and wait (up to ``timeout``) until none is left, so
        that no task outlives the daemons."""
        deadline = time.monotonic() + timeout
        while (jobs := self.job_ids()) and time.monotonic() < deadline:
            self.run("scancel", "--full", *jobs, timeout=10)
            time.sleep(0.2)

    def logs(self, lines: int = 20) -> str:
        """The last lines of every daemon log, to explain a failure."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel the cluster's jobs, then stop the daemons it started (newest first) and
        nothing else."""
        if self.daemons and all(proc.poll() is None for proc in self.daemons):
            self.cancel_all()
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.daemons.clear()


def _daemon(cluster: SlurmCluster, name: str, *args: str) -> None:
    """Start daemon ``name`` in the foreground (so its pid is the one to stop), output to a log."""
    with open(cluster.root / "log" / f"{name}.out", "w") as log:
        proc = subprocess.Popen([name, *args], env=client_env(cluster.conf), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    cluster.daemons.append(proc)


def _wait_for(what: str, ready: Callable[[], bool], cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [p.args[0] for p in cluster.daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"not within {timeout:g} s"
            raise SlurmUnavailable(f"{what}: {why}\n{cluster.logs()}")
        time.sleep(0.2)


def start_cluster(root: Path, timeout: float = START_TIMEOUT_S) -> SlurmCluster:
    """Write the config into ``root``, start munged, slurmctld and slurmd, wait for an idle node.

    Raises SlurmUnavailable (after stopping whatever it started) when a binary is missing or a
    daemon does not come up.
    """
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        raise SlurmUnavailable(f"SLURM binaries missing: {', '.join(missing)}")
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"slurmd must run as root, and this is uid {os.geteuid()}")
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    cpus = os.cpu_count() or 1  # all CPUs: `nproc` would honour OMP_NUM_THREADS
    cluster = SlurmCluster(root=root, host=host, cpus=cpus)
    cluster.conf.write_text(slurm_conf(root, host, cpus, free_port(), free_port(),
                                       first_job_id()))
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    try:
        _daemon(cluster, "munged", "--foreground", "--force", f"--key-file={key}",
                f"--socket={root}/munge.socket", f"--pid-file={root}/munged.pid",
                f"--log-file={root}/log/munged.log", f"--seed-file={root}/munged.seed")
        _wait_for("munged", (root / "munge.socket").exists, cluster, timeout)
        _daemon(cluster, "slurmctld", "-D", "-c", "-i")
        _daemon(cluster, "slurmd", "-D")
        _wait_for("the node to be idle", lambda: cluster.node_state() == "idle", cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def first_job_id() -> int:
    """Where this test process's cluster starts numbering jobs: 1 + 1000 x its pytest-xdist
    worker number. trainrun's SLURM launcher takes MASTER_PORT from the job id (10000 + id %
    20000), so the clusters of two workers both counting from 1 started jobs on the same port
    at the same time (EADDRINUSE in a fresh-clone CI run)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return 1 + 1000 * (int(worker) if worker.isdigit() else 0)


def session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Body of a session fixture: a started cluster, stopped at the end; skips when impossible."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(f"no local SLURM: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()

"""How each launcher's environment variables become rank, world size, local rank and master.

In-process and without a process group: only the parsing and the errors before joining.
Running the launchers for real is tests/dist/test_launchers.py's job.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as torch_dist

from trainrun.dist import DistInitError, DistTimeoutError, infer_launcher, init_dist
from trainrun.dist.launch import (
    DEFAULT_PORT,
    LaunchEnv,
    announced_rank,
    announced_world_size,
    launch_env,
    mpi_env,
    pytorch_env,
    resolve_backend,
    slurm_env,
    slurm_port,
)
from trainrun.dist.timeouts import DEFAULT_TIMEOUT, named_operation, to_timedelta

# every test starts with no launcher's variables, whatever started pytest (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("clean_env")

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
# task 1 of `srun -n 2` on one node, as the local SLURM set it (tests/slurm_cluster.py)
SRUN_TASK = {"SLURM_JOB_ID": "17", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODELIST": "vm", "SLURM_STEP_NODELIST": "vm",
             "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2"}
# the batch script of `sbatch -n 2`: the job's task count, but no step
BATCH_STEP = {"SLURM_JOB_ID": "18", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
              "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "vm",
              "SLURM_TASKS_PER_NODE": "2"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}


def set_env(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


# --- pytorch (torchrun) ---------------------------------------------------------------------


def test_pytorch_reads_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TORCHRUN)
    assert pytorch_env() == LaunchEnv(rank=3, world_size=4, local_rank=1, local_world_size=2,
                                      master_addr="10.0.0.1", master_port=29400)


def test_pytorch_without_torchrun_says_how_to_start() -> None:
    with pytest.raises(DistInitError) as info:
        pytorch_env()
    assert str(info.value) == "RANK is not set: start this with torchrun, or use --launcher none"


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_pytorch_names_the_missing_variable(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    set_env(monkeypatch, TORCHRUN)
    monkeypatch.delenv(missing)
    with pytest.raises(DistInitError, match=f"^{missing} is not set: start this with torchrun"):
        pytorch_env()


@pytest.mark.parametrize("name", ["RANK", "LOCAL_RANK"])
def test_pytorch_rejects_a_non_number(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    set_env(monkeypatch, {**TORCHRUN, name: "zero"})
    with pytest.raises(DistInitError, match=f"{name}='zero' is not a whole number"):
        pytorch_env()


# --- slurm (srun) ---------------------------------------------------------------------------


def test_slurm_reads_an_srun_task(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, SRUN_TASK)
    env = slurm_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)
    assert env.master_addr == "vm"
    assert env.master_port == slurm_port()


@pytest.mark.parametrize(
    ("tasks_per_node", "total", "node", "local_rank", "rank", "local_size"),
    [("3,2", 5, 1, 1, 4, 2), ("2(x3)", 6, 2, 1, 5, 2), ("2(x2),1", 5, 2, 0, 4, 1),
     ("4", 4, 0, 3, 3, 4)],
)
def test_slurm_global_rank_counts_tasks_on_earlier_nodes(
    monkeypatch: pytest.MonkeyPatch, tasks_per_node: str, total: int, node: int,
    local_rank: int, rank: int, local_size: int,
) -> None:
    set_env(monkeypatch, {**SRUN_TASK, "SLURM_NODELIST": "gpu[01-03]",
                          "SLURM_STEP_NODELIST": "gpu[01-03]", "SLURM_NTASKS": str(total),
                          "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
                          "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local_rank),
                          "SLURM_PROCID": "999"})
    env = slurm_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (
        rank, total, local_rank, local_size)
    assert env.master_addr == "gpu01"


def test_slurm_reads_ntasks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--ntasks-per-node` alone (no task list) also places the ranks."""
    set_env(monkeypatch, {**SRUN_TASK, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
                          "SLURM_NODELIST": "n[1-2]", "SLURM_NODEID": "1", "SLURM_LOCALID": "1"})
    for name in ("SLURM_STEP_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"):
        monkeypatch.delenv(name)
    env = slurm_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.master_addr == "n1"


def test_slurm_uses_procid_without_a_node_id(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {**SRUN_TASK, "SLURM_PROCID": "1", "SLURM_LOCALID": "0"})
    monkeypatch.delenv("SLURM_NODEID")
    assert slurm_env().rank == 1


def test_slurm_master_is_the_first_host_of_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {**SRUN_TASK, "SLURM_NODELIST": "gpu[01-04,07],cpu3"})
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    assert slurm_env().master_addr == "gpu01"
    # a step on part of the allocation: rank 0 runs on the step's first node
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[03-04]")
    assert slurm_env().master_addr == "gpu03"
    # an address the job exported on purpose wins
    monkeypatch.setenv("MASTER_ADDR", "gpu01-ib")
    assert slurm_env().master_addr == "gpu01-ib"


def test_slurm_port_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert slurm_port() == DEFAULT_PORT
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    derived = slurm_port()
    assert derived != DEFAULT_PORT and 1024 < derived < 65536
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    assert slurm_port() != derived  # two jobs sharing a node do not collide
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert slurm_port() == 23456
    assert slurm_port(34567) == 34567
    assert slurm_port("34568") == 34568


@pytest.mark.parametrize("port", [0, 70000, "http"])
def test_slurm_rejects_a_bad_port(monkeypatch: pytest.MonkeyPatch, port: int | str) -> None:
    set_env(monkeypatch, SRUN_TASK)
    with pytest.raises(ValueError, match="port must be a number from 1 to 65535"):
        slurm_env(port=port)


def test_slurm_without_srun_says_how_to_start() -> None:
    with pytest.raises(DistInitError) as info:
        slurm_env()
    assert str(info.value) == (
        "SLURM_NTASKS is not set: start this with srun inside a SLURM allocation, "
        "or use --launcher none")


@pytest.mark.parametrize("missing", ["SLURM_LOCALID", "SLURM_NODELIST"])
def test_slurm_names_the_missing_variable(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    set_env(monkeypatch, SRUN_TASK)
    monkeypatch.delenv(missing)
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(DistInitError, match=f"^{missing} is not set: start this with srun"):
        slurm_env()


def test_slurm_refuses_the_batch_script_of_a_multi_task_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Joining from the batch step would wait for tasks that never start: say so instead."""
    set_env(monkeypatch, BATCH_STEP)
    with pytest.raises(DistInitError, match="SLURM_STEP_ID is not set: this is the batch script.*"
                                            "start this with srun"):
        slurm_env()
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task job may run without srun
    assert (slurm_env().rank, slurm_env().world_size) == (0, 1)


# --- mpi (mpirun) ---------------------------------------------------------------------------


def test_mpi_reads_open_mpi_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, OPEN_MPI)
    assert mpi_env() == LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2,
                                  master_addr="127.0.0.1", master_port=DEFAULT_PORT)


def test_mpi_reads_mpich_and_intel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {**MPICH, "MASTER_ADDR": "node1"})
    assert mpi_env() == LaunchEnv(rank=2, world_size=4, local_rank=0, local_world_size=2,
                                  master_addr="node1", master_port=DEFAULT_PORT)


def test_mpi_port_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, OPEN_MPI)
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert mpi_env().master_port == 23456
    assert mpi_env(port=34567).master_port == 34567


def test_mpi_without_mpirun_says_how_to_start() -> None:
    with pytest.raises(DistInitError, match="OMPI_COMM_WORLD_RANK .*PMI_RANK .*is not set: "
                                            "start this with mpirun, or use --launcher none"):
        mpi_env()


def test_mpi_names_the_missing_size(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, MPICH)
    monkeypatch.delenv("PMI_SIZE")
    with pytest.raises(DistInitError, match="^PMI_SIZE is not set: start this with mpirun"):
        mpi_env()


# --- infer_launcher -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "launcher"),
    [
        ({}, "none"),
        (TORCHRUN, "pytorch"),
        (SRUN_TASK, "slurm"),
        ({**SRUN_TASK, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}, "none"),
        (BATCH_STEP, "none"),
        ({**SRUN_TASK, **TORCHRUN}, "pytorch"),  # torchrun started by srun
        (OPEN_MPI, "mpi"),
        ({**BATCH_STEP, **OPEN_MPI}, "mpi"),  # mpirun in a batch script
        ({**SRUN_TASK, **OPEN_MPI}, "mpi"),  # mpirun's daemons started by srun (many nodes)
        (MPICH, "mpi"),
    ],
    ids=["nothing", "torchrun", "srun", "srun-1-task", "batch-step", "torchrun-in-srun",
         "mpirun", "mpirun-in-batch", "mpirun-over-srun", "mpich"],
)
def test_infer_launcher(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str],
                        launcher: str) -> None:
    set_env(monkeypatch, variables)
    assert infer_launcher() == launcher


# --- what a dry run reads -------------------------------------------------------------------


@pytest.mark.parametrize(("launcher", "variables", "size_var"), [
    ("pytorch", TORCHRUN, "WORLD_SIZE"), ("slurm", SRUN_TASK, "SLURM_NTASKS"),
    ("mpi", OPEN_MPI, "OMPI_COMM_WORLD_SIZE"), ("mpi", MPICH, "PMI_SIZE"),
])
def test_the_announced_rank_and_size_are_what_joining_reads(
        monkeypatch: pytest.MonkeyPatch, launcher: str, variables: dict[str, str],
        size_var: str) -> None:
    set_env(monkeypatch, {**variables, "MASTER_ADDR": "10.0.0.1"})  # MPICH's two nodes
    joined = launch_env(launcher)
    assert announced_world_size(launcher) == (joined.world_size, size_var)
    assert announced_rank(launcher) == joined.rank


@pytest.mark.parametrize("launcher", ["pytorch", "slurm", "mpi", "none"])
def test_nothing_is_announced_without_the_launchers_variables(launcher: str) -> None:
    assert announced_world_size(launcher) is None and announced_rank(launcher) is None


# --- init_dist's checks before joining ------------------------------------------------------


def test_init_dist_without_torchrun_fails_clearly() -> None:
    with pytest.raises(DistInitError, match="^RANK is not set: start this with torchrun"):
        init_dist("pytorch", "gloo")
    assert not torch_dist.is_initialized()


@pytest.mark.parametrize("launcher", ["none", "torchrun", "PyTorch", ""])
def test_init_dist_rejects_unknown_launchers(launcher: str) -> None:
    with pytest.raises(ValueError, match="launcher must be one of pytorch, slurm, mpi"):
        init_dist(launcher, "gloo")


@pytest.mark.parametrize("backend", ["ucc", "GLOO", ""])
def test_init_dist_rejects_unknown_backends(backend: str) -> None:
    with pytest.raises(ValueError, match="backend must be one of auto, nccl, gloo, mpi"):
        init_dist("pytorch", backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TORCHRUN)
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
        init_dist("pytorch")  # nccl is the default backend
    assert not torch_dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_auto_backend_is_gloo_without_cuda() -> None:
    assert resolve_backend("auto") == "gloo"
    assert resolve_backend("gloo") == "gloo"


@pytest.mark.skipif(torch_dist.is_mpi_available(), reason="needs a torch built without MPI")
def test_mpi_backend_without_torch_mpi_says_so() -> None:
    with pytest.raises(ValueError, match="backend 'mpi' needs a torch built with MPI"):
        resolve_backend("mpi")


# --- timeouts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [(None, DEFAULT_TIMEOUT), (90, datetime.timedelta(seconds=90)),
     (2.5, datetime.timedelta(seconds=2.5)),
     (datetime.timedelta(minutes=2), datetime.timedelta(minutes=2))],
)
def test_timeout_values(timeout: float | datetime.timedelta | None,
                        expected: datetime.timedelta) -> None:
    assert to_timedelta(timeout) == expected
    assert DEFAULT_TIMEOUT == datetime.timedelta(minutes=30)


@pytest.mark.parametrize(
    "timeout",
    [0, -5, datetime.timedelta(0), "60", True, float("inf"), float("nan"), 1e300],
)
def test_bad_timeouts_are_rejected(timeout: object) -> None:
    with pytest.raises(ValueError, match="timeout must be"):
        to_timedelta(timeout)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be"):
        init_dist("pytorch", "gloo", timeout=timeout)  # type: ignore[arg-type]
    assert not torch_dist.is_initialized()


def test_named_operation_leaves_other_errors_alone() -> None:
    with pytest.raises(RuntimeError, match="^Connection closed by peer$") as info:
        with named_operation("all_reduce"):
            raise RuntimeError("Connection closed by peer")
    assert not isinstance(info.value, DistTimeoutError)


@pytest.mark.parametrize(("text", "relabelled"), [
    ("[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 3000ms for recv "
     "operation to complete", True),
    ("[../gloo/transport/tcp/pair.cc:534] Application timeout caused pair closure", True),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, "
     "OpType=ALLREDUCE) ran for 600042 milliseconds before timing out.", True),
    ("my_dataset: connect timeout reading s3://bucket/shard-7", False),  # not the collective's
    ("Timeouts must be positive", False),
])
def test_only_a_backends_own_timeout_is_relabelled(text: str, relabelled: bool) -> None:
    with pytest.raises(RuntimeError) as info:
        with named_operation("all_reduce"):
            raise RuntimeError(text)
    assert isinstance(info.value, DistTimeoutError) == relabelled
    if relabelled:
        assert str(info.value).startswith("all_reduce timed out after ")

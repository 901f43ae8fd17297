"""Joining the job: the pytorch, slurm and mpi launchers, ``init_dist`` and local groups.

Each launcher turns its own environment variables into one ``LaunchEnv``; ``init_dist`` exports
torchrun's variables from it (so code that reads ``LOCAL_RANK`` works under any launcher),
joins the default process group and then checks that the ranks are consistent.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from trainrun.dist.info import _set_local_group, get_world_size, is_distributed
from trainrun.dist.slurm import expand_nodelist, expand_tasks_per_node
from trainrun.dist.timeouts import named_operation, set_timeout, to_timedelta

#: The launchers ``init_dist`` joins a job with; a config's launcher may also be 'none'.
LAUNCHERS = ("pytorch", "slurm", "mpi")  # those that join a job (the config adds 'none')
STARTERS = {"pytorch": "torchrun", "slurm": "srun", "mpi": "mpirun"}  # each launcher's program
#: The communication backends ``init_dist`` takes; 'auto' means nccl when CUDA is available,
#: else gloo.
BACKENDS = ("auto", "nccl", "gloo", "mpi")
DEFAULT_PORT = 29500


class DistInitError(RuntimeError):
    """The job cannot be joined: a launcher variable is missing, or the ranks disagree.

    ``init_dist`` raises it with one clear message instead of a hang or a KeyError: which
    variable is missing or malformed and how to start the job (``RANK is not set: start this
    with torchrun, or use --launcher none``), what the ranks disagreed on, or that this
    process already joined a group. A RuntimeError.
    """


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as a launcher describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def _require(name: str, how: str) -> str:
    value = os.environ.get(name)
    if value in (None, ""):
        raise DistInitError(f"{name} is not set: {how}, or use --launcher none")
    return value


def _to_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DistInitError(f"{name}={value!r} is not a whole number") from None


def _int_var(name: str, how: str) -> int:
    return _to_int(name, _require(name, how))


def _optional_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else _to_int(name, value)


def _port(port: int | str | None, fallback: int) -> int:
    """The ``port`` argument, else MASTER_PORT from the environment, else ``fallback``."""
    value = port if port is not None else os.environ.get("MASTER_PORT") or fallback
    try:
        port_number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"port must be a number from 1 to 65535, got {value!r}") from None
    if not 0 < port_number < 65536:
        raise ValueError(f"port must be a number from 1 to 65535, got {port_number}")
    return port_number


def pytorch_env(**_: Any) -> LaunchEnv:
    """Read the variables torchrun (and ``accelerate launch``) set."""
    how = "start this with torchrun"
    rank = _int_var("RANK", how)  # first: a plain `python train.py` is told "RANK is not set"
    world_size = _int_var("WORLD_SIZE", how)
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=_optional_int("LOCAL_RANK", rank),
        local_world_size=_optional_int("LOCAL_WORLD_SIZE", world_size),
        master_addr=_require("MASTER_ADDR", how),
        master_port=_port(None, _int_var("MASTER_PORT", how)),
    )


def free_port() -> int:
    """A TCP port nobody on this machine listens on right now (for a rendezvous this process
    starts: torchrun's, or a test's)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def slurm_port(port: int | str | None = None) -> int:
    """``port``, else MASTER_PORT, else one derived from SLURM_JOB_ID, else 29500.

    Deriving it from the job id keeps two jobs that share a node off each other's port.
    """
    job_id = os.environ.get("SLURM_JOB_ID", "")
    fallback = 10000 + int(job_id) % 20000 if job_id.isdigit() else DEFAULT_PORT
    return _port(port, fallback)


def slurm_env(port: int | str | None = None, **_: Any) -> LaunchEnv:
    """Read the variables ``srun`` sets for each task."""
    how = "start this with srun inside a SLURM allocation"
    world_size = _int_var("SLURM_NTASKS", how)
    if world_size > 1 and not (os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID")):
        # the batch script (or an salloc shell) sees the job's task count but is one process:
        # joining would wait for tasks that never come
        raise DistInitError(
            f"SLURM_STEP_ID is not set: this is the batch script or an salloc shell, not one of "
            f"the {world_size} tasks; start this with srun inside a SLURM allocation, "
            f"or use --launcher none"
        )
    local_rank = _int_var("SLURM_LOCALID", how)
    hosts = expand_nodelist(
        os.environ.get("SLURM_STEP_NODELIST") or _require("SLURM_NODELIST", how)
    )
    per_node_spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get(
        "SLURM_TASKS_PER_NODE"
    )
    tasks_per_node = expand_tasks_per_node(per_node_spec) if per_node_spec else []
    if os.environ.get("SLURM_NTASKS_PER_NODE", "").isdigit() and not tasks_per_node:
        tasks_per_node = [int(os.environ["SLURM_NTASKS_PER_NODE"])] * len(hosts)
    node_id = os.environ.get("SLURM_NODEID")
    if node_id is not None and node_id.isdigit() and int(node_id) < len(tasks_per_node):
        # global rank = tasks on the nodes before this one + local rank (block layout)
        node = int(node_id)
        rank = sum(tasks_per_node[:node]) + local_rank
        local_world_size = tasks_per_node[node]
    else:
        rank = _int_var("SLURM_PROCID", how)
        local_world_size = tasks_per_node[0] if tasks_per_node else world_size
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=os.environ.get("MASTER_ADDR") or hosts[0],
        master_port=slurm_port(port),
    )


def _mpi_master_addr(local_world_size: int, world_size: int) -> str:
    """MASTER_ADDR, else loopback for a one-node job, else rank 0's host name via mpi4py."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    if local_world_size == world_size:
        return "127.0.0.1"
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError):
        raise DistInitError(
            "MASTER_ADDR is not set and the job spans several nodes: export MASTER_ADDR "
            "(e.g. mpirun -x MASTER_ADDR=<first host>) or install mpi4py"
        ) from None
    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def mpi_env(port: int | str | None = None, **_: Any) -> LaunchEnv:
    """Read Open MPI's (OMPI_COMM_WORLD_*) or MPICH / Intel MPI's (PMI_*) variables."""
    how = "start this with mpirun"
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        rank = _int_var("OMPI_COMM_WORLD_RANK", how)
        world_size = _int_var("OMPI_COMM_WORLD_SIZE", how)
        local_rank = _optional_int("OMPI_COMM_WORLD_LOCAL_RANK", rank)
        local_world_size = _optional_int("OMPI_COMM_WORLD_LOCAL_SIZE", world_size)
    elif "PMI_RANK" in os.environ:
        rank = _int_var("PMI_RANK", how)
        world_size = _int_var("PMI_SIZE", how)
        local_rank = _optional_int("MPI_LOCALRANKID", rank)
        local_world_size = _optional_int("MPI_LOCALNRANKS", world_size)
    else:
        raise DistInitError(
            "OMPI_COMM_WORLD_RANK (Open MPI) or PMI_RANK (MPICH, Intel MPI) is not set: "
            "start this with mpirun, or use --launcher none"
        )
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=_mpi_master_addr(local_world_size, world_size),
        master_port=_port(port, DEFAULT_PORT),
    )


_LAUNCHER_ENVS = {"pytorch": pytorch_env, "slurm": slurm_env, "mpi": mpi_env}

# The variables in which each launcher announces the world size and this process's rank, as
# the readers above take them (the first one set counts: Open MPI's before MPICH's).
WORLD_SIZE_VARS = {"pytorch": ("WORLD_SIZE",), "slurm": ("SLURM_NTASKS",),
                   "mpi": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")}
RANK_VARS = {"pytorch": ("RANK",), "slurm": ("SLURM_PROCID",),
             "mpi": ("OMPI_COMM_WORLD_RANK", "PMI_RANK")}


def _first_int(names: tuple[str, ...]) -> tuple[int, str] | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value), name
    return None


def announced_world_size(launcher: str) -> tuple[int, str] | None:
    """The world size ``launcher``'s variables announce and the variable that says it (None
    when none is set, or for launcher 'none'). Unlike ``launch_env`` this checks nothing else and
    never asks MPI: what a dry run can show."""
    return _first_int(WORLD_SIZE_VARS.get(launcher, ()))


def announced_rank(launcher: str) -> int | None:
    """This process's rank as ``launcher``'s variables announce it (None when they do not)."""
    found = _first_int(RANK_VARS.get(launcher, ()))
    return None if found is None else found[0]


def launch_env(launcher: str, **kwargs: Any) -> LaunchEnv:
    """What ``launcher``'s variables say about this process, read without joining anything.

    Raises DistInitError naming a missing or malformed variable and how to start the job.
    (For a multi-node mpirun job without MASTER_ADDR this asks rank 0's host name over MPI.)
    """
    if launcher not in _LAUNCHER_ENVS:
        raise ValueError(f"launcher must be one of {', '.join(_LAUNCHER_ENVS)}; got {launcher!r}")
    return _LAUNCHER_ENVS[launcher](**kwargs)


_joined_as: list[str] = []  # the launcher `init_dist` joined the group as, once it has


def infer_launcher() -> str:
    """The launcher that started this process, as its environment variables tell.

    Once ``init_dist`` has joined the group, the launcher it joined as (every launcher exports
    torchrun's variables then).

    Returns:
        'pytorch' under torchrun, 'slurm' inside an srun step of more than one task, 'mpi'
        under mpirun (Open MPI, MPICH or Intel MPI), else 'none'.
    """
    if _joined_as:  # every launcher exports torchrun's variables on joining
        return _joined_as[-1]
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return "pytorch"
    # Open MPI before SLURM: mpirun inside an allocation starts its daemons with srun, so its
    # ranks also carry SLURM_STEP_ID (one task per node) and would pass for an srun step
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "mpi"
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    if ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and tasks.isdigit() and int(tasks) > 1:
        return "slurm"
    if "PMI_SIZE" in env:
        return "mpi"
    return "none"


def resolve_backend(backend: str) -> str:
    """Check ``backend`` and turn 'auto' into nccl (CUDA available) or gloo."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and torch_dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend 'nccl' needs CUDA, but no CUDA device is available here: "
            "use backend 'gloo' (or 'auto') on CPU"
        )
    if backend == "mpi" and not torch_dist.is_mpi_available():
        raise ValueError(
            "backend 'mpi' needs a torch built with MPI, and this one is not: "
            "use backend 'gloo' (the mpi launcher works with any backend)"
        )
    return backend


def _export(env: LaunchEnv) -> None:
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.local_world_size),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )


def check_ranks(expected_world_size: int) -> None:
    """Raise unless every rank agrees on the world size and the ranks are 0..N-1 once each."""
    world_size = torch_dist.get_world_size()
    mine = torch.tensor([torch_dist.get_rank(), expected_world_size], dtype=torch.int64)
    if torch_dist.get_backend() == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    with named_operation("the rank check after joining the group"):
        torch_dist.all_gather(gathered, mine)
    ranks = [int(t[0]) for t in gathered]
    sizes = [int(t[1]) for t in gathered]
    if len(set(sizes)) != 1 or sizes[0] != world_size:
        raise DistInitError(
            f"ranks disagree on the world size: the group has {world_size} processes but "
            f"they were told {sizes} (by rank); check the launcher's task counts"
        )
    if sum(ranks) != world_size * (world_size - 1) // 2 or sorted(ranks) != list(range(world_size)):
        raise DistInitError(
            f"ranks are not 0..{world_size - 1} once each: got {sorted(ranks)}, "
            f"sum {sum(ranks)} instead of {world_size * (world_size - 1) // 2}"
        )


def init_dist(
    launcher: str,
    backend: str = "nccl",
    *,
    timeout: float | datetime.timedelta | None = None,
    **kwargs: Any,
) -> None:
    """Join the default process group as ``launcher`` describes this process.

    Each launcher's variables say where this process sits in the job:

    - pytorch reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
      ``MASTER_ADDR`` and ``MASTER_PORT``, as torchrun (and ``accelerate launch``) sets them.
    - slurm reads ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
      ``SLURM_NTASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE`` and ``SLURM_NODELIST`` (the
      step's own variables first, where srun sets them). The master is ``MASTER_ADDR`` if
      set, else the first host of the node list (compressed lists such as
      ``gpu[01-04,07],cpu3`` are expanded without ``scontrol``); its port is the ``port``
      argument, else ``MASTER_PORT``, else one derived from ``SLURM_JOB_ID`` (so two jobs
      sharing a node do not collide), else 29500. The global rank is the number of tasks on
      the nodes before this one plus the local rank (``SLURM_PROCID`` where ``SLURM_NODEID``
      does not tell the node).
    - mpi reads Open MPI's ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
      ``OMPI_COMM_WORLD_LOCAL_RANK`` and ``OMPI_COMM_WORLD_LOCAL_SIZE``, or MPICH and Intel
      MPI's ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID`` and ``MPI_LOCALNRANKS``. The
      master is ``MASTER_ADDR`` if set, else 127.0.0.1 for a one-node job, else rank 0's
      host (asked over mpi4py); its port is the ``port`` argument, else ``MASTER_PORT``, else
      29500.

    Every launcher then exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (and ``MASTER_ADDR``, ``MASTER_PORT``), so code that reads
    torchrun's variables finds the right device under any launcher. With nccl the CUDA device
    is set to the local rank. After joining, the ranks check the group: every rank must agree
    on the world size N, and the ranks must be 0..N-1 once each (their sum N(N-1)/2). A
    process that has left its group (``leave_dist``) may join again, as a second runner
    does: each group of the process keeps its keys apart in the job's store.

    Args:
        launcher: 'pytorch' (torchrun), 'slurm' (srun) or 'mpi' (mpirun).
        backend: 'nccl', 'gloo', 'mpi', or 'auto' (nccl when CUDA is available, else gloo).
        timeout: seconds or a timedelta that every collective may take; None: 30 minutes.
        **kwargs: ``port`` for slurm and mpi; the rest goes to torch's
            ``init_process_group``.

    Raises:
        ValueError: when ``launcher`` or ``backend`` is none of the above, nccl is asked for
            without CUDA or mpi of a torch built without MPI, ``timeout`` is not a positive
            number of seconds or timedelta, or the port is not a number from 1 to 65535.
        DistInitError: when this process has already joined a group; when a launcher variable
            is missing or not a whole number, naming it and how to start the job (``RANK is
            not set: start this with torchrun, or use --launcher none``), never a hang or a
            KeyError; or when the ranks disagree after joining, naming on what.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    backend = resolve_backend(backend)
    timeout = to_timedelta(timeout)
    if is_distributed():
        raise DistInitError("the default process group is already initialised in this process")
    env = launch_env(launcher, **kwargs)
    kwargs.pop("port", None)
    _export(env)
    _joined_as[:] = [launcher]
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    set_timeout(timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    _joins.append(launcher)
    if "store" not in kwargs and "init_method" not in kwargs and backend != "mpi" and (
            launcher == "pytorch" and restart is not None or len(_joins) > 1):
        kwargs["store"] = _job_store(env, restart, len(_joins), timeout)
    else:
        kwargs.setdefault("init_method",
                          f"tcp://{_host_for_url(env.master_addr)}:{env.master_port}")
    torch_dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                  timeout=timeout, **kwargs)
    if not _kept_stores:  # its server (on rank 0) serves this process's later groups too
        _kept_stores.append(torch_dist.distributed_c10d._get_default_store())
    check_ranks(env.world_size)


def leave_dist() -> None:
    """Leave the default process group, if this process joined one.

    Call it before the interpreter shuts down: unreachable objects still holding a finished
    collective's tensors are collected first, while Python runs, because a gloo thread that
    frees them after shutdown has begun aborts the process ('terminate called without an
    active exception'; 8 of 20 runs of tools/dist_demo.py under torchrun without the
    collection, 0 of 20 with it). A no-op when not distributed.
    """
    if not is_distributed():
        return
    gc.collect()
    torch_dist.destroy_process_group()


_joins: list[str] = []  # every group `init_dist` joined in this process, by launcher
_kept_stores: list[torch_dist.Store] = []  # the first group's store, kept for the later ones


def _job_store(env: LaunchEnv, attempt: str | None, join: int, timeout: datetime.timedelta
               ) -> torch_dist.Store:
    """The job's store for torchrun's ``attempt`` (its restart count; None: not torchrun)
    and this process's ``join``-th group, under a prefix of their own. torchrun (static
    rendezvous) keeps one store across restarts, where the workers of an earlier attempt
    left their addresses, and a restarted worker could read one of those and fail to connect
    to a process that is gone; an earlier group of this process (a second ``Runner`` after a
    first) left its addresses in the same store. Rank 0 serves the store unless torchrun's
    agent does; the server of this process's first group is kept (``_kept_stores``) and
    serves the later groups, so no rank can reach a server that is about to close."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = torch_dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                                is_master=env.rank == 0 and not agent_hosts, timeout=timeout,
                                multi_tenant=True)
    prefix = "trainrun" if attempt is None else f"trainrun/attempt_{attempt}"
    return torch_dist.PrefixStore(prefix if join == 1 else f"{prefix}/join_{join}", store)


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def init_local_group(node_rank: int, num_gpus_per_node: int) -> None:
    """Build one group per node (ranks ``node * n`` to ``node * n + n - 1``) and keep this node's.

    Every rank takes part in creating every node's group, as torch requires, so this works
    across any number of nodes; every rank must call it. ``get_local_group`` then returns this
    node's group. A no-op when not distributed.

    Args:
        node_rank: this node's index, from 0.
        num_gpus_per_node: n, the number of ranks on each node (the same on every node).

    Raises:
        ValueError: when ``num_gpus_per_node`` is not positive or does not divide the world
            size, or ``node_rank`` is not below the number of nodes.
    """
    if not is_distributed():
        return
    world_size = get_world_size()
    if num_gpus_per_node <= 0 or world_size % num_gpus_per_node:
        raise ValueError(
            f"num_gpus_per_node={num_gpus_per_node} must be positive and divide the world "
            f"size {world_size}"
        )
    num_nodes = world_size // num_gpus_per_node
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank={node_rank} must be in 0..{num_nodes - 1}")
    local = None
    for node in range(num_nodes):
        ranks = list(range(node * num_gpus_per_node, (node + 1) * num_gpus_per_node))
        group = torch_dist.new_group(ranks)
        if node == node_rank:
            local = group
    _set_local_group(local)

"""Processes and communication: joining the job, who is who, and collectives.

Everything works in a process that never joined a process group (rank 0 of a world of 1).
This package imports nothing else of trainrun.
"""

from trainrun.dist.backends import (
    DIST_BACKENDS,
    BaseDistBackend,
    get_dist_backend,
    set_default_dist_backend,
)
from trainrun.dist.collectives import (
    REDUCE_OPS,
    Handle,
    all_gather,
    all_reduce,
    all_reduce_dict,
    all_reduce_params,
    broadcast,
    gather,
    gather_rows,
    reduce,
    sync_random_seed,
)
from trainrun.dist.device import cast_data_device, get_comm_device, get_data_device, get_device
from trainrun.dist.finish import end_within, finish_together
from trainrun.dist.heartbeat import (
    PeerFailure,
    at_checkpoint,
    at_step,
    before_process_end,
    is_comm_error,
    phase,
    report_place,
    set_phase,
    watch_ranks,
)
from trainrun.dist.info import (
    barrier,
    get_backend,
    get_default_group,
    get_dist_info,
    get_local_group,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
    master_only,
)
from trainrun.dist.launch import (
    BACKENDS,
    LAUNCHERS,
    DistInitError,
    infer_launcher,
    init_dist,
    init_local_group,
    leave_dist,
)
from trainrun.dist.objects import (
    all_gather_object,
    broadcast_object_list,
    collect_results,
    collect_results_cpu,
    collect_results_gpu,
    gather_object,
)
from trainrun.dist.slurm import expand_nodelist
from trainrun.dist.timeouts import DistTimeoutError

__all__ = [
    "BACKENDS", "DIST_BACKENDS", "LAUNCHERS", "REDUCE_OPS",
    "BaseDistBackend", "DistInitError", "DistTimeoutError", "Handle", "PeerFailure",
    "all_gather", "all_gather_object", "all_reduce", "all_reduce_dict", "all_reduce_params",
    "at_checkpoint", "at_step", "before_process_end",
    "barrier", "broadcast", "broadcast_object_list", "cast_data_device", "collect_results",
    "end_within", "finish_together",
    "collect_results_cpu", "collect_results_gpu", "expand_nodelist", "gather", "gather_object",
    "gather_rows", "get_backend", "get_comm_device", "get_data_device", "get_default_group",
    "get_device", "get_dist_backend", "get_dist_info", "get_local_group", "get_local_rank",
    "get_local_size", "get_rank", "get_world_size", "infer_launcher", "init_dist",
    "init_local_group", "is_comm_error", "is_distributed", "is_main_process", "leave_dist",
    "master_only", "phase", "reduce", "report_place", "set_default_dist_backend", "set_phase",
    "sync_random_seed", "watch_ranks",
]

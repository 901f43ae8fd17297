"""Ends training at a step boundary when a stop signal arrived (see
`trainrun.runner.preemption`): a checkpoint, a requeue under SLURM, then `Preempted`."""

from __future__ import annotations

from typing import Any

from trainrun.dist import broadcast_object_list, is_main_process
from trainrun.runner.hooks.base import PREEMPTION, Hook
from trainrun.runner.logging import get_logger
from trainrun.runner.preemption import Preempted, requeue_slurm_job


class PreemptionHook(Hook):
    priority = PREEMPTION  # see hooks/base.py for the order

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        request = getattr(runner, "stop_request", None)
        if request is None:
            return
        signal_name = request.agreed()
        if signal_name is None or runner.train_done():
            return  # at the last step the run ends (and saves) by itself
        logger = get_logger()
        logger.warning("%s received: saving a checkpoint after step %d, then stopping",
                       signal_name, runner.iter)
        runner.checkpoints.finish()  # a background save of this very step may be running
        path = runner.checkpoints.last_saved
        if path is None or path.stem != runner.checkpoint_tag():
            path = runner.save_checkpoint()
        if path is None:  # the guard kept it from being written: the newest good one stands
            published = runner.checkpoints.published
            path = published[0] if published is not None else None
        requeue = [requeue_slurm_job() if is_main_process() else (False, None)]
        broadcast_object_list(requeue)
        raise Preempted(runner.iter, signal_name, path.name if path is not None else "none",
                        *requeue[0])

"""What the runner does when training or testing fails on a rank.

A failure of this rank's own is logged with the rank and the step and told to the other ranks
(through the heartbeat, which explains it to them); a failed collective is explained in the
heartbeat's words (another rank failed or went silent) as a `PeerFailure`. A stop every rank
makes at the same step (a stop signal, the guard's) is told to no one. Every hook's
``on_error`` runs before the failure goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from trainrun.dist import PeerFailure, is_comm_error
from trainrun.dist.heartbeat import Heartbeat, error_sentence, is_connection_lost
from trainrun.runner.hooks.guard import GuardStop
from trainrun.runner.preemption import Preempted

if TYPE_CHECKING:
    from trainrun.runner.runner import Runner


@contextmanager
def training_failures(runner: Runner, heartbeat: Heartbeat | None) -> Iterator[None]:
    """Around the training loop: a failure is logged with the rank and the step, the other
    ranks are told, and every hook's ``on_error`` runs before it is raised again; a stop
    signal (`Preempted`) and Ctrl-C only run the hooks' ``on_error``.

    Args:
        runner: the runner training.
        heartbeat: the job's heartbeat (`watch_ranks`), or None in a single process.
    """
    try:
        yield
    except Preempted as stop:
        hooks_on_error(runner, stop)
        raise
    except GuardStop as stop:  # every rank stops at the same step: nothing to tell
        hooks_on_error(runner, stop)
        raise
    except BaseException as error:
        if isinstance(error, Exception):
            runner.failed_at_step = runner.iter + 1
            try:
                tell_peers(error, heartbeat)
            finally:
                hooks_on_error(runner, error)
            runner.logger.exception("rank %d: training failed at step %d (epoch %d)",
                                    runner.rank, runner.iter + 1, runner.epoch + 1)
        else:  # Ctrl-C and the like
            hooks_on_error(runner, error)
        raise


@contextmanager
def failures_told(heartbeat: Heartbeat | None) -> Iterator[None]:
    """Around a loop outside training (testing): a failure is told to the other ranks, and
    a failed collective explained (`tell_peers`), before it goes on."""
    try:
        yield
    except Exception as error:
        tell_peers(error, heartbeat)
        raise


def hooks_on_error(runner: Runner, error: BaseException) -> None:
    """Every hook's ``on_error``; one that fails itself is logged, not raised: ``error`` is
    what the user needs to see."""
    for hook in runner.hooks:
        try:
            if hasattr(hook, "on_error"):
                hook.on_error(runner, error)
        except Exception:
            runner.logger.exception("%s.on_error failed", type(hook).__name__)


def tell_peers(error: Exception, heartbeat: Heartbeat | None) -> None:
    """For a failed collective, raise `PeerFailure` saying why in the heartbeat's words
    (another rank failed or went silent); for a failure of this rank's own, tell the other
    ranks and return (the caller re-raises it)."""
    if heartbeat is None:
        return
    if not is_comm_error(error):
        heartbeat.post_failure(error)
        return
    try:
        why = PeerFailure(heartbeat.explain())
    except Exception as store_error:  # the store's host (rank 0 or the launcher) is gone
        why = PeerFailure(heartbeat.lost_contact(
            f"lost contact with the other ranks ({error_sentence(error)}) and with the job's store "
            f"at {heartbeat.address} ({error_sentence(store_error)})"), said=False)
        if not is_connection_lost(store_error):  # unreachable, not gone: the agent blocks too
            heartbeat.end_agent_at_exit()
    raise why from error

"""The runner's stateful parts, as a checkpoint's train state holds them.

`train_state` lists them for ``trainrun.checkpoint.train_state.TrainState``: the position,
the optimiser wrapper, the schedulers, the sampler, a stream, the hooks and the RNG states,
each with how its state is taken on this rank and how it is put back on resuming.
`resume_run` puts a run back from a checkpoint, `roll_back` from its newest one when the guard
asks; `check_strategy_change` refuses, before anything is written, a checkpoint this run's
strategy cannot carry on from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainrun.checkpoint.optimizer_state import OptimizerMismatch, another_type
from trainrun.checkpoint.train_state import HookStates, StatePart, TrainState
from trainrun.dist import at_checkpoint
from trainrun.runner.hooks.guard import Event, GuardStop
from trainrun.runner.sampler import ResumableSampler
from trainrun.runner.schema import ConfigError
from trainrun.runner.seed import rng_state, set_rng_state
from trainrun.runner.stream import is_stream

if TYPE_CHECKING:
    from trainrun.runner.runner import Runner


def train_state(runner: Runner) -> TrainState:
    """The train state of ``runner``: everything but model and optimiser that an exact resume
    needs, from its stateful parts in the order a resume puts them back (the RNG states last,
    so that nothing put back before them draws from them). Rank 0's copy holds every rank's
    RNG states and optimiser-wrapper states (the latter carry each rank's own accumulated
    gradients between steps), which its ``state_dict`` gathers: every rank must call that.

    Args:
        runner: the runner, built.

    Returns:
        Its train state (``state_dict`` to save it, ``load_state_dict`` to resume it).
    """
    parts = _RunnerParts(runner)
    loader = runner.train_dataloader
    listed = [StatePart("meta", parts.position, parts.load_position),
              StatePart("optim_wrapper", runner.optim_wrapper.state_dict,
                        parts.load_optim_wrapper, every_rank=True),
              StatePart("schedulers", parts.schedulers, parts.load_schedulers),
              StatePart("sampler", parts.sampler, parts.load_sampler)]
    if is_stream(loader):  # its place: every rank's (each reads its own share)
        listed.append(StatePart("stream", loader.state_dict, parts.load_stream,
                                every_rank=True))
    listed.append(HookStates(runner.hooks, runner.rank, runner.world_size).part())
    listed.append(StatePart("rng", rng_state, parts.load_rng_states, every_rank=True))
    return TrainState(listed)


def resume_run(runner: Runner, path: Path, mark: dict[str, Any] | None = None) -> None:
    """Put ``runner`` back where the checkpoint at ``path`` (verified) stopped: model,
    optimiser and train state. Rank 0 first removes what a save the stopped run did not
    finish left (the run directory is locked: nothing else writes there), and then takes out
    of ``metrics.jsonl`` the lines that the steps after the checkpoint logged, and marks the
    resume there. Every rank must call this.

    Args:
        runner: the runner, built.
        path: the checkpoint, verified (a file, or a directory for sharded strategies).
        mark: a rollback's (`roll_back`): the record that ends ``metrics.jsonl``, in
            place of the resume's and of its log line; None: a resume.

    Raises:
        ConfigError: its optimiser state does not fit this run's optimiser.
    """
    runner.checkpoints.clean_partial()  # a save the stopped run did not finish: room back
    try:
        state = runner.strategy.load_checkpoint(str(path), runner.model, runner.optimizer)
    except OptimizerMismatch as error:
        raise ConfigError(f"resume: {path}: {error}") from None
    wrong = another_type(runner.optimizer)
    if wrong is not None:
        raise ConfigError(f"resume: {path}: {wrong}: optim.type changed since it was written; "
                          f"resume without that change, or start a new run from its weights "
                          f"alone (load_from: {path}, in another work_dir)")
    written = (state.get("meta") or {}).get("strategy", runner.strategy.name)
    train_state(runner).load_state_dict(state)
    at_checkpoint(path.name, runner.iter)
    runner.checkpoints.published = (path, runner.iter)  # what a rollback goes back to
    if mark is None:
        runner.logger.info("resumed from %s at epoch %d, step %d%s", path, runner.epoch + 1,
                           runner.iter, "" if written == runner.strategy.name else
                           f" (written under strategy {written!r}, carried on under "
                           f"{runner.strategy.name!r})")
    if runner.metrics_file.path.exists():  # each step once: the lost steps' lines go
        dropped = runner.metrics_file.resume(runner.iter, path, mark)
        if dropped and mark is None:  # (None on the other ranks)
            runner.logger.info("%s: took out the %d line(s) logged after step %d, which this "
                               "run trains again", runner.metrics_file.path.name, dropped,
                               runner.iter)


def roll_back(runner: Runner, event: Event) -> int:
    """Put ``runner`` back where the newest checkpoint it stands on stopped, in the same
    processes, as a resume does, after ``event`` (the guard's ``rollback``; a background save
    is finished first): ``metrics.jsonl`` loses the lines of the steps after it, and a
    ``rollback`` line says why. Every rank must call this.

    Args:
        runner: the runner training.
        event: what went wrong.

    Returns:
        How many batches the training loop skips before it trains on (those the steps after
        the checkpoint trained on up to the bad one, and ``guard.skip_batches`` more).

    Raises:
        GuardStop: there is no checkpoint from before the event to go back to.
    """
    runner.checkpoints.finish()
    published = runner.checkpoints.published
    if published is None or published[1] >= event.step:
        raise GuardStop(event, None, "cannot roll back")
    path, step = published
    guard = runner.guard
    skip = guard.skip_after(event, published)
    resume_run(runner, path, mark={
        "step": step, "mode": "rollback", "event": event.kind, "name": event.name,
        "value": event.value, "at_step": event.step, "rank": event.rank,
        "checkpoint": str(path), "batches_skipped": skip, "rollbacks_in_a_row": guard.rollbacks})
    if runner.by_epoch:  # the skipped batches are steps the epochs will not have
        runner.max_iters = runner.iter + max(runner.train_loop.steps_left() - skip, 0)
    runner.optim_wrapper.set_total(runner.iter, runner.max_iters)
    if runner.rank == 0:
        runner.logger.warning("guard: rolled back to %s (step %d); skipping %d batches "
                              "(rollback %d in a row, of at most %d)", path.name, step, skip,
                              guard.rollbacks, guard.max_rollbacks)
    return skip


def check_strategy_change(runner: Runner, optim: Any) -> None:
    """Refuse a checkpoint to resume that another strategy wrote and this run's cannot carry
    on from exactly (``Strategy.resume_refusal``).

    Args:
        runner: the runner, built up to its start point (``start_from``).
        optim: the ``optim`` section (its ``accumulate`` counts), or the optimiser's factory.

    Raises:
        ConfigError: the strategy cannot carry on from it, and why.
    """
    if runner.start_from is None or runner.start_from[0] != "resume":
        return
    path = runner.start_from[1]
    accumulate = optim.get("accumulate") if isinstance(optim, Mapping) else None
    why = runner.strategy.resume_refusal(path, runner.precision, accumulate or 1)
    if why is not None:
        raise ConfigError(f"resume: {path}: {why}")


class _RunnerParts:
    """How each of the runner's own parts is saved and put back."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def position(self) -> dict[str, Any]:
        runner = self.runner
        return {"epoch": runner.epoch, "iter": runner.iter, "seed": runner.seed,
                "world_size": runner.world_size, "strategy": runner.strategy.name}

    def load_position(self, meta: Mapping[str, Any]) -> None:
        self.runner.epoch, self.runner.iter, self.runner.seed = \
            meta["epoch"], meta["iter"], meta["seed"]

    def load_optim_wrapper(self, states: Any) -> None:
        """This rank's optimiser-wrapper state (rank 0's where another number of ranks saved
        them; an older checkpoint holds one state for every rank)."""
        runner = self.runner
        if isinstance(states, Mapping):
            states = [states]
        runner.optim_wrapper.load_state_dict(states[runner.rank] if len(states)
                                             == runner.world_size else states[0])

    def schedulers(self) -> list[Any]:
        return [scheduler.state_dict() for scheduler in self.runner.schedulers]

    def load_schedulers(self, states: list[Any] | None) -> None:
        """Each scheduler's saved state; None (a checkpoint another tool wrote, which holds no
        trainrun schedule) puts each at the run's iteration, its rate set from it."""
        runner = self.runner
        if states is None:
            states = [{**scheduler.state_dict(), "last_epoch": runner.iter,
                       "_step_count": runner.iter + 1} for scheduler in runner.schedulers]
        for scheduler, saved in zip(runner.schedulers, states, strict=True):
            scheduler.load_state_dict(saved)

    def sampler(self) -> dict[str, Any] | None:
        sampler = self.runner.train_dataloader.sampler
        return sampler.state_dict() if isinstance(sampler, ResumableSampler) else None

    def load_sampler(self, state: dict[str, Any] | None) -> None:
        sampler = self.runner.train_dataloader.sampler
        if isinstance(sampler, ResumableSampler) and state:
            sampler.load_state_dict(state)
            # the epoch being trained goes on from the cursor, even one at the epoch's end (a
            # checkpoint after its last step): that epoch is then finished, not started again
            self.runner.train_loop.resume_mid_epoch = sampler.epoch == self.runner.epoch

    def load_stream(self, streams: list[Any] | None) -> None:
        """Put a stream back where this rank's share of it stopped. Saved by another number of
        ranks, the shares differ: the stream starts again, said in a warning."""
        runner = self.runner
        loader = runner.train_dataloader
        if not is_stream(loader) or streams is None:
            return
        if len(streams) == runner.world_size:
            loader.load_state_dict(streams[runner.rank])
        elif runner.rank == 0:
            runner.logger.warning("data.train: the checkpoint was written by %d ranks, this "
                                  "job has %d: each rank's share of the stream differs, so the "
                                  "stream starts again from its beginning", len(streams),
                                  runner.world_size)

    def load_rng_states(self, rngs: list[Any] | None) -> None:
        """This rank's RNG states, where the world size is the one that saved them; None (a
        checkpoint another tool wrote, which holds none): the random streams go on from this
        run's seeding."""
        runner = self.runner
        if rngs is None:
            runner.logger.info("the checkpoint holds no RNG states: random streams go on from "
                               "this run's seeding")
        elif len(rngs) == runner.world_size:
            set_rng_state(rngs[runner.rank])
        else:
            runner.logger.warning("the checkpoint was written by %d ranks, this job has %d: "
                                  "random streams restart, so losses will not match exactly",
                                  len(rngs), runner.world_size)

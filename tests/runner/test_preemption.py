"""Stop signals: SIGTERM or SIGUSR1 reaching one rank stops every rank after the same step,
with a checkpoint from which the run resumes exactly; handlers are put back afterwards. And
where a run that counts epochs goes on from such a checkpoint: the name of one inside an
epoch, and the steps left when it resumes on another number of ranks."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.records import loss_list
from trainrun.checkpoint.read import read_train_state
from trainrun.runner.preemption import (
    Preempted,
    StopRequest,
    requeue_slurm_job,
    signal_number,
    stop_signals,
)
from trainrun.runner.runner import Runner


def _runner(work_dir, *, resume=False, hooks=(), background=False, schedule=None,
            interval=5):
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                          "batch_size": 4},
        optim={"type": "AdamW", "lr": 0.01}, strategy="ddp",
        schedule=schedule or {"max_iters": 12}, randomness={"seed": 5},
        logging={"interval": 1, "backends": ["jsonl"]},
        checkpoint={"interval": interval, "async": background}, resume=resume, hooks=hooks,
    )


class SignalAt:
    """Sends ``signum`` to this process after ``step``, on ``rank`` only."""

    priority = 30  # before the preemption hook looks

    def __init__(self, step, signum, rank):
        self.step, self.signum, self.rank = step, signum, rank

    def __getattr__(self, name):
        return lambda *args: None

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        if runner.iter == self.step and runner.rank == self.rank:
            os.kill(os.getpid(), self.signum)



@contextmanager
def _agreeing_every_step():
    """The ranks agree on a stop signal after every step (not every quarter second) inside
    the block; the interval is put back however the block ends (the pool's processes run
    other tests next)."""
    saved, StopRequest.CHECK_SECONDS = StopRequest.CHECK_SECONDS, 0
    try:
        yield
    finally:
        StopRequest.CHECK_SECONDS = saved


def _preempted_body(straight, work_dir, signum, rank, background):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    with _agreeing_every_step():
        runner = _runner(straight)
        runner.train()
        runner.close()
        runner = _runner(work_dir, hooks=[SignalAt(7, signum, rank)], background=background)
        try:
            runner.train()
            stopped = None
        except Preempted as stop:
            stopped = (stop.step, stop.signal_name, stop.checkpoint, stop.requeued)
        runner.close()
        restored = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
        runner = _runner(work_dir, resume=True, background=background)
        runner.train()
        runner.close()
    return stopped, restored


@pytest.mark.parametrize(("world_size", "signum", "rank", "background"), [
    (2, signal.SIGTERM, 1, False),  # only rank 1 got it
    (2, signal.SIGUSR1, 0, True),   # sbatch --signal=USR1@60; periodic saves in the background
    (1, signal.SIGTERM, 0, False),
])
def test_a_signal_stops_every_rank_after_the_same_step_and_resumes_exactly(
        run_on, tmp_path, world_size, signum, rank, background):
    straight, work_dir = tmp_path / "straight", tmp_path / "stopped"
    results = run_on(world_size)(_preempted_body, str(straight), str(work_dir), signum, rank,
                                 background)
    name = signal.Signals(signum).name
    stop = 7
    assert [r[0] for r in results] == [(stop, name, f"iter_{stop}.pth", False)] * world_size
    assert all(restored for _, restored in results)
    checkpoints = work_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted([  # max_keep 3
        *(f"iter_{step}.pth{hashes}" for step in (10, 12, stop) for hashes in ("", ".sha256")),
        "last"])
    logged, expected = loss_list(work_dir), dict(loss_list(straight))
    assert [step for step, _ in logged] == [*range(1, stop + 1), *range(stop + 1, 13)]
    assert all(loss == expected[step] for step, loss in logged)  # bit for bit


def _preempted_by_epoch_body(work_dir):
    """A run of 3 epochs of 8 steps, a checkpoint at each epoch's end, stopped by SIGTERM
    after step 11 (inside epoch 2), then resumed: the stop's checkpoint name, and the
    checkpoints there after the stop, the step epoch 1's holds, and the checkpoints at the
    end."""
    schedule = {"max_epochs": 3}
    with _agreeing_every_step():
        runner = _runner(work_dir, hooks=[SignalAt(11, signal.SIGTERM, 0)], schedule=schedule,
                         interval=1)
        with pytest.raises(Preempted) as stop:
            runner.train()
        runner.close()
    stopped = stop.value.checkpoint
    checkpoints = Path(work_dir) / "checkpoints"
    after_stop = sorted(p.name for p in checkpoints.iterdir())
    epoch_end = read_train_state(checkpoints / "epoch_1.pth")["meta"]["iter"]
    runner = _runner(work_dir, resume=True, schedule=schedule, interval=1)
    runner.train()
    runner.close()
    return stopped, after_stop, epoch_end, sorted(p.name for p in checkpoints.iterdir())


def test_a_signal_inside_an_epoch_keeps_the_checkpoint_of_the_epochs_end(run_on, tmp_path):
    """Counting epochs, a stop after step 11 (inside epoch 2) is ``epoch_1_iter_11``: the
    checkpoint of epoch 1's end, ``epoch_1``, stays as it was (before, the stop's checkpoint
    took its name and wrote over it), and the run resumes from the stop exactly."""
    (stopped, after_stop, epoch_end, at_end), = run_on(1)(_preempted_by_epoch_body,
                                                          str(tmp_path / "run"))
    assert stopped == "epoch_1_iter_11.pth"
    assert after_stop == [*sorted(f"{name}{hashes}" for name in ("epoch_1.pth", stopped)
                                  for hashes in ("", ".sha256")), "last"]
    kept = (stopped, "epoch_2.pth", "epoch_3.pth")  # max_keep 3: epoch_1, the oldest, went
    assert at_end == [*sorted(f"{name}{hashes}" for name in kept
                              for hashes in ("", ".sha256")), "last"]
    assert epoch_end == 8
    straight = run_on(1)(_straight_by_epoch_body, str(tmp_path / "straight"))[0]
    assert loss_list(tmp_path / "run") == straight  # each step once, bit for bit


def _straight_by_epoch_body(work_dir):
    runner = _runner(work_dir, schedule={"max_epochs": 3}, interval=1)
    runner.train()
    runner.close()
    return loss_list(work_dir)


def _first_part_body(work_dir, max_epochs, stop_at):
    """Train ``max_epochs`` epochs (4 steps each on 2 ranks), stopped after step ``stop_at``
    if given; the step it ended at."""
    hooks = [SignalAt(stop_at, signal.SIGTERM, 0)] if stop_at else []
    with _agreeing_every_step():
        runner = _runner(work_dir, hooks=hooks, schedule={"max_epochs": max_epochs},
                         interval=1)
        try:
            runner.train()
        except Preempted:
            pass
        runner.close()
    return runner.iter


def _rest_body(work_dir):
    """Resume in 1 process (8 steps an epoch) up to 2 epochs: its planned last step, the step
    it ended at, and the steps it logged."""
    runner = _runner(work_dir, resume=True, schedule={"max_epochs": 2}, interval=1)
    runner.train()
    runner.close()
    return runner.max_iters, runner.iter, [step for step, _ in loss_list(work_dir)]


@pytest.mark.parametrize(("max_epochs", "stop_at", "planned"), [
    (1, None, 4 + 8),  # at epoch 1's end: epoch 2 at 8 steps
    (2, 3, 3 + 2 + 8),  # after step 3 of 4, 24 of the 32 samples: 8 left are 2 steps here
], ids=["at an epoch's end", "inside an epoch"])
def test_a_run_resumed_on_another_number_of_ranks_counts_the_steps_it_has_left(
        run_on, tmp_path, max_epochs, stop_at, planned):
    """The steps of an epoch depend on the number of ranks: a run that counts epochs, resumed
    on 1 process from 2's checkpoint, plans (and shows, "step N/total") the steps it has
    left at 1 process, and trains them all. Before, it planned 2 epochs of 8 steps from
    step 0 and showed "training done: step 12/16"."""
    work_dir = str(tmp_path / "run")
    assert run_on(2)(_first_part_body, work_dir, max_epochs, stop_at) == [stop_at or 4] * 2
    total, ended, logged = run_on(1)(_rest_body, work_dir)[0]
    assert total == ended == planned
    assert logged == list(range(1, planned + 1))


class _Clock:
    """A clock that only moves when told: steps of a known length on a loaded machine too."""

    now = 100.0

    def monotonic(self) -> float:
        return self.now


def _agree_body(rank_with_signal):
    import trainrun.dist as dist
    from trainrun.runner import preemption

    clock, real = _Clock(), preemption.time
    preemption.time = clock
    try:
        with stop_signals() as request:
            if dist.get_rank() == rank_with_signal:
                request.handler(signal.SIGTERM, None)
            answers = []
            for _ in range(40):
                answers.append(request.agreed())
                clock.now += 0.02  # steps of 20 ms: the ranks agree every 12 steps (0.24 s)
            return answers
    finally:
        preemption.time = real


def test_ranks_agree_on_the_same_steps_about_every_quarter_second(run_on):
    results = run_on(3)(_agree_body, 2)
    assert results[0] == results[1] == results[2]
    agreed_at = [i for i, answer in enumerate(results[0]) if answer == "SIGTERM"]
    assert agreed_at[:2] == [0, 1]  # the first two boundaries, then the step time is known
    assert agreed_at[1:] == [1, 13, 25, 37], agreed_at  # int(0.25 s / 20 ms) steps apart


def test_the_handler_only_records_and_the_previous_handler_comes_back():
    previous = signal.getsignal(signal.SIGUSR1)
    with stop_signals() as request:
        assert request.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.signum == signal.SIGUSR1
        assert request.agreed() == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert StopRequest().agreed() is None


def test_after_a_requeue_the_stop_signals_are_ignored_until_the_process_ends():
    """SLURM cancels a requeued job's tasks with SIGTERM: the process that requeued it must
    live on to close the run and say why it stopped (in the CI, SIGTERM killed it first)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        for requeued in (False, True):
            with pytest.raises(Preempted), stop_signals(["SIGUSR2"]):
                raise Preempted(3, "SIGUSR2", "iter_3.pth", requeued)
            now = {s: signal.getsignal(s) for s in before}
            if requeued:  # SIGTERM too, though it is not among the stop signals here
                assert now == {**before, signal.SIGTERM: signal.SIG_IGN,
                               signal.SIGUSR2: signal.SIG_IGN}
            else:
                assert now == before
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_requeue_needs_a_slurm_job_and_says_why_one_is_not_requeued(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert requeue_slurm_job() == (False, None)
    # a job, but no scontrol (a container): not requeued, saying so
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    assert requeue_slurm_job() == (False, "scontrol is not installed here, as in many "
                                          "containers")
    stop = Preempted(12, "SIGTERM", "iter_12.pth", *requeue_slurm_job())
    assert str(stop) == ("stopped by SIGTERM after step 12; checkpoint iter_12.pth written; "
                         "this SLURM job could not requeue itself (scontrol is not installed "
                         "here, as in many containers): submit it again, or run the same "
                         "command with --resume to continue from it")
    # an scontrol that refuses: not requeued, with the refusal
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\n"
                    "echo 'Requested operation not supported on this job' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{path}")
    assert requeue_slurm_job() == (False, "scontrol requeue 41 refused: Requested operation "
                                          "not supported on this job")
    assert (tmp_path / "args").read_text().split() == ["requeue", "41"]
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    fake.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\nexit 0\n")
    assert requeue_slurm_job() == (True, None)
    assert (tmp_path / "args").read_text().split() == ["requeue", "40_3"]
    assert str(Preempted(3, "SIGUSR1", "iter_3.pth", True)).endswith("; the job is requeued")
    assert str(Preempted(3, "SIGUSR1", "iter_3.pth", False)).endswith(
        "written; run the same command with --resume to continue from it")


def test_the_signals_that_stop_training_are_chosen_by_name():
    previous, term = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    with stop_signals(["usr2", "SIGHUP"]) as request:
        assert signal.getsignal(signal.SIGTERM) is term  # not among them: left alone
        os.kill(os.getpid(), signal.SIGUSR2)
        assert request.agreed() == "SIGUSR2"
    assert signal.getsignal(signal.SIGUSR2) is previous
    for name, says in (("KILL", "cannot be caught"), ("SIGFOO", "is not a signal")):
        with pytest.raises(ValueError, match=says):
            signal_number(name)

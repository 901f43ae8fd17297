"""CheckpointManager: temporary names, `last` written last, pruning, and crashes during a
save that leave the previous checkpoint in charge (and a later resume using it); crafted
checkpoint files refused by every loading path of the runner."""

from __future__ import annotations

import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import trainrun.dist as dist
from tests.limits import files_limited_to
from tests.records import loss_list, records
from tests.runner.toy import (
    CrashAfter,
    Killed,
    ToyModel,
    flip_byte,
    newest,
    rehash,
    write_crafted_checkpoint,
)
from trainrun.checkpoint import manager as manager_module
from trainrun.checkpoint import manifest
from trainrun.checkpoint.format import load_state_file
from trainrun.checkpoint.manager import CheckpointManager, CheckpointNotWritten
from trainrun.checkpoint.manifest import verify_checkpoint
from trainrun.runner.config import ConfigError
from trainrun.runner.runner import Runner
from trainrun.wrappers import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

CPU = torch.device("cpu")


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def hashed(*names: str) -> list[str]:
    """One-file checkpoints as a listing shows them: each with its sidecar manifest."""
    return sorted(n for name in names for n in (name, name + ".sha256"))


def last_names(directory: Path) -> str:
    return (directory / "last").read_text().strip()


def _manager(tmp_path, max_keep=3, strategy=None):
    strategy = strategy or SingleDeviceStrategy()
    model, optimizer = strategy.setup(ToyModel(), CPU,
                                      lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    return CheckpointManager(tmp_path / "checkpoints", strategy, max_keep), model, optimizer


# ---------------------------------------------------------------- publishing and pruning


def test_save_writes_under_a_temporary_name_then_publishes(tmp_path, monkeypatch):
    manager, model, optimizer = _manager(tmp_path)
    written, renamed = [], []
    strategy_save = manager.strategy.save_checkpoint

    def spy_save(path, *args):
        written.append(Path(path).name)
        assert not (manager.directory / "iter_1.pth").exists()  # invisible while written
        strategy_save(path, *args)

    real_replace = os.replace

    def spy_replace(src, dst):
        renamed.append((Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(manager.strategy, "save_checkpoint", spy_save)
    monkeypatch.setattr(manager_module.os, "replace", spy_replace)
    path = manager.save("iter_1", model, optimizer, {"meta": {"iter": 1}})
    assert path == manager.directory / "iter_1.pth"
    assert written == [".tmp-iter_1.pth"]
    assert renamed == [(".tmp-iter_1.pth.sha256", "iter_1.pth.sha256"),  # its manifest first
                       (".tmp-iter_1.pth", "iter_1.pth"), (".tmp-last", "last")]  # last, last
    assert listing(manager.directory) == [*hashed("iter_1.pth"), "last"]
    assert last_names(manager.directory) == "iter_1.pth"
    assert load_state_file(str(path))["meta"] == {"iter": 1}
    assert newest(manager) == path


def test_max_keep_prunes_the_oldest_by_step_number(tmp_path):
    manager, model, optimizer = _manager(tmp_path, max_keep=2)
    for epoch in (8, 9, 10, 11):
        manager.save(f"epoch_{epoch}", model, optimizer, {})
    assert listing(manager.directory) == [*hashed("epoch_10.pth", "epoch_11.pth"), "last"]
    assert last_names(manager.directory) == "epoch_11.pth"


def test_a_stop_inside_an_epoch_is_ordered_between_the_epochs_ends(tmp_path):
    """``epoch_1_iter_11`` (a stop signal's, inside epoch 2) comes after ``epoch_1`` and
    before ``epoch_2``: in pruning, and in the order resume falls back in."""
    manager, model, optimizer = _manager(tmp_path, max_keep=3)
    for name in ("epoch_1", "epoch_1_iter_11"):
        manager.save(name, model, optimizer, {})
    assert manager_module.newest_first(manager.directory) == [
        manager.directory / "epoch_1_iter_11.pth", manager.directory / "epoch_1.pth"]
    for name in ("epoch_2", "epoch_3"):
        manager.save(name, model, optimizer, {})
    assert listing(manager.directory) == [
        *hashed("epoch_1_iter_11.pth", "epoch_2.pth", "epoch_3.pth"), "last"]
    assert manager_module.newest_first(manager.directory)[1:] == [
        manager.directory / "epoch_2.pth", manager.directory / "epoch_1_iter_11.pth"]


def test_a_new_run_in_an_older_runs_directory_keeps_its_own_checkpoint(tmp_path):
    """The older run's checkpoints have higher steps; pruning must not remove the new one,
    which ``last`` names (it did: ``last`` then named a file that was gone)."""
    older, model, optimizer = _manager(tmp_path, max_keep=2)
    for epoch in (10, 15, 20):
        older.save(f"epoch_{epoch}", model, optimizer, {})
    newer, model, optimizer = _manager(tmp_path, max_keep=2)
    newer.save("epoch_2", model, optimizer, {})
    assert listing(newer.directory) == [*hashed("epoch_2.pth", "epoch_20.pth"), "last"]
    assert newest(newer) == newer.directory / "epoch_2.pth"


def test_best_checkpoints_are_not_pruned_and_do_not_move_last(tmp_path):
    manager, model, optimizer = _manager(tmp_path, max_keep=1)
    manager.save("iter_1", model, optimizer, {})
    best = manager.save("best_mse_iter_1", model, optimizer, {}, update_last=False)
    assert last_names(manager.directory) == "iter_1.pth"
    manager.save("iter_2", model, optimizer, {})
    manager.save("iter_3", model, optimizer, {})
    assert listing(manager.directory) == [*hashed("best_mse_iter_1.pth", "iter_3.pth"), "last"]
    manager.remove(best)
    assert listing(manager.directory) == [*hashed("iter_3.pth"), "last"]


@pytest.mark.parametrize(("max_keep", "kept"), [(-1, ["iter_1.pth", "iter_2.pth", "iter_3.pth"]),
                                                (0, ["iter_3.pth"])])
def test_keep_all_and_never_prune_the_newest(tmp_path, max_keep, kept):
    manager, model, optimizer = _manager(tmp_path, max_keep=max_keep)
    for step in (1, 2, 3):
        manager.save(f"iter_{step}", model, optimizer, {})
    assert listing(manager.directory) == [*hashed(*kept), "last"]
    assert newest(manager) == manager.directory / "iter_3.pth"


def test_latest_is_none_until_a_checkpoint_is_published(tmp_path):
    manager, model, optimizer = _manager(tmp_path)
    assert newest(manager) is None
    manager.directory.mkdir(parents=True)
    (manager.directory / "last").write_text("iter_9.pth\n")  # names what is not there
    assert newest(manager) is None


# ---------------------------------------------------------------- crashes


def partial_torch_save(obj, f, *args, **kwargs):
    """Writes the first bytes of a checkpoint, then 'dies'."""
    f.write(b"PK\x03\x04 half a checkpoint")
    f.flush()
    raise Killed("killed while writing")


def test_a_crash_while_writing_leaves_the_previous_checkpoint_in_charge(tmp_path, monkeypatch):
    manager, model, optimizer = _manager(tmp_path)
    first = manager.save("iter_1", model, optimizer, {"meta": {"iter": 1}})
    monkeypatch.setattr(torch, "save", partial_torch_save)
    with pytest.raises(Killed):
        manager.save("iter_2", model, optimizer, {"meta": {"iter": 2}})
    monkeypatch.undo()
    assert listing(manager.directory) == [".tmp-iter_2.pth", *hashed("iter_1.pth"), "last"]
    assert last_names(manager.directory) == "iter_1.pth"
    assert newest(manager) == first
    assert load_state_file(str(first))["meta"] == {"iter": 1}
    manager.clean_partial()
    assert listing(manager.directory) == [*hashed("iter_1.pth"), "last"]
    manager.save("iter_2", model, optimizer, {"meta": {"iter": 2}})
    assert last_names(manager.directory) == "iter_2.pth"


def test_a_crash_while_publishing_a_resave_keeps_the_old_file(tmp_path, monkeypatch):
    """Saving a name that exists (a finished run resumed and saved again) replaces it in one
    atomic rename: no moment where ``last`` names a file that is gone."""
    manager, model, optimizer = _manager(tmp_path)
    manager.save("iter_4", model, optimizer, {"meta": {"iter": 4, "copy": 1}})

    def killed_replace(src, dst):
        raise Killed("killed while renaming")

    monkeypatch.setattr(manager_module.os, "replace", killed_replace)
    with pytest.raises(Killed):
        manager.save("iter_4", model, optimizer, {"meta": {"iter": 4, "copy": 2}})
    monkeypatch.undo()
    latest = newest(manager)
    assert latest == manager.directory / "iter_4.pth"
    assert load_state_file(str(latest))["meta"] == {"iter": 4, "copy": 1}


def test_a_crash_between_the_manifest_and_its_checkpoint_leaves_no_orphan(tmp_path,
                                                                        monkeypatch):
    """A one-file checkpoint's sidecar is renamed into place before the checkpoint: a crash
    between the two leaves a sidecar of nothing, which the next save removes."""
    manager, model, optimizer = _manager(tmp_path)
    real_replace = os.replace

    def killed_at_the_checkpoint(src, dst):
        if Path(dst).name == "iter_1.pth":
            raise Killed("killed while renaming")
        real_replace(src, dst)

    monkeypatch.setattr(manager_module.os, "replace", killed_at_the_checkpoint)
    with pytest.raises(Killed):
        manager.save("iter_1", model, optimizer, {})
    monkeypatch.undo()
    assert listing(manager.directory) == [".tmp-iter_1.pth", "iter_1.pth.sha256"]
    manager.save("iter_2", model, optimizer, {})
    assert listing(manager.directory) == [*hashed("iter_2.pth"), "last"]


# ---------------------------------------------------------------- a file system that refuses


def test_a_save_the_file_system_refuses_leaves_nothing_and_says_why(tmp_path):
    """torch's writer reports the refused write as "unexpected pos", the OSError only as its
    context (a small write, as here, raises the OSError itself): the error names the OSError,
    the room left and the checkpoint still in charge, and the half-written file is gone (its
    room is back)."""
    manager, model, optimizer = _manager(tmp_path)
    first = manager.save("iter_1", model, optimizer, {"meta": {"iter": 1}})
    with files_limited_to(first.stat().st_size // 2), \
            pytest.raises(CheckpointNotWritten) as refused:
        manager.save("iter_2", model, optimizer, {"meta": {"iter": 2}})
    message = str(refused.value)
    assert message.startswith("checkpoint iter_2.pth not written: File too large ("), message
    assert f" free in {manager.directory}); iter_1.pth is still the newest" in message, message
    assert listing(manager.directory) == [*hashed("iter_1.pth"), "last"]
    assert newest(manager) == first
    manager.save("iter_2", model, optimizer, {"meta": {"iter": 2}})  # room again: it goes on
    assert last_names(manager.directory) == "iter_2.pth"


def test_a_failure_that_is_not_the_file_systems_is_raised_as_it_is(tmp_path, monkeypatch):
    manager, model, optimizer = _manager(tmp_path)

    def unpicklable(*args, **kwargs):
        raise pickle.PicklingError("cannot pickle 'generator' object")

    monkeypatch.setattr(torch, "save", unpicklable)
    with pytest.raises(pickle.PicklingError):
        manager.save("iter_1", model, optimizer, {})


REFUSED_AT = 8192  # bytes a file may hold in these tests: each rank's 34 KB part is refused


def _refused_save_body(work_dir, strategy, background):
    """On every rank: checkpoint iter_1 under ``strategy`` ('ddp' or 'fsdp'), then iter_2
    (in the background, and finished, with ``background``) with no file allowed past
    ``REFUSED_AT`` bytes; the error each rank got, and the checkpoints' directory after it.
    Rank 0's train state in fsdp's directory (about 1 KB) is not refused: a rank that
    failed alone would leave the others waiting, which the heartbeat ends in a real job."""
    strategy = FSDPStrategy() if strategy == "fsdp" else DDPStrategy()
    model, optimizer = strategy.setup(ToyModel(features=64, hidden=256), CPU,
                                      lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    manager = CheckpointManager(Path(work_dir) / "checkpoints", strategy)
    manager.save("iter_1", model, optimizer, {"meta": {"iter": 1}}, background=background)
    manager.finish()
    with files_limited_to(REFUSED_AT), pytest.raises(CheckpointNotWritten) as refused:
        manager.save("iter_2", model, optimizer, {"meta": {"iter": 2}}, background=background)
        manager.finish()
    dist.barrier()  # rank 0 removes the directory last
    return str(refused.value), listing(manager.directory)


def test_a_sharded_save_the_file_system_refuses_is_removed_on_every_rank(run_on, tmp_path):
    """DCP gathers the ranks' failures into one error on every rank: each names the OSError
    inside it, and the ranks remove the unfinished directory together."""
    for message, left in run_on(2)(_refused_save_body, str(tmp_path), "fsdp", False):
        assert message.startswith("checkpoint iter_2.pth not written: File too large ("), \
            message
        assert message.endswith("); iter_1.pth is still the newest"), message
        assert left == ["iter_1.pth", "last"]


def test_a_background_save_the_file_system_refuses_is_said_on_every_rank(run_on, tmp_path):
    """ddp's background save (rank 0 writes the file): rank 0 names the OSError, rank 1 says
    another rank's part failed, and the save's file is gone."""
    (message_0, left), (message_1, _) = run_on(2)(_refused_save_body, str(tmp_path), "ddp",
                                                  True)
    assert message_0.startswith("checkpoint iter_2.pth not written: File too large ("), \
        message_0
    assert message_1.startswith("checkpoint iter_2.pth not written: another rank could not "
                                "write its part ("), message_1
    assert message_1.endswith("); iter_1.pth is still the newest"), message_1
    assert left == [*hashed("iter_1.pth"), "last"]


# ---------------------------------------------------------------- crash, then resume


def _runner(work_dir, *, strategy="ddp", resume=False, load_from=None, accumulate=1,
            interval=2, max_iters=6, hooks=(), background=False):
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 24,
                          "batch_size": 4},
        optim={"type": "SGD", "lr": 0.01, "momentum": 0.9, "accumulate": accumulate},
        strategy=strategy, schedule={"max_iters": max_iters}, randomness={"seed": 3},
        logging={"interval": 1, "backends": ["jsonl"]},
        checkpoint={"interval": interval, "max_keep": 5, "async": background}, resume=resume,
        load_from=load_from,
        hooks=hooks,
    )


class CrashingSave(DDPStrategy):
    """DDP whose ``crash_at``-th checkpoint save dies mid-write on every rank (rank 0 leaves
    half a file, as a killed job does)."""

    def __init__(self, crash_at, **options):
        super().__init__(**options)
        self.crash_at = crash_at
        self.saves = 0

    def save_checkpoint(self, path, model, optimizer, extra):
        self.saves += 1
        if self.saves == self.crash_at:
            if dist.is_main_process():
                with open(path, "wb") as f:
                    f.write(b"PK\x03\x04 half")
            raise Killed(f"killed during save {self.saves}")
        super().save_checkpoint(path, model, optimizer, extra)



def _crash_then_resume_body(straight_dir, work_dir):
    runner = _runner(straight_dir)
    runner.train()
    runner.close()

    runner = _runner(work_dir, strategy=CrashingSave(crash_at=2))
    with pytest.raises(Killed):
        runner.train()  # saved iter_2, died writing iter_4
    runner.close()
    checkpoints = Path(work_dir) / "checkpoints"
    after_crash = listing(checkpoints) if dist.is_main_process() else None

    first_step = FirstStepListing()
    runner = _runner(work_dir, resume=True, hooks=[first_step])
    runner.train()
    resumed_from = runner.iter
    runner.close()
    return after_crash, resumed_from, first_step.seen


class FirstStepListing:
    """The checkpoints' directory as the first step of a run sees it."""

    priority = 50

    def __init__(self):
        self.seen = None

    def __getattr__(self, name):
        return lambda *args: None

    def before_train_iter(self, runner, batch_idx, batch):
        if self.seen is None:
            self.seen = listing(runner.checkpoints.directory)


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_after_a_crash_during_a_save_uses_the_previous_checkpoint(run_on, tmp_path,
                                                                         world_size):
    straight, work_dir = tmp_path / "straight", tmp_path / "crashed"
    results = run_on(world_size)(_crash_then_resume_body, str(straight), str(work_dir))
    assert results[0][0] == [".tmp-iter_4.pth", *hashed("iter_2.pth"), "last"]
    assert [r[1] for r in results] == [6] * world_size
    # the resume removed the unfinished save before its first step (its room is back)
    assert results[0][2] == [*hashed("iter_2.pth"), "last"]
    logged = loss_list(work_dir)
    # first run: steps 1..4 (it died saving after step 4); resumed from iter_2, which took
    # out the lines of steps 3 and 4 and logged them again: each step once
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6]
    assert logged == loss_list(straight)  # the very losses of an unbroken run
    checkpoints = work_dir / "checkpoints"
    assert listing(checkpoints) == [*hashed("iter_2.pth", "iter_4.pth", "iter_6.pth"), "last"]
    assert last_names(checkpoints) == "iter_6.pth"


def _crash_resume_body(straight_dir, work_dir, crash_after, options):
    runner = _runner(straight_dir, **options)
    runner.train()
    runner.close()
    runner = _runner(work_dir, hooks=[CrashAfter(crash_after)], **options)
    with pytest.raises(Killed):
        runner.train()
    runner.close()
    runner = _runner(work_dir, resume=True, **options)
    runner.train()
    runner.close()


def check_resumed(run_on_ranks, tmp_path, interval, crash_after, max_iters, **options):
    """Train straight; train again, crash after ``crash_after`` and resume from the checkpoint
    at ``interval``: metrics.jsonl holds each step once, with the straight run's losses."""
    straight, work_dir = tmp_path / "straight", tmp_path / "resumed"
    options = {"interval": interval, "max_iters": max_iters, **options}
    run_on_ranks(_crash_resume_body, str(straight), str(work_dir), crash_after, options)
    logged = loss_list(work_dir)
    assert [step for step, _ in logged] == list(range(1, max_iters + 1))
    assert logged == loss_list(straight)  # bit for bit
    marks = [r for r in records(work_dir) if r.get("mode") == "resume"]
    assert [r["step"] for r in marks] == [interval]


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_between_accumulated_steps_is_exact(run_on, tmp_path, world_size):
    """Accumulating over 2 iterations, checkpointing every 5: iter_5 lies between two
    optimiser steps, holding each rank's own (unsynchronised) gradients of step 5."""
    check_resumed(run_on(world_size), tmp_path, interval=5, crash_after=6, max_iters=8,
                  accumulate=2)


def test_resume_from_the_last_step_of_an_epoch_is_exact(run_on, tmp_path):
    """24 samples in batches of 4: an epoch is 6 steps in one process. A checkpoint at an
    epoch's last step goes on with the next epoch, not the same one again (on 2 ranks, for
    every strategy: tests/wrappers/test_conformance.py)."""
    check_resumed(run_on(1), tmp_path, interval=6, crash_after=7, max_iters=13)


# ---------------------------------------------------------------- background saves

class HeldWrites(DDPStrategy):
    """DDP whose background writes are reported done only once ``release`` is set."""

    def __init__(self, **options):
        super().__init__(**options)
        self.release = threading.Event()
        self.gate = ThreadPoolExecutor(max_workers=1)
        self.futures = []

    def save_checkpoint_async(self, path, model, optimizer, extra):
        written = super().save_checkpoint_async(path, model, optimizer, extra)
        self.futures.append(self.gate.submit(lambda: (self.release.wait(), written.result())))
        return self.futures[-1]


class Release:
    """At step ``step`` (before the checkpoint hook polls), lets the held writes finish, and
    waits until they are written and hashed."""

    priority = 10

    def __init__(self, strategy, step):
        self.strategy, self.step = strategy, step

    def __getattr__(self, name):
        return lambda *args: None

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        if runner.iter == self.step:
            self.strategy.release.set()
            runner.checkpoints._pending.future.result()


class LastSeen:
    """What ``checkpoints/last`` names after each step (after the checkpoint hook)."""

    priority = 70

    def __init__(self):
        self.seen = []

    def __getattr__(self, name):
        return lambda *args: None

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        last = runner.checkpoints.directory / "last"
        self.seen.append(last.read_text().strip() if last.exists() else None)


def _held_body(work_dir):
    strategy, seen = HeldWrites(), LastSeen()
    runner = _runner(work_dir, strategy=strategy, max_iters=8, background=True,
                     hooks=[Release(strategy, 3), seen])
    runner.train()
    runner.close()
    return seen.seen


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_background_save_is_published_only_when_written(run_on, tmp_path, world_size):
    """Training goes on while iter_2 is being written; ``last`` names it from the step at
    which every rank's write is done, never before."""
    for seen in run_on(world_size)(_held_body, str(tmp_path)):
        assert seen[:4] == [None, None, "iter_2.pth", "iter_2.pth"]
    checkpoints = tmp_path / "checkpoints"
    assert listing(checkpoints) == [*hashed("iter_2.pth", "iter_4.pth", "iter_6.pth",
                                            "iter_8.pth"), "last"]
    assert last_names(checkpoints) == "iter_8.pth"  # the end waits for the last write
    assert [step for step, _ in loss_list(tmp_path)] == list(range(1, 9))
    state = load_state_file(str(checkpoints / "iter_2.pth"))
    assert state["meta"]["iter"] == 2  # the snapshot of step 2, not a later one


def _background_resume_body(straight_dir, work_dir, strategy):
    runner = _runner(straight_dir, strategy=strategy, max_iters=10, interval=2)
    runner.train()
    runner.close()
    runner = _runner(work_dir, strategy=strategy, max_iters=10, interval=2, background=True,
                     hooks=[CrashAfter(7)])
    with pytest.raises(Killed):
        runner.train()
    runner.close()
    runner = _runner(work_dir, strategy=strategy, max_iters=10, interval=2, background=True,
                     resume=True)
    runner.resume(runner.start_from[1])  # as train() does first
    resumed_at = runner.iter
    runner.train()
    runner.close()
    return resumed_at


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_background_saves_resume_exactly(run_on, tmp_path, strategy):
    """Asynchronous checkpoints (DCP's async_save under fsdp) resume bit for bit: every step
    logged after the resume has the loss of a run that never stopped."""
    straight, work_dir = tmp_path / "straight", tmp_path / "resumed"
    resumed_at = run_on(2)(_background_resume_body, str(straight), str(work_dir), strategy)
    assert resumed_at[0] == resumed_at[1] and resumed_at[0] in (2, 4, 6)
    expected = dict(loss_list(straight))
    logged = loss_list(work_dir)
    assert [step for step, _ in logged] == list(range(1, 11))  # steps after the resume's once
    for step, loss in logged:
        assert loss == expected[step], step
    assert last_names(work_dir / "checkpoints") == "iter_10.pth"


def test_a_background_save_is_hashed_while_training_goes_on(tmp_path, monkeypatch):
    """The hashing of a background save runs after its write, off the training thread; the
    checkpoint is published once it is hashed, with its manifest."""
    manager, model, optimizer = _manager(tmp_path, strategy=DDPStrategy())
    release, hashed = threading.Event(), []
    real = manifest.written_sha256

    def held(file):
        release.wait(10)
        hashed.append(file.name)
        return real(file)

    monkeypatch.setattr(manifest, "written_sha256", held)
    manager.save("iter_1", model, optimizer, {"meta": {"iter": 1}}, background=True)
    manager.poll()
    assert hashed == [] and not (manager.directory / "last").exists()  # returned, not hashed
    release.set()
    manager.finish()
    assert hashed == [".tmp-iter_1.pth"] and last_names(manager.directory) == "iter_1.pth"
    assert verify_checkpoint(manager.directory / "iter_1.pth", alone=True) is True


def test_a_checkpoint_without_a_manifest_is_taken_unverified_and_all_damaged_are_refused(
        tmp_path, capfd):
    """The newest checkpoint damaged, the one before it written without a manifest: resume
    takes the older one unverified, saying so, and logs the losses of an unbroken run. Every
    checkpoint damaged: resume is refused, naming each. (A damaged checkpoint passed over, and
    one named by path refused, for every strategy: tests/wrappers/test_conformance.py.)"""
    work_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    runner = _runner(work_dir)
    runner.train()
    runner.close()
    straight = loss_list(work_dir)
    flip_byte(checkpoints / "iter_6.pth")
    (checkpoints / "iter_4.pth.sha256").unlink()  # as written before checkpoints were hashed
    capfd.readouterr()
    runner = _runner(work_dir, resume=True)
    assert runner.start_from == ("resume", checkpoints / "iter_4.pth")
    runner.train()
    runner.close()
    err = capfd.readouterr().err
    assert f"{checkpoints / 'iter_4.pth'} has no manifest of hashes" in err
    assert loss_list(work_dir) == straight  # steps 5 and 6 once, bit for bit

    rehash(checkpoints / "iter_4.pth")
    for name in ("iter_6.pth", "iter_4.pth", "iter_2.pth"):  # iter_6 saved again since
        flip_byte(checkpoints / name)
    with pytest.raises(ConfigError) as refused:
        _runner(work_dir, resume=True)
    assert str(refused.value) == f"resume: no intact checkpoint in {checkpoints}: " + "; ".join(
        f"{checkpoints / name} is damaged: {name}: sha256 mismatch (against {name}.sha256)"
        for name in ("iter_6.pth", "iter_4.pth", "iter_2.pth"))


# ---------------------------------------------------------------- crafted pickles


def test_crafted_checkpoints_are_refused_by_every_runner_path(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    write_crafted_checkpoint(evil, marker)

    for key, start in (("resume", {"resume": str(evil)}), ("load_from", {"load_from": str(evil)})):
        with pytest.raises(ConfigError, match=f"^{key}: .*evil.pth: refused to load: it holds "):
            _runner(tmp_path / key, **start)  # refused before anything is written
        assert not (tmp_path / key).exists()
    runner = _runner(tmp_path / "explicit")
    with pytest.raises(pickle.UnpicklingError):
        runner.resume(evil)
    with pytest.raises(pickle.UnpicklingError):
        runner.load_weights(evil)
    runner.close()
    assert not marker.exists()

    # resume=True finds it through checkpoints/last
    checkpoints = tmp_path / "latest" / "checkpoints"
    checkpoints.mkdir(parents=True)
    write_crafted_checkpoint(checkpoints / "iter_2.pth", marker, raw_pickle=True)
    (checkpoints / "last").write_text("iter_2.pth\n")
    with pytest.raises(ConfigError, match="^resume: .*iter_2.pth: refused to load"):
        _runner(tmp_path / "latest", resume=True)
    assert not marker.exists()
    assert not (tmp_path / "explicit" / "metrics.jsonl").exists()  # nothing trained

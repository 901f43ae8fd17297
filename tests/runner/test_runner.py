"""The runner end to end, in one process and on 2 gloo ranks: the run directory, logging,
checkpoints, exact resume, seeds and evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainrun.dist as dist
from tests.records import loss_list, records
from tests.runner.toy import CrashAfter, Killed
from trainrun.runner.hooks import Hook
from trainrun.runner.runner import Runner

DATASET = "tests.runner.toy.ToyRegression"
MODEL = {"type": "tests.runner.toy.ToyModel"}


def _runner(work_dir, *, max_epochs=None, max_iters=None, checkpoint=None, resume=False,
            seed=7, diff_rank_seed=False, batch_size=4, size=64, strategy="ddp", hooks=(),
            val=True, log_interval=1, log_window=1):
    schedule = {"max_iters": max_iters} if max_iters else {"max_epochs": max_epochs or 2}
    return Runner(
        model=MODEL, work_dir=work_dir,
        train_dataloader={"type": DATASET, "size": size, "batch_size": batch_size},
        val_dataloader={"type": DATASET, "size": 21, "seed": 1, "batch_size": 4} if val else None,
        optim={"type": "SGD", "lr": 0.01, "momentum": 0.9},
        scheduler={"type": "cosine", "warmup_iters": 3},
        strategy=strategy, schedule=schedule,
        randomness={"seed": seed, "diff_rank_seed": diff_rank_seed},
        logging={"interval": log_interval, "backends": ["jsonl"], "window": log_window},
        checkpoint=checkpoint or {"interval": 0}, resume=resume, hooks=hooks,
    )




def _single_run_body(work_dir):
    runner = _runner(work_dir, max_epochs=2, checkpoint={"interval": 1, "max_keep": 1})
    runner.train()
    runner.close()
    return dist.get_rank()


def test_run_directory_and_metrics(run_on, tmp_path):
    run_on(1)(_single_run_body, str(tmp_path))
    logged = records(tmp_path)
    train = [r for r in logged if "mode" not in r]
    assert [r["step"] for r in train] == list(range(1, 33))  # 64 samples / 4 per step x 2 epochs
    assert {r["epoch"] for r in train} == {1, 2}
    assert all(isinstance(r["loss"], float) and isinstance(r["lr"], float) for r in train)
    val = [r for r in logged if r.get("mode") == "val"]
    assert [r["step"] for r in val] == [16, 32] and all("mse" in r for r in val)
    assert (tmp_path / "train.log").read_text().count("validation at step") == 2
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "last").read_text().strip() == "epoch_2.pth"
    assert sorted(p.name for p in checkpoints.iterdir()) == [  # max_keep 1; its manifest
        "epoch_2.pth", "epoch_2.pth.sha256", "last"]


def _resume_body(work_dir, crash_step, checkpoint):
    try:
        _runner(work_dir, max_iters=24, checkpoint=checkpoint,
                hooks=[CrashAfter(crash_step)]).train()
    except Killed:
        pass
    runner = _runner(work_dir, max_iters=24, checkpoint=checkpoint, resume=True)
    runner.train()
    runner.close()


def _straight_body(work_dir):
    _runner(work_dir, max_iters=24, checkpoint={"interval": 5}).train()


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_mid_epoch_gives_bit_identical_losses(run_on, tmp_path, world_size):
    """Checkpoint at step 10 (mid-epoch), crash at 13, resume: the lines of steps 11..13 that
    the crashed run logged are taken out, and steps 11..24 log exactly what a run that never
    stopped logs, to the last bit: each step once."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_on(world_size)(_straight_body, str(straight))
    run_on(world_size)(_resume_body, str(resumed), 13, {"interval": 5})
    expected = dict(loss_list(straight))
    logged = loss_list(resumed)
    assert [step for step, _ in logged] == list(range(1, 25))
    for step, loss in logged:
        assert loss == expected[step], (step, loss, expected[step])
    marks = [r for r in records(resumed) if r.get("mode") == "resume"]
    assert marks == [{"step": 10, "mode": "resume",
                      "from": str(resumed / "checkpoints" / "iter_10.pth")}]
    val_straight = [r for r in records(straight) if r.get("mode") == "val"]
    val_resumed = [r for r in records(resumed) if r.get("mode") == "val"]
    assert val_resumed[-1] == val_straight[-1]


class OwnLosses(Hook):
    """Each step's own loss on this rank."""

    def __init__(self):
        self.losses: list[float] = []

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        self.losses.append(outputs["loss"].item())


# each rank its own losses, so that each rank's window differs; checkpoints at steps 5 and 10
WINDOWED = {"max_iters": 12, "checkpoint": {"interval": 5}, "diff_rank_seed": True, "val": False,
            "log_window": 4}


def _windowed_body(work_dir, crash_step=None):
    if crash_step is not None:
        try:
            _runner(work_dir, hooks=[CrashAfter(crash_step)], **WINDOWED).train()
        except Killed:
            pass
    own = OwnLosses()
    with _runner(work_dir, resume=crash_step is not None, hooks=[own], **WINDOWED) as runner:
        runner.train()
    return own.losses


def test_a_logging_window_resumes_exactly_on_every_rank(run_on, tmp_path):
    """logging.window 4, crashed after step 7 and resumed from step 5's checkpoint: steps 6 to
    8 average each rank's steps before the checkpoint too, which the checkpoint carries, so
    every line is the unbroken run's, to the last bit."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    own0, own1 = run_on(2)(_windowed_body, str(straight))
    run_on(2)(_windowed_body, str(resumed), 7)
    expected = loss_list(straight)
    means = [torch.true_divide(torch.tensor(own[max(0, step - 4):step]).sum(),
                               min(step, 4)) for own in (own0, own1) for step in range(1, 13)]
    assert [loss for _, loss in expected] == [((a + b) / 2).item() for a, b in
                                              zip(means[:12], means[12:], strict=True)]
    assert loss_list(resumed) == expected
    assert [r["step"] for r in records(resumed) if r.get("mode") == "resume"] == [5]


def _seed_body(work_dir, diff_rank_seed):
    runner = _runner(work_dir, max_iters=8, val=False, diff_rank_seed=diff_rank_seed)
    first = next(iter(runner.train_dataloader))
    model = runner.strategy.unwrap(runner.model)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    noise = torch.rand(3)  # the rank's own random stream after seeding
    return first["index"].tolist(), weights, noise


def test_seeds_shared_and_diff_rank_seed(run_on, tmp_path):
    same = run_on(2)(_seed_body, str(tmp_path / "a"), False)
    differ = run_on(2)(_seed_body, str(tmp_path / "b"), True)
    for results in (same, differ):
        (indices0, weights0, _), (indices1, weights1, _) = results
        assert not set(indices0) & set(indices1)  # each rank its own shard
        assert torch.equal(weights0, weights1)  # DDP starts every rank from rank 0's weights
    assert torch.equal(same[0][2], same[1][2])
    assert not torch.equal(differ[0][2], differ[1][2])
    again = run_on(2)(_seed_body, str(tmp_path / "c"), False)
    assert torch.equal(again[0][2], same[0][2]) and again[0][0] == same[0][0]


def _only_rank0_writes_body(base):
    """Each rank is handed its own work_dir: whatever a rank writes lands in its own."""
    work_dir = Path(base) / f"rank{dist.get_rank()}"
    _runner(work_dir, max_iters=6, checkpoint={"interval": 3}).train()


def test_only_rank_zero_writes(run_on, tmp_path):
    run_on(2)(_only_rank0_writes_body, str(tmp_path))
    written = {str(p.relative_to(tmp_path / "rank0")) for p in (tmp_path / "rank0").rglob("*")}
    assert {"metrics.jsonl", "train.log", "checkpoints/last", "checkpoints/iter_6.pth"} <= written
    assert not (tmp_path / "rank1").exists()


class Tally(Hook):
    """Adds ``by`` at every step: state that a resumed run must get back, each its own."""

    def __init__(self, by: int):
        self.by, self.total = by, 0

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        self.total += self.by

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = state["total"]


def test_two_hooks_of_one_class_resume_each_its_own_state(tmp_path):
    checkpoint = {"interval": 4}
    with pytest.raises(Killed):
        _runner(tmp_path, max_iters=8, val=False, checkpoint=checkpoint,
                hooks=[Tally(1), Tally(10), CrashAfter(6)]).train()
    tallies = [Tally(1), Tally(10)]
    with _runner(tmp_path, max_iters=8, val=False, checkpoint=checkpoint, resume=True,
                 hooks=tallies) as runner:
        runner.train()
    assert [t.total for t in tallies] == [8, 80]  # 4 steps saved, 4 more; not 44 and 80


def test_a_first_hook_of_a_class_keeps_the_key_older_checkpoints_used(tmp_path):
    with _runner(tmp_path, max_iters=4, val=False, checkpoint={"interval": 4},
                 hooks=[Tally(1), Tally(10)]) as runner:
        runner.train()
    saved = torch.load(next((tmp_path / "checkpoints").glob("*.pth")), weights_only=False)
    assert {k: v for k, v in saved["hooks"].items() if k.startswith("Tally")} == \
        {"Tally": {"total": 4}, "Tally#2": {"total": 40}}


class Mine(Hook):
    """A user's hook that sets no priority."""


def test_after_a_step_the_hooks_run_in_the_order_hooks_base_states(tmp_path):
    with _runner(tmp_path, max_iters=4, hooks=[Mine()]) as runner:
        order = [type(hook).__name__ for hook in runner.hooks]
    assert order == ["IterTimerHook", "LoggerHook", "GuardHook", "ValidationHook", "Mine",
                     "CheckpointHook", "PreemptionHook"]

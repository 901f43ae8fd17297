"""What every strategy promises of its checkpoints, checked the same way for each: every
strategy registered in ``trainrun.registry.STRATEGIES`` (read when the tests are collected,
so a strategy registered later is covered at once; deepspeed as ZeRO-2 and as ZeRO-3), and
one defined in this file alone with a checkpoint format of its own.

For each, on 2 gloo ranks ('none', which trains a copy on every rank, in one process): (a) a
checkpoint is written, published (``last``), pruned, verified against its manifest and in
the strategy's own format, which reads the run's weights back; (b) a run that crashed resumes
and logs the losses of a run that never stopped, bit for bit; (c) its weights load with
``load_from`` under another strategy, and another's under it, exactly; (d) a damaged newest
checkpoint is passed over (saying so) and, named by path, refused with the damaged file named.

One straight run and one crashed-then-resumed run per strategy, trained once a session, serve
(a), (b) and (d): the newest checkpoint of the crashed run gets one byte flipped before the
resume, which so goes back to the checkpoint before it.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.records import loss_list, records
from tests.runner.toy import CrashAfter, Killed, flip_byte
from tests.runs import shared_run
from trainrun.checkpoint.files import save_state_file
from trainrun.checkpoint.format import CheckpointFormat, checkpoint_format
from trainrun.checkpoint.manifest import is_sidecar, manifest_of, read_manifest, verify_checkpoint
from trainrun.checkpoint.optimizer_state import optimizer_state
from trainrun.checkpoint.read import read_weights
from trainrun.checkpoint.torch_file import TorchFile
from trainrun.checkpoint.train_state import TRAIN_STATE
from trainrun.dist import barrier, get_rank, get_world_size
from trainrun.registry import FORMATS, STRATEGIES
from trainrun.runner.config import ConfigError
from trainrun.runner.runner import Runner
from trainrun.wrappers import DDPStrategy

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2]
                                                   / ".venv" / "torch_extensions"))


# ---------------------------------------------------------------- a strategy of this file's own

class SplitDDP(DDPStrategy):
    """DDP whose checkpoint is a directory of two files written by two ranks: the runner's
    state by rank 0 (which alone holds every rank's part of it), the model and its optimiser
    by the last rank."""

    name = "split_ddp"
    WRITER_RANK = re.compile(r"^model_(\d+)\.pt$")  # the last rank writes and hashes its file
    FORMAT = "split_files"

    def save_checkpoint(self, path: str, model: Any, optimizer: Any,
                        extra: dict[str, Any]) -> None:
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        rank, last = get_rank(), get_world_size() - 1
        if rank == 0:
            save_state_file(directory / TRAIN_STATE, extra)
        if rank == last:
            save_state_file(directory / f"model_{rank}.pt",
                            {"model": self.model_state_dict(model),
                             "optimizer": optimizer_state(optimizer)})
        barrier()


class SplitFiles(CheckpointFormat):
    """The format of ``SplitDDP``'s checkpoints: each file is a torch file (read as
    ``TorchFile`` reads one), and the weights are read from the model's file alone."""

    name = "split_files"

    @classmethod
    def _model_file(cls, path: Path) -> Path:
        return next(path.glob("model_*.pt"))

    @classmethod
    def owns(cls, path: Path) -> bool:
        return (path / TRAIN_STATE).is_file() and any(path.glob("model_*.pt"))

    @classmethod
    def look_inside(cls, path: Path) -> None:
        for file in (path / TRAIN_STATE, cls._model_file(path)):
            TorchFile.look_inside(file)

    @classmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        return {**TorchFile.read_state(cls._model_file(path)),
                **TorchFile.read_state(path / TRAIN_STATE)}

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, torch.Tensor]:
        return TorchFile.read_weights(cls._model_file(path))

    @classmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        return TorchFile.model_shapes(cls._model_file(path))


@contextmanager
def own_strategy() -> Iterator[None]:
    """``SplitDDP`` and its format registered (in this process) while the block runs."""
    STRATEGIES["split_ddp"] = SplitDDP  # the registry lines
    FORMATS["split_files"] = SplitFiles
    try:
        yield
    finally:
        del STRATEGIES["split_ddp"], FORMATS["split_files"]


# ---------------------------------------------------------------- the strategies covered

@dataclass(frozen=True)
class Case:
    """One strategy with its options, as a config names it, and the processes it runs on."""

    id: str
    strategy: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    processes: int = 2

    def config(self) -> dict[str, Any]:
        return {"type": self.strategy, **self.options}

    def __str__(self) -> str:
        return self.id


# the options each variant of a strategy is checked with (one variant, no options, otherwise)
VARIANTS = {"deepspeed": {"zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}}
# 'none' trains a copy on every rank, and rank 0's checkpoint holds rank 0's alone: it resumes
# exactly in one process
PROCESSES = {"none": 1}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def strategy_cases() -> list[Case]:
    """A case for every variant of every registered strategy, and one for ``SplitDDP``."""
    cases = []
    for name in STRATEGIES:
        variants = VARIANTS.get(name, {"": {}})
        for variant, options in variants.items():
            cases.append(Case(f"{name}-{variant}" if variant else name, name, options,
                              PROCESSES.get(name, 2)))
    return [*cases, Case("split_ddp (this file's)", "split_ddp")]


CASES = {case.id: case for case in strategy_cases()}


def params() -> list[Any]:
    """The cases as test parameters (DeepSpeed's are slow to start, and need DeepSpeed)."""
    out = []
    for case in CASES.values():
        marks = []
        if case.strategy == "deepspeed":
            marks = [pytest.mark.slow, pytest.mark.skipif(not HAS_DEEPSPEED,
                                                          reason="deepspeed is not installed")]
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


def other_than(case: Case) -> Case:
    """The strategy ``case``'s weights are loaded under, and whose weights it loads."""
    return CASES["none" if case.strategy == "ddp" else "ddp"]


# ---------------------------------------------------------------- the runs

# checkpoints at steps 2, 4, 6, 8 and (the last) 9, the oldest pruned: 3 kept. An epoch is 4
# steps on 2 ranks: the crashed run resumes from the checkpoint of an epoch's last step
STEPS, INTERVAL, CRASH_AFTER = 9, 2, 7
SAMPLES, BATCH = 32, 4  # BATCH on each rank


def _runner(work_dir: str, case: Case, **more: Any) -> Runner:
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": SAMPLES,
                          "batch_size": BATCH},
        optim={"type": "AdamW", "lr": 0.01}, scheduler={"type": "cosine", "warmup_iters": 3},
        strategy=case.config(), schedule={"max_iters": STEPS}, randomness={"seed": 7},
        logging={"interval": 1, "backends": ["jsonl"]}, checkpoint={"interval": INTERVAL},
        **more,
    )


def _straight_and_crashed(case: Case, root: str) -> dict[str, torch.Tensor]:
    """A straight run, and one killed after step ``CRASH_AFTER``; the straight run's final
    weights."""
    with own_strategy():
        with _runner(f"{root}/straight", case) as runner:
            runner.train()
            final = runner.strategy.model_state_dict(runner.model)
        with _runner(f"{root}/crashed", case, hooks=[CrashAfter(CRASH_AFTER)]) as runner, \
                pytest.raises(Killed):
            runner.train()
    return final


def _refused_then_resumed(case: Case, root: str, damaged: str
                          ) -> tuple[dict[str, str], tuple[str, str]]:
    """The damaged checkpoint named as ``resume`` and as ``load_from`` (each refusal's
    message), then the crashed run resumed (what it started from)."""
    refusals = {}
    with own_strategy():
        for key in ("resume", "load_from"):
            try:
                runner = _runner(f"{root}/refused", case, **{key: damaged})
            except ConfigError as error:
                refusals[key] = str(error)
            else:
                runner.close()
        with _runner(f"{root}/crashed", case, resume=True) as runner:
            how, path = runner.start_from
            runner.train()
    return refusals, (how, str(path))


def _loaded_across(case: Case, other: Case, checkpoint: str, others: str, root: str
                   ) -> dict[str, dict[str, torch.Tensor]]:
    """``case``'s checkpoint loaded under ``other``, and ``other``'s under ``case``: the
    weights each model then holds."""
    loaded = {}
    with own_strategy():
        for name, under, path in (("into_other", other, checkpoint),
                                  ("into_case", case, others)):
            with _runner(f"{root}/{name}", under) as runner:
                runner.load_weights(path)
                loaded[name] = runner.strategy.model_state_dict(runner.model)
    return loaded


def damage(checkpoint: Path) -> str:
    """Flip a byte in the largest file of ``checkpoint``; the file's name in its manifest."""
    def listed(name: str) -> Path:
        return checkpoint / name if checkpoint.is_dir() else checkpoint.with_name(name)

    name = max(read_manifest(checkpoint) or {}, key=lambda n: (listed(n).stat().st_size, n))
    flip_byte(listed(name))
    return name


@dataclass
class Trained:
    """A case's runs: where they are, and what their bodies reported."""

    root: Path
    final: list[dict[str, torch.Tensor]]  # the straight run's final weights, by rank
    damaged: str  # the file flipped in the crashed run's newest checkpoint
    refusals: list[dict[str, str]]  # by rank: key -> the refusal of the damaged checkpoint
    started: list[tuple[str, str]]  # by rank: what the resumed run started from

    @property
    def straight(self) -> Path:
        return self.root / "straight"

    @property
    def crashed(self) -> Path:
        return self.root / "crashed"


def _train(run_on: Callable, root: Path, case: Case) -> Trained:
    on_ranks = run_on(case.processes)
    final = on_ranks(_straight_and_crashed, case, str(root))
    newest = root / "crashed" / "checkpoints" / "iter_6.pth"  # the last before the crash
    damaged = damage(newest)
    resumed = on_ranks(_refused_then_resumed, case, str(root), str(newest))
    return Trained(root, final, damaged, [r for r, _ in resumed], [s for _, s in resumed])


@shared_run
def trained(run_on, tmp_path_factory) -> Callable[[Case], Trained]:
    """``trained(case)``: the case's runs, trained at the first call, once a session (a
    failure is kept and raised again, not trained again)."""
    done: dict[str, Trained | BaseException] = {}

    def get(case: Case) -> Trained:
        if case.id not in done:
            root = tmp_path_factory.mktemp(re.sub(r"\W+", "_", case.id))
            try:
                done[case.id] = _train(run_on, root, case)
            except Exception as error:
                done[case.id] = error
        found = done[case.id]
        if isinstance(found, BaseException):
            raise found
        return found

    return get


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the checks

@pytest.mark.parametrize("case", params())
def test_a_checkpoint_is_published_verified_and_in_the_strategys_format(trained, case):
    """The straight run's checkpoints: the oldest pruned, ``last`` naming the newest, which
    its manifest verifies and its strategy's format reads, with the run's final weights."""
    run = trained(case)
    checkpoints = run.straight / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir() if not is_sidecar(p.name))
    assert names == ["iter_6.pth", "iter_8.pth", "iter_9.pth", "last"]  # pruned, no leftovers
    assert (checkpoints / "last").read_text().strip() == "iter_9.pth"
    newest = checkpoints / "iter_9.pth"
    assert manifest_of(newest).is_file()
    assert verify_checkpoint(newest, alone=True) is True
    with own_strategy():
        assert checkpoint_format(newest).name == STRATEGIES[case.strategy].FORMAT
        weights = read_weights(newest)  # in this process, with no group
    assert same_weights(weights, run.final[0])  # the weights the run ended with
    assert all(same_weights(final, run.final[0]) for final in run.final)


@pytest.mark.parametrize("case", params())
def test_a_crashed_run_resumes_with_bit_identical_losses(trained, case):
    """Killed after step 7, resumed from step 4, an epoch's last step on 2 ranks (its
    checkpoint of step 6 is damaged: see the test below): steps 5 to 7 trained again and
    logged once each, with the losses of the straight run to the last bit; the damaged
    checkpoint saved again."""
    run = trained(case)
    resumed_from = run.crashed / "checkpoints" / "iter_4.pth"
    logged = loss_list(run.crashed)
    assert [step for step, _ in logged] == list(range(1, STEPS + 1))
    assert logged == loss_list(run.straight)  # ==: bit for bit
    marks = [r for r in records(run.crashed) if r.get("mode") == "resume"]
    assert marks == [{"step": 4, "mode": "resume", "from": str(resumed_from)}]
    log = (run.crashed / "train.log").read_text()
    assert f"resumed from {resumed_from} at epoch 1, step 4\n" in log
    checkpoints = run.crashed / "checkpoints"
    assert (checkpoints / "last").read_text().strip() == "iter_9.pth"
    assert verify_checkpoint(checkpoints / "iter_6.pth", alone=True) is True


@pytest.mark.parametrize("case", params())
def test_a_damaged_checkpoint_is_passed_over_and_refused_by_path(trained, case):
    """One byte flipped in the crashed run's newest checkpoint: named by path as ``resume``
    or ``load_from``, it is refused, naming the file, before a run directory is made;
    ``resume: true`` skips it, saying why, for the one before it."""
    run = trained(case)
    damaged = run.crashed / "checkpoints" / "iter_6.pth"
    why = f"{damaged} is damaged: {run.damaged}: sha256 mismatch " \
          f"(against {manifest_of(damaged).name})"
    assert run.refusals == [{"resume": f"resume: {why}", "load_from": f"load_from: {why}"}] \
        * case.processes
    assert not (run.root / "refused").exists()  # refused before anything was written
    assert run.started == [("resume", str(damaged.with_name("iter_4.pth")))] * case.processes
    assert f"resume: skipped: {why}\n" in (run.crashed / "train.log").read_text()


@pytest.mark.parametrize("case", params())
def test_its_weights_load_under_another_strategy_and_anothers_under_it(trained, case, run_on,
                                                                        tmp_path):
    """The straight run's last checkpoint loaded under ddp (ddp's under none), and ddp's
    (none's) under this strategy: each model holds exactly the weights saved. Loading reads
    the weights through the checkpoint's format, then hands them to the strategy, so these
    pairs stand for every pair of strategies."""
    other = other_than(case)
    run, others = trained(case), trained(other)
    checkpoint, others_checkpoint = (r.straight / "checkpoints" / "iter_9.pth"
                                     for r in (run, others))
    for loaded in run_on(2)(_loaded_across, case, other, str(checkpoint),
                            str(others_checkpoint), str(tmp_path)):
        assert same_weights(loaded["into_other"], run.final[0]), f"{case} -> {other}"
        assert same_weights(loaded["into_case"], others.final[0]), f"{other} -> {case}"

"""Checkpoints cross between MMEngine and trainrun.compat.mmengine, both ways (issue 24,
point 6).

MMEngine to trainrun: a file in MMEngine 0.10.7's layout (written here with plain torch by
`write_mmengine_checkpoint`, its message hub pickling MMEngine's log buffers and numpy values
as MMEngine's does) is recognised as format 'mmengine', read with ``weights_only`` (those
objects as inert placeholders, anything else refused), starts the compat Runner's weights
(``load_from``) and resumes its training (``resume=True, load_from=``) to the losses of the
run that never stopped. trainrun to MMEngine: the compat Runner's strategy writes the weights
under ``state_dict`` too, which MMEngine's ``load_checkpoint`` reads; trainrun's own runs'
checkpoints are unchanged. The test that runs MMEngine itself is skipped without it.
"""

from __future__ import annotations

import pickle
import sys
import types
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from trainrun.checkpoint import MMEngineFile, TorchFile, checkpoint_format
from trainrun.checkpoint.read import (
    check_checkpoint_file,
    model_shapes,
    read_train_state,
    read_weights,
)
from trainrun.compat.mmengine.checkpoint import (
    MMEngineDDP,
    continue_as_mmengine,
    load_checkpoint,
)
from trainrun.compat.mmengine.hooks import Hook
from trainrun.compat.mmengine.model import BaseModel
from trainrun.compat.mmengine.runner import Runner
from trainrun.runner.runner import Runner as TrainrunRunner
from trainrun.runner.schema import ConfigError

STEPS_PER_EPOCH = 4  # 32 samples, batches of 8, one process


class Blobs(Dataset):
    """32 samples of 6 features in 3 classes, as dicts (what ``default_collate`` stacks)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.labels = torch.randint(0, 3, (32,), generator=generator)
        self.inputs = torch.randn(32, 6, generator=generator) + self.labels[:, None]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[index], "labels": self.labels[index]}


class Net(BaseModel):
    """A 6-16-3 MLP written for MMEngine (no dropout: nothing random but the data order)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, mode: str = "tensor") -> Any:
        scores = self.fc2(F.relu(self.fc1(inputs)))
        if mode == "loss":
            return {"loss": F.cross_entropy(scores, labels)}
        return scores


class LossRecorder(Hook):
    """Records each iteration's (0-based) number, loss and learning rate, and the model's
    weights before the first iteration it sees."""

    def __init__(self) -> None:
        self.records: list[tuple[int, float, float]] = []
        self.first_weights: dict[str, torch.Tensor] | None = None

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        if self.first_weights is None:
            model = getattr(runner.model, "module", runner.model)
            self.first_weights = {k: v.clone() for k, v in model.state_dict().items()}

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        self.records.append((runner.iter, outputs["loss"].item(),
                             runner.optim_wrapper.get_lr()["lr"][0]))


class ResumingAsMMEngine(Runner):
    """The compat Runner with the resume that compat.mmengine.runner is to have."""

    def resume(self, path: str) -> None:
        super().resume(path)
        continue_as_mmengine(self, path)


ITERATION_LOOP = {
    "train_cfg": {"type": "IterBasedTrainLoop", "max_iters": 3 * STEPS_PER_EPOCH},
    "param_scheduler": {"type": "MultiStepLR", "by_epoch": False,
                        "milestones": [2 * STEPS_PER_EPOCH], "gamma": 0.1},
    "default_hooks": {"checkpoint": {"type": "CheckpointHook", "interval": 3,
                                     "by_epoch": False}}}


def train(work_dir: Path, load_from: Path | None = None, resume: bool = False,
          runner_type: type[Runner] = Runner, **changes: Any) -> tuple[Runner, LossRecorder]:
    """The compat Runner on MMEngine's arguments: 3 epochs of SGD with momentum, the rate
    divided by 10 from epoch 2, a checkpoint every epoch (``changes`` replace arguments);
    trained, then closed."""
    recorder = LossRecorder()
    torch.manual_seed(0)
    arguments = {
        "param_scheduler": {"type": "MultiStepLR", "by_epoch": True, "milestones": [2],
                            "gamma": 0.1},
        "train_cfg": {"by_epoch": True, "max_epochs": 3},
        "default_hooks": {"checkpoint": {"type": "CheckpointHook", "interval": 1}}, **changes}
    runner = runner_type(
        model=Net(), work_dir=str(work_dir),
        train_dataloader={"dataset": Blobs(), "batch_size": 8,
                          "sampler": {"type": "DefaultSampler", "shuffle": True},
                          "collate_fn": {"type": "default_collate"}},
        optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.1, "momentum": 0.9}},
        custom_hooks=[recorder], randomness={"seed": 42},
        load_from=None if load_from is None else str(load_from), resume=resume, **arguments)
    with runner:
        runner.train()
    return runner, recorder


# ---------------------------------------------------------------- MMEngine's layout


class HistoryBuffer:
    """Stands for MMEngine's ``mmengine.logging.history_buffer.HistoryBuffer`` while a
    fixture is written (pickled under that name): numpy arrays of logged values, and its
    statistics methods by name, which a protocol-2 pickle fetches with ``getattr``."""

    def __init__(self, values: list[float]) -> None:
        self.max_length = 1000000
        self._log_history = np.array(values)
        self._count_history = np.ones(len(values), dtype=np.int64)
        self._statistics_methods = {"mean": HistoryBuffer.mean}

    def mean(self) -> float:
        return float(self._log_history.mean())


@contextmanager
def mmengine_names() -> Iterator[None]:
    """``HistoryBuffer`` importable as MMEngine's, for pickling; what ``sys.modules`` held
    under those names (MMEngine itself, where imported) is put back afterwards."""
    names = ("mmengine", "mmengine.logging", "mmengine.logging.history_buffer")
    absent = object()
    saved = {name: sys.modules.get(name, absent) for name in names}
    modules = {name: types.ModuleType(name) for name in names}
    modules["mmengine.logging.history_buffer"].HistoryBuffer = HistoryBuffer
    own_module = HistoryBuffer.__module__
    HistoryBuffer.__module__ = "mmengine.logging.history_buffer"
    sys.modules.update(modules)
    try:
        yield
    finally:
        HistoryBuffer.__module__ = own_module
        for name, module in saved.items():
            if module is absent:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def write_mmengine_checkpoint(path: Path, weights: dict[str, torch.Tensor],
                              optimizer: dict[str, Any], epoch: int, iters: int,
                              seed: int = 42, extra: Any = None,
                              loss_scaler: dict[str, Any] | None = None) -> Path:
    """A checkpoint with exactly MMEngine 0.10.7's layout (``Runner.save_checkpoint`` after
    ``epoch`` epochs and ``iters`` iterations of a by-epoch MultiStepLR run), written with
    plain torch; ``extra``, if given, is pickled inside its message hub; ``loss_scaler`` is
    what an ``AmpOptimWrapper`` adds to the optimiser's state."""
    optimizer = {"state": optimizer["state"],
                 "param_groups": [{**group, "initial_lr": 0.1}
                                  for group in optimizer["param_groups"]],
                 **({"loss_scaler": loss_scaler} if loss_scaler is not None else {})}
    state = {
        "meta": {"epoch": epoch, "iter": iters, "cfg": "\n", "seed": seed,
                 "experiment_name": "20260101_000000", "time": "20260101_000001",
                 "mmengine_version": "0.10.7"},
        "state_dict": OrderedDict(weights),
        "message_hub": {"log_scalars": {"train/loss": HistoryBuffer([1.2, 1.1]),
                                        "train/lr": HistoryBuffer([0.1, 0.1])},
                        "runtime_info": {"epoch": epoch - 1, "iter": iters - 1,
                                         "eta": np.float64(0.05), "mmengine_version": "0.10.7",
                                         "extra": extra},
                        "resumed_keys": {"epoch": False, "iter": False}},
        "optimizer": optimizer,
        "param_schedulers": [{"milestones": Counter({2: 1}), "gamma": 0.1, "param_name": "lr",
                              "begin": 0, "end": 3, "by_epoch": True, "base_values": [0.1],
                              "last_step": epoch, "_global_step": epoch, "verbose": False,
                              "_last_value": [0.1]}],
    }
    with mmengine_names():
        torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LossRecorder]:
    """A compat run of 3 epochs that never stopped: its run directory and its losses."""
    work_dir = tmp_path_factory.mktemp("uninterrupted")
    _, recorder = train(work_dir)
    return work_dir, recorder


@pytest.fixture(scope="module")
def mmengine_file(uninterrupted: tuple[Path, LossRecorder],
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run's state after epoch 1, in MMEngine's file."""
    work_dir, _ = uninterrupted
    saved = torch.load(work_dir / "epoch_1.pth", weights_only=True)
    return write_mmengine_checkpoint(tmp_path_factory.mktemp("mm") / "epoch_1.pth",
                                     saved["model"], saved["optimizer"], epoch=1,
                                     iters=STEPS_PER_EPOCH)


# ---------------------------------------------------------------- MMEngine to trainrun


def test_the_fixture_needs_what_mmengine_files_need(mmengine_file):
    """The fixture pickles the globals that weights_only refuses in MMEngine's files."""
    needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(mmengine_file))
    assert {"mmengine.logging.history_buffer.HistoryBuffer", "builtins.getattr",
            "numpy.ndarray", "numpy.dtype"} <= needed
    with pytest.raises(pickle.UnpicklingError):
        torch.load(mmengine_file, weights_only=True)


def test_an_mmengine_file_is_recognised_and_read(mmengine_file, uninterrupted):
    work_dir, _ = uninterrupted
    had_mmengine = "mmengine" in sys.modules
    assert checkpoint_format(mmengine_file) is MMEngineFile
    assert checkpoint_format(work_dir / "epoch_1.pth") is TorchFile
    assert check_checkpoint_file(mmengine_file) == mmengine_file
    saved = torch.load(work_dir / "epoch_1.pth", weights_only=True)
    weights = read_weights(mmengine_file)
    assert weights.keys() == saved["model"].keys()
    assert all(torch.equal(weights[key], value) for key, value in saved["model"].items())
    assert model_shapes(mmengine_file) == {k: tuple(v.shape) for k, v in weights.items()}
    train_state = read_train_state(mmengine_file)
    assert train_state["meta"] == {"epoch": 1, "iter": STEPS_PER_EPOCH, "seed": 42,
                                   "mmengine_version": "0.10.7"}
    assert train_state["optim_wrapper"] == {"micro_steps": 0, "scaler": None, "grads": None}
    assert train_state["rng"] is None and train_state["schedulers"] is None
    assert ("mmengine" in sys.modules) == had_mmengine  # nothing of MMEngine was imported


def test_a_wrapped_models_names_and_the_loss_scaler(tmp_path):
    """``module.`` is stripped from the names (as MMEngine's loading does); an
    AmpOptimWrapper's loss scaler goes to trainrun's optimiser wrapper, not the optimiser."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
              "growth_interval": 2000, "_growth_tracker": 3}
    path = write_mmengine_checkpoint(
        tmp_path / "epoch_1.pth", {f"module.{k}": v for k, v in model.state_dict().items()},
        optimizer.state_dict(), epoch=1, iters=4, loss_scaler=scaler)
    assert set(read_weights(path)) == set(model.state_dict())
    state = MMEngineFile.read_state(path)
    assert "loss_scaler" not in state["optimizer"]
    assert state["optim_wrapper"] == {"micro_steps": 0, "scaler": scaler, "grads": None}


class Payload:
    """A global that is neither a tensor's nor MMEngine's nor numpy's."""


def test_anything_else_in_it_is_refused(tmp_path):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = write_mmengine_checkpoint(tmp_path / "epoch_1.pth", model.state_dict(),
                                     optimizer.state_dict(), epoch=1, iters=4,
                                     extra=Payload())
    assert checkpoint_format(path) is MMEngineFile
    with pytest.raises(pickle.UnpicklingError,
                       match=r"refused to load: it holds tests\.compat\.test_checkpoints\."
                             r"Payload"):
        read_weights(path)


def test_load_from_takes_its_weights(mmengine_file, tmp_path):
    runner, recorder = train(tmp_path / "run", load_from=mmengine_file)
    weights = read_weights(mmengine_file)
    assert all(torch.equal(recorder.first_weights[k], v) for k, v in weights.items())
    assert recorder.records[0][0] == 0  # weights only: the run starts at its beginning
    assert len(recorder.records) == 3 * STEPS_PER_EPOCH


def test_resume_goes_on_to_the_losses_of_the_run_that_never_stopped(mmengine_file,
                                                                     uninterrupted, tmp_path):
    _, whole = uninterrupted
    _, resumed = train(tmp_path / "run", load_from=mmengine_file, resume=True)
    assert resumed.records == whole.records[STEPS_PER_EPOCH:]  # iteration, loss and lr
    assert resumed.records[-1][2] == pytest.approx(0.01)  # the milestone after epoch 2


def iteration_run_file(tmp_path: Path) -> tuple[LossRecorder, Path]:
    """An iteration-counting run that never stopped, and its state after 6 iterations (in
    its second epoch) in MMEngine's file."""
    _, whole = train(tmp_path / "whole", **ITERATION_LOOP)
    saved = torch.load(tmp_path / "whole/iter_6.pth", weights_only=True)
    return whole, write_mmengine_checkpoint(tmp_path / "iter_6.pth", saved["model"],
                                            saved["optimizer"], epoch=0, iters=6)


def test_an_iteration_loop_goes_on_where_mmengines_would(tmp_path):
    """MMEngine's IterBasedTrainLoop skips the batches its checkpoint trained, across epochs
    (its checkpoint's epoch is 0): `continue_as_mmengine` puts the data there."""
    whole, path = iteration_run_file(tmp_path)
    _, resumed = train(tmp_path / "resumed", load_from=path, resume=True,
                       runner_type=ResumingAsMMEngine, **ITERATION_LOOP)
    assert resumed.records == whole.records[6:]


def test_the_compat_runner_goes_on_where_mmengine_would(tmp_path):
    whole, path = iteration_run_file(tmp_path)
    _, resumed = train(tmp_path / "resumed", load_from=path, resume=True, **ITERATION_LOOP)
    assert resumed.records == whole.records[6:]


def test_resume_refuses_a_file_of_another_model(tmp_path):
    other = nn.Sequential(nn.Linear(6, 8))
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    path = write_mmengine_checkpoint(tmp_path / "epoch_1.pth", other.state_dict(),
                                     optimizer.state_dict(), epoch=1, iters=4)
    with pytest.raises(ConfigError, match=r"^resume: .* was written by another model"):
        train(tmp_path / "run", load_from=path, resume=True)


# ---------------------------------------------------------------- trainrun to MMEngine


def plain_runner(work_dir: Path, strategy: Any) -> TrainrunRunner:
    return TrainrunRunner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir, strategy=strategy,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 8,
                          "batch_size": 4},
        optim={"type": "SGD", "lr": 0.1}, schedule={"max_iters": 2},
        checkpoint={"interval": 2})


def test_the_compat_strategy_adds_the_weights_mmengine_reads(tmp_path):
    """MMEngineDDP's checkpoint holds the weights under state_dict as well (stored once);
    strategy 'ddp' writes what trainrun's runs always wrote."""
    for name, strategy in (("ddp", "ddp"), ("compat", MMEngineDDP())):
        with plain_runner(tmp_path / name, strategy) as runner:
            runner.train()
    plain = torch.load(tmp_path / "ddp/checkpoints/iter_2.pth", weights_only=True)
    compat = torch.load(tmp_path / "compat/checkpoints/iter_2.pth", weights_only=True)
    assert "state_dict" not in plain
    assert list(compat) == [*plain, "state_dict"]
    assert all(torch.equal(compat["state_dict"][k], v) for k, v in compat["model"].items())
    assert checkpoint_format(tmp_path / "compat/checkpoints/iter_2.pth") is TorchFile
    assert (tmp_path / "compat/checkpoints/iter_2.pth").stat().st_size < \
        (tmp_path / "ddp/checkpoints/iter_2.pth").stat().st_size + 1024


def test_the_compat_runner_writes_them(uninterrupted):
    work_dir, _ = uninterrupted
    saved = torch.load(work_dir / "epoch_1.pth", weights_only=True)
    assert "state_dict" in saved


def test_load_checkpoint_reads_either_kind(mmengine_file, uninterrupted):
    work_dir, _ = uninterrupted
    for path in (mmengine_file, work_dir / "epoch_2.pth"):
        model = Net()
        loaded = load_checkpoint(model, path)
        expected = read_weights(path)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
        assert loaded["state_dict"].keys() == expected.keys()


# ---------------------------------------------------------------- MMEngine itself


def mmengine_version() -> str:
    import mmengine

    return mmengine.__version__


def test_mmengine_reads_the_compat_runs_weights_and_trainrun_reads_mmengines(tmp_path):
    """MMEngine's own ``save_checkpoint`` (with its message hub's real log buffers) and
    ``load_checkpoint`` against trainrun."""
    mmengine_runner = pytest.importorskip(
        "mmengine.runner", reason="MMEngine is not installed (the cross-over with MMEngine "
                                  "itself is checked where it is)")
    from mmengine.logging import MessageHub

    hub = MessageHub.get_instance("test_checkpoints")
    hub.update_scalar("train/loss", 1.25)
    hub.update_info("eta", np.float64(0.5))
    torch.manual_seed(1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "written_by_mmengine.pth"
    mmengine_runner.save_checkpoint({"meta": {"epoch": 1, "iter": 4, "seed": 42,
                                              "mmengine_version": mmengine_version()},
                                     "state_dict": model.state_dict(),
                                     "message_hub": hub.state_dict(),
                                     "optimizer": optimizer.state_dict()}, str(path))
    assert "mmengine.logging.history_buffer.HistoryBuffer" in \
        torch.serialization.get_unsafe_globals_in_checkpoint(path)
    assert checkpoint_format(path) is MMEngineFile
    assert all(torch.equal(read_weights(path)[k], v) for k, v in model.state_dict().items())
    with plain_runner(tmp_path / "compat", MMEngineDDP()) as runner:
        runner.train()
    written = tmp_path / "compat/checkpoints/iter_2.pth"
    from tests.runner.toy import ToyModel

    target = ToyModel()
    mmengine_runner.load_checkpoint(target, str(written), strict=True)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in read_weights(written).items())

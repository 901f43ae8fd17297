"""A checkpoint format written entirely here, plus one registry line, is read by the whole
checkpoint machinery: ``checkpoint_format`` finds it, ``read_weights`` and ``model_shapes``
go through it, ``trainrun export`` exports it, and the runner's ``load_from`` starts from it
(checked against the model first). It is a directory holding the model's weights in one
safetensors file, as another tool might leave them: no strategy writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.runner.toy import ToyModel
from trainrun.checkpoint import TorchFile, checkpoint_format
from trainrun.checkpoint.format import CheckpointFormat, is_checkpoint
from trainrun.checkpoint.read import check_checkpoint_file, model_shapes, read_weights
from trainrun.cli import export as export_tool
from trainrun.registry import FORMATS
from trainrun.runner.config import ConfigError
from trainrun.runner.runner import Runner

WEIGHTS = "model.safetensors"


class SafetensorsDir(CheckpointFormat):
    """A directory with the model's weights in ``model.safetensors``; no train state."""

    name = "safetensors_dir"

    @classmethod
    def owns(cls, path: Path) -> bool:
        return path.is_dir() and (path / WEIGHTS).is_file()

    @classmethod
    def look_inside(cls, path: Path) -> None:
        try:
            with safe_open(path / WEIGHTS, "pt") as f:  # the header only
                list(f.keys())
        except Exception as error:
            raise ValueError(f"{path / WEIGHTS}: not a readable safetensors file") from error

    @classmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        return {"model": load_file(path / WEIGHTS)}

    @classmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        with safe_open(path / WEIGHTS, "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


@pytest.fixture
def weights_dir(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(5)
    state = {key: value.clone() for key, value in ToyModel().state_dict().items()}
    path = tmp_path / "from_another_tool"
    path.mkdir()
    save_file(state, path / WEIGHTS)
    return path, state


def _runner(work_dir: Path, load_from: Path, hidden: int = 16) -> Runner:
    return Runner(model={"type": "tests.runner.toy.ToyModel", "hidden": hidden},
                  work_dir=work_dir, strategy="none",
                  train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 8,
                                    "batch_size": 4},
                  optim={"type": "SGD", "lr": 0.1}, schedule={"max_iters": 1},
                  load_from=str(load_from))


def test_unregistered_it_is_no_checkpoint(weights_dir):
    path, _ = weights_dir
    assert checkpoint_format(path) is TorchFile  # the fallback, which a directory is not
    assert not is_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="a directory that is not a checkpoint"):
        read_weights(path)


def test_registered_the_machinery_reads_it(weights_dir, monkeypatch):
    path, state = weights_dir
    monkeypatch.setitem(FORMATS, "safetensors_dir", SafetensorsDir)  # the registry line
    assert checkpoint_format(path) is SafetensorsDir and is_checkpoint(path)
    assert check_checkpoint_file(path) == path  # what `trainrun train` checks first
    assert checkpoint_format(path / WEIGHTS) is TorchFile  # a file stays a torch file
    weights = read_weights(path)
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[key], value) for key, value in state.items())
    assert model_shapes(path) == {key: tuple(value.shape) for key, value in state.items()}


def test_export_reads_it(weights_dir, monkeypatch, tmp_path, capsys):
    path, state = weights_dir
    out = tmp_path / "model.pt"
    assert export_tool.main([str(path), str(out)]) == 2  # unregistered
    assert "not a checkpoint" in capsys.readouterr().err
    monkeypatch.setitem(FORMATS, "safetensors_dir", SafetensorsDir)
    assert export_tool.main([str(path), str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert all(torch.equal(exported[key], value) for key, value in state.items())


def test_load_from_starts_from_it_and_refuses_it_for_another_model(weights_dir, monkeypatch,
                                                                    tmp_path, capfd):
    path, state = weights_dir
    monkeypatch.setitem(FORMATS, "safetensors_dir", SafetensorsDir)
    with _runner(tmp_path / "run", path) as runner:
        assert runner.start_from == ("load", path)
        runner.load_weights(path)
        loaded = runner.model.state_dict()
        assert all(torch.equal(loaded[key], value) for key, value in state.items())
    err = capfd.readouterr().err
    assert f"{path} has no manifest of hashes" in err and f"loaded weights from {path}" in err
    with pytest.raises(ConfigError, match=rf"^load_from: {path} was written by another "
                                          r"model: net.0.weight has shape \[16, 4\] there, "
                                          r"the model's \[8, 4\]"):
        _runner(tmp_path / "other", path, hidden=8)
    assert not (tmp_path / "other").exists()  # refused before anything is written

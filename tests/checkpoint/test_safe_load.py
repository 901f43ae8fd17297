"""Reading checkpoint files safely: tensors and plain containers come back whole; a crafted
pickle is refused by every reading path (never run), and a damaged file is one line."""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.runner.toy import ToyModel, write_crafted_checkpoint
from trainrun.checkpoint.format import load_state_file
from trainrun.wrappers import SingleDeviceStrategy


def test_load_state_file_reads_tensors_and_plain_containers(tmp_path):
    state = {"model": ToyModel().state_dict(), "meta": {"epoch": 2, "name": "x", "f": 0.5},
             "list": [1, None, (2, 3)], "flag": True}
    torch.save(state, tmp_path / "ok.pth")
    loaded = load_state_file(str(tmp_path / "ok.pth"))
    assert loaded["meta"] == state["meta"] and loaded["list"] == [1, None, (2, 3)]
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())


@pytest.mark.parametrize("raw_pickle", [False, True], ids=["torch_save", "raw_pickle"])
def test_load_state_file_refuses_a_crafted_pickle(tmp_path, monkeypatch, raw_pickle):
    # the payload is live: an ordinary unpickler runs it
    write_crafted_checkpoint(tmp_path / "control.pth", tmp_path / "control-marker", raw_pickle)
    if raw_pickle:
        with open(tmp_path / "control.pth", "rb") as f:
            pickle.load(f)  # the control: the payload works
    else:
        torch.load(tmp_path / "control.pth", weights_only=False)
    assert (tmp_path / "control-marker").exists()

    marker = tmp_path / "marker"
    write_crafted_checkpoint(tmp_path / "evil.pth", marker, raw_pickle)
    # not even the environment switch that turns weights_only off by default helps it
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError):
        load_state_file(str(tmp_path / "evil.pth"))
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):
        SingleDeviceStrategy().load_checkpoint(str(tmp_path / "evil.pth"), ToyModel(), None)
    assert not marker.exists()


def test_load_state_file_calls_any_damaged_file_unreadable(tmp_path):
    """Bytes that are no pickle make torch's weights_only unpickler fail in many ways (an
    IndexError or KeyError from its stack or memo, EOFError, UnpicklingError, ...): every one
    is the same one-line ValueError. 400 seeded random files hit each kind here."""
    import random
    import warnings

    path = tmp_path / "damaged.pth"
    for seed in range(400):
        path.write_bytes(random.Random(seed).randbytes(4096))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about pickle protocols it sees
            with pytest.raises(ValueError, match="not a readable checkpoint"):
                load_state_file(str(path))



"""The checkpoint format 'dcp' (what strategy fsdp writes), read in one process: metadata
that would run code refused, the weights alone, shapes read from the metadata alone, a file
cut short named."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.runner.toy import Payload, ToyModel
from trainrun.checkpoint import DCPDirectory, checkpoint_format
from trainrun.checkpoint.dcp import check_metadata
from trainrun.checkpoint.format import load_state_file
from trainrun.checkpoint.resume import model_mismatch
from trainrun.registry import FORMATS
from trainrun.wrappers import FSDPStrategy


def test_metadata_that_would_run_code_is_refused(tmp_path):
    checkpoint = tmp_path / "iter_1.pth"
    checkpoint.mkdir()
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(pickle.dumps({"x": Payload(str(marker))}))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        check_metadata(checkpoint)
    with pytest.raises(pickle.UnpicklingError):
        load_state_file(str(checkpoint))
    assert not marker.exists()


def _saved_sharded(path: Path, model: nn.Module) -> Path:
    """``model``'s state saved as DCP saves an fsdp checkpoint, in this process alone."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that there is no group
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    return path


def test_the_format_reads_shapes_from_metadata_and_names_a_cut_short_file(tmp_path):
    model = ToyModel(hidden=8)
    checkpoint = _saved_sharded(tmp_path / "iter_1.pth", model)
    assert checkpoint_format(checkpoint) is DCPDirectory is FORMATS[FSDPStrategy.FORMAT]
    weights = DCPDirectory.read_weights(checkpoint)  # the model's alone, in this process
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    shapes = DCPDirectory.model_shapes(checkpoint)
    assert shapes == {"net.0.weight": (8, 4), "net.0.bias": (8,), "net.3.weight": (1, 8),
                      "net.3.bias": (1,)}
    wider = {key: tuple(value.shape) for key, value in ToyModel().state_dict().items()}
    assert model_mismatch(wider, shapes) == ("net.0.weight has shape [8, 4] there, the "
                                             "model's [16, 4]")
    shard = next(checkpoint.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ValueError, match=rf"{shard.name} is truncated: \d+ bytes, the "
                                         r"checkpoint's metadata records \d+"):
        DCPDirectory.look_inside(checkpoint)
    metadata = checkpoint / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"\.metadata is truncated"):
        DCPDirectory.model_shapes(checkpoint)

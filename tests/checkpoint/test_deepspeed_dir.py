"""The checkpoint format 'deepspeed' (DeepSpeed's own directory), read in one process:
shapes from DeepSpeed's records, files cut short named, and the conversion to DeepSpeed's
universal checkpoint forced to weights_only (a crafted partition refused, never run)."""

from __future__ import annotations

import pytest
import torch

from tests.runner.toy import Payload
from trainrun.checkpoint import DeepSpeedDirectory, checkpoint_format
from trainrun.checkpoint.deepspeed_dir import TAG, saved_world_size, universal_copy
from trainrun.checkpoint.train_state import TRAIN_STATE
from trainrun.registry import FORMATS
from trainrun.wrappers import DeepSpeedStrategy


def test_the_conversion_refuses_a_crafted_partition_and_leaves_nothing(tmp_path):
    pytest.importorskip("deepspeed")
    """DeepSpeed's converter reads the partitions with weights_only=False: forced to
    weights_only, a crafted one is refused, never run, and the failure says how to go on."""
    checkpoint = tmp_path / "iter_4.pth"
    (checkpoint / "state").mkdir(parents=True)
    marker = tmp_path / "pwned"
    for rank in range(2):
        torch.save({"optimizer_state_dict": {"zero_stage": 2, "x": Payload(str(marker))}},
                   checkpoint / "state" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    torch.save({"module": {}}, checkpoint / "state" / "mp_rank_00_model_states.pt")
    assert saved_world_size(checkpoint) == 2
    with pytest.raises(RuntimeError) as error, universal_copy(checkpoint, 2):
        pass
    message = str(error.value)
    assert message.startswith(f"resume: {checkpoint} was written by 2 processes and this job "
                              "has 1; converting it to DeepSpeed's universal checkpoint failed")
    assert "refused to load: it holds posix.system" in message
    assert message.endswith("resume on 2 processes, or start from its weights only with "
                            "load_from")
    assert not marker.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["iter_4.pth"]  # no copy left beside it


def test_the_format_reads_shapes_from_deepspeeds_records_and_names_cut_short_files(tmp_path):
    checkpoint = tmp_path / "iter_1.pth"
    (checkpoint / TAG).mkdir(parents=True)
    torch.save({"meta": {"iter": 1}}, checkpoint / TRAIN_STATE)
    states = checkpoint / TAG / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.empty(0), "mean": torch.zeros(3)},  # ZeRO-3: w empty
                "param_shapes": [{"w": torch.Size([5, 2])}], "buffer_names": ["mean"]},
               states)
    assert checkpoint_format(checkpoint) is DeepSpeedDirectory is FORMATS[DeepSpeedStrategy.FORMAT]
    DeepSpeedDirectory.look_inside(checkpoint)
    assert DeepSpeedDirectory.model_shapes(checkpoint) == {"w": (5, 2), "mean": (3,)}
    optim = checkpoint / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {}}, optim)
    optim.write_bytes(optim.read_bytes()[:-30])
    with pytest.raises(ValueError, match=rf"{optim.name} is truncated"):
        DeepSpeedDirectory.read_weights(checkpoint)  # export's and load_from's reading
    states.write_bytes(states.read_bytes()[:-30])
    for read in (DeepSpeedDirectory.look_inside, DeepSpeedDirectory.model_shapes):
        with pytest.raises(ValueError, match=r"mp_rank_00_model_states\.pt is truncated"):
            read(checkpoint)

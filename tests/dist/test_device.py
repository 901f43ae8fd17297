"""Device helpers: which device, the device of nested data, moving nested data."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import trainrun.dist as dist


def test_get_device_is_cpu_without_accelerators():
    assert dist.get_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def _comm_device_body():
    return str(dist.get_comm_device())


def test_comm_device_is_cpu_for_gloo_and_without_group(on_ranks):
    assert set(on_ranks(_comm_device_body)) == {"cpu"}


def test_get_data_device_of_nested_data():
    nested = {"a": torch.ones(1), "b": [torch.zeros(2), (torch.ones(3),)]}
    assert dist.get_data_device(nested) == torch.device("cpu")
    assert dist.get_data_device(torch.ones(1)) == torch.device("cpu")


def test_get_data_device_rejects_mixed_empty_and_non_tensors():
    meta = torch.empty(1, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        dist.get_data_device([torch.ones(1), meta])
    with pytest.raises(ValueError, match="no tensors"):
        dist.get_data_device([])
    mmengine_words = "^data should be a Tensor, sequence of tensor or dict"  # theirs first
    with pytest.raises(TypeError, match=mmengine_words + "; got str: 'text'$"):
        dist.get_data_device([torch.ones(1), "text"])
    with pytest.raises(TypeError, match=mmengine_words + "; got int: 3$"):
        dist.get_data_device(3)


def test_cast_data_device_keeps_container_types():
    data = OrderedDict(x=torch.ones(2), y=(torch.zeros(1), [torch.ones(1)]))
    moved = dist.cast_data_device(data, "meta")
    assert type(moved) is OrderedDict and type(moved["y"]) is tuple and type(moved["y"][1]) is list
    assert dist.get_data_device(moved) == torch.device("meta")


def test_cast_data_device_copies_into_out():
    out = {"a": torch.zeros(2), "b": [torch.zeros(1)]}
    result = dist.cast_data_device({"a": torch.ones(2), "b": [torch.full((1,), 5.0)]}, "cpu", out)
    assert result is out
    assert torch.equal(out["a"], torch.ones(2)) and out["b"][0].item() == 5.0


def test_cast_data_device_rejects_mismatched_out():
    with pytest.raises(TypeError, match="same type"):
        dist.cast_data_device({"a": torch.ones(1)}, "cpu", [torch.zeros(1)])
    with pytest.raises(ValueError, match="same keys"):
        dist.cast_data_device({"a": torch.ones(1)}, "cpu", {"b": torch.zeros(1)})
    with pytest.raises(TypeError, match="^data should be a Tensor, sequence of tensor or dict; "
                                        "got str: 'text'$"):
        dist.cast_data_device("text", "cpu")


def test_map_tensors_reaches_every_tensor_and_keeps_the_containers():
    from collections import namedtuple

    from trainrun.dist.device import map_tensors

    Pair = namedtuple("Pair", "a b")
    data = OrderedDict(x=torch.ones(2), rest=[Pair(torch.zeros(1), "label"), (torch.ones(1), 3)])
    out = map_tensors(data, lambda t: t + 1)
    assert type(out) is OrderedDict and type(out["rest"][0]) is Pair
    assert torch.equal(out["x"], torch.full((2,), 2.0))
    assert torch.equal(out["rest"][0].a, torch.ones(1)) and out["rest"][0].b == "label"
    assert torch.equal(out["rest"][1][0], torch.full((1,), 2.0)) and out["rest"][1][1] == 3

"""pad_sequences, and how a data section's ``collate_fn`` is turned into a function."""

from __future__ import annotations

import functools

import pytest
import torch

from trainrun.runner.builder import build_dataloader, collate_function
from trainrun.runner.collate import pad_sequences
from trainrun.runner.schema import ConfigError


def test_dict_samples_are_padded_with_a_mask_and_other_fields_collated():
    batch = [{"tokens": torch.tensor([1, 2, 3]), "label": 1, "id": "a"},
             {"tokens": torch.tensor([4]), "label": 0, "id": "b"}]
    out = pad_sequences(batch, pad_value=-1)
    assert out["tokens"].tolist() == [[1, 2, 3], [4, -1, -1]]
    assert out["tokens_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert out["label"].tolist() == [1, 0] and out["id"] == ["a", "b"]
    assert list(out) == ["tokens", "label", "id", "tokens_mask"]


def test_tuple_and_tensor_samples_and_trailing_dimensions():
    frames = [torch.ones(2, 3), torch.full((4, 3), 2.0)]
    padded, labels, mask = pad_sequences([(frames[0], 1), (frames[1], 0)])
    assert padded.shape == (2, 4, 3) and padded[0, 2:].eq(0).all() and labels.tolist() == [1, 0]
    assert mask.sum(1).tolist() == [2, 4]
    padded, mask = pad_sequences([torch.arange(3), torch.arange(0)], pad_value=7)
    assert padded.tolist() == [[0, 1, 2], [7, 7, 7]] and mask.sum().item() == 3


def test_keys_choose_the_sequences():
    batch = [{"a": torch.arange(2), "b": torch.arange(2)}, {"a": torch.arange(3),
                                                           "b": torch.arange(2)}]
    out = pad_sequences(batch, keys=["a"])
    assert set(out) == {"a", "b", "a_mask"} and out["b"].shape == (2, 2)
    with pytest.raises(KeyError, match="'c'"):
        pad_sequences(batch, keys=["c"])
    with pytest.raises(TypeError, match="int"):
        pad_sequences([1, 2])


def test_collate_fn_by_name_path_or_mapping_with_options():
    assert collate_function("k", None) is None
    assert collate_function("k", "pad_sequences") is pad_sequences
    assert collate_function("k", "trainrun.runner.collate.pad_sequences") is pad_sequences
    bound = collate_function("k", {"type": "pad_sequences", "pad_value": 5})
    assert isinstance(bound, functools.partial) and bound.keywords == {"pad_value": 5}
    with pytest.raises(ConfigError, match=r"^k: pad_sequences does not take .*'pad_valu'"):
        collate_function("k", {"type": "pad_sequences", "pad_valu": 5})
    with pytest.raises(ConfigError, match=r"^k.type: .*did you mean 'pad_sequences'"):
        collate_function("k", {"type": "pad_sequence"})
    with pytest.raises(ConfigError, match=r"^k: os.sep is a str"):
        collate_function("k", "os.sep")


def test_a_built_loader_uses_the_collate_fn():
    section = {"type": "tests.tools.models.VariableLengthSequences", "size": 6,
               "batch_size": 3, "collate_fn": {"type": "pad_sequences", "pad_value": -1}}
    batch = next(iter(build_dataloader(section, seed=0, train=True, key="data.train")))
    assert batch["tokens"].shape[0] == 3 and (batch["tokens"][~batch["tokens_mask"]] == -1).all()

"""Files a crash never leaves half-written: `replacing` and the tools that write through it."""

from __future__ import annotations

import os

import pytest
import torch

from trainrun.cli import export as export_tool
from trainrun.runner.files import TMP_PREFIX, replacing, write_atomically


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), replacing(target) as tmp:
        tmp.write_bytes(b"half of the ne")
        raise RuntimeError("the disk filled up")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    with replacing(target) as tmp:
        assert tmp.name == TMP_PREFIX + "out.bin" and tmp.suffix == ".bin"  # formats by suffix
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]
    write_atomically(tmp_path / "sub" / "last", "iter_5.pth\n")
    assert (tmp_path / "sub" / "last").read_text() == "iter_5.pth\n"


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_that_fails_midway_leaves_no_file_under_the_name(tmp_path, monkeypatch, fmt):
    out = tmp_path / f"model.{'safetensors' if fmt == 'safetensors' else 'pt'}"
    tensors = {"w": torch.ones(3)}

    def fsync_fails(fd: int) -> None:  # the data never reached the disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError, match="No space left"):
        export_tool.write(tensors, out, fmt, {})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    export_tool.write(tensors, out, fmt, {})
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


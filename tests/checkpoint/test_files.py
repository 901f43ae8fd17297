"""Files a crash never leaves half-written: `replacing` and the tools that write through it."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from trainrun.checkpoint.files import TMP_PREFIX, replacing, write_atomically
from trainrun.cli import export as export_tool
from trainrun.cli.sweep.summary import plot_bars


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



def _plot_metrics_tool():
    """tools/plot_metrics.py as a module (tools/ is scripts, not a package)."""
    path = Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"
    spec = importlib.util.spec_from_file_location("plot_metrics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plots_that_fail_midway_leave_the_old_png(tmp_path, monkeypatch):
    """plot_metrics' curves and the sweep's summary bars: a write that cannot reach the disk
    keeps the old PNG under the name and leaves no temporary beside it."""
    import matplotlib.pyplot as plt

    plot_metrics = _plot_metrics_tool()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    runs = {"run": plot_metrics.read_run(run)}
    plots = {"curves.png": lambda out: plot_metrics.plot(runs, ["train loss"], out),
             "summary.png": lambda out: plot_bars(out, ["a", "b"],
                                                  [("final loss", [0.5, 0.25], True)])}
    for name, draw in plots.items():
        out = tmp_path / name
        out.write_bytes(b"old")

        def fsync_fails(fd: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", fsync_fails)
        with pytest.raises(OSError, match="No space left"):
            draw(out)
        assert out.read_bytes() == b"old"
        assert not plt.get_fignums()  # the failed figure is closed too
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
        monkeypatch.undo()
        draw(out)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

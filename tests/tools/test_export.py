"""tools/export.py: a checkpoint of every strategy (one file, fsdp shards, ZeRO-3 partitions)
becomes one plain state-dict file that a bare model loads; bad input is exit 2."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.runner.toy import ToyModel, flip_byte
from tests.runs import EXPORT_STRATEGIES
from trainrun.cli.export import main, plain_tensors

REPO = Path(__file__).resolve().parents[2]
# (a checkpoint of each strategy, with the weights its model ended with, is the fixture
# export_runs, tests/runs.py)


def _loads_into_a_bare_model(state: dict[str, torch.Tensor]) -> ToyModel:
    model = ToyModel()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("name", list(EXPORT_STRATEGIES))
def test_every_strategy_exports_to_safetensors(export_runs, tmp_path, name):
    work_dir, weights = export_runs[name]
    checkpoint = work_dir / "checkpoints" / "iter_4.pth"
    out = tmp_path / "model.safetensors"
    assert main([str(checkpoint), str(out)]) == 0
    exported = load_file(out)
    _loads_into_a_bare_model(exported)
    assert exported.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(exported[key], value), key
    assert not list(tmp_path.glob(".tmp-*"))


def test_torch_format_dtype_and_a_work_dir(export_runs, tmp_path):
    work_dir, weights = export_runs["fsdp"]
    out = tmp_path / "model.pt"  # torch format from the suffix
    assert main([str(work_dir), str(out), "--dtype", "bf16"]) == 0  # newest checkpoint
    exported = torch.load(out, weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert torch.equal(exported["net.0.weight"], weights["net.0.weight"].to(torch.bfloat16))
    out_st = tmp_path / "model.bin"
    assert main([str(work_dir), str(out_st), "--format", "safetensors"]) == 0
    assert load_file(out_st).keys() == weights.keys()


def test_the_script_runs_as_documented(export_runs, tmp_path):
    work_dir, weights = export_runs["zero3"]
    out = tmp_path / "zero3.safetensors"
    done = subprocess.run([sys.executable, "tools/export.py", str(work_dir / "checkpoints"),
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4 tensors" in done.stdout and str(out) in done.stdout
    assert torch.equal(load_file(out)["net.3.weight"], weights["net.3.weight"])


def test_shared_and_strided_tensors_are_written_whole():
    """Tied weights share storage (safetensors refuses that) and a transposed view is not
    contiguous: both come out as tensors of their own."""
    weight = torch.randn(5, 3)
    state = {"embed.weight": weight, "head.weight": weight, "proj.weight": weight.t()}
    plain = plain_tensors(state)
    assert plain["head.weight"].untyped_storage().data_ptr() != \
        plain["embed.weight"].untyped_storage().data_ptr()
    assert plain["proj.weight"].is_contiguous()
    assert all(torch.equal(plain[k], v) for k, v in state.items())


def test_bad_input_exits_2_with_one_line(export_runs, tmp_path, capsys):
    work_dir, _ = export_runs["ddp"]
    checkpoint = work_dir / "checkpoints" / "iter_4.pth"
    existing = tmp_path / "exists.safetensors"
    existing.write_bytes(b"keep me")
    crafted = tmp_path / "crafted.pth"
    torch.save({"model": {"w": torch.zeros(1)}, "payload": Exception("boom")}, crafted)
    (tmp_path / "plain_dir").mkdir()
    damaged = shutil.copytree(work_dir, tmp_path / "damaged")
    flip_byte(damaged / "checkpoints" / "iter_4.pth")
    truncated = tmp_path / "truncated.pth"  # no manifest beside it: only its reading can tell
    truncated.write_bytes(checkpoint.read_bytes()[:checkpoint.stat().st_size // 2])
    cases = [
        ([str(tmp_path / "missing.pth"), str(tmp_path / "a.safetensors")], "missing.pth"),
        ([str(checkpoint), str(existing)], "--force"),
        ([str(checkpoint), str(tmp_path / "no" / "dir" / "a.pt")], "does not exist"),
        ([str(crafted), str(tmp_path / "b.safetensors")], "Exception"),
        ([str(tmp_path / "plain_dir"), str(tmp_path / "c.safetensors")], "checkpoints/last"),
        ([str(checkpoint), str(tmp_path / "d.pt"), "--dtype", "fp8"], "--dtype"),
        ([str(damaged), str(tmp_path / "e.pt")], f"{damaged}/checkpoints/iter_4.pth is "
         "damaged: iter_4.pth: sha256 mismatch (against iter_4.pth.sha256)"),
        ([str(truncated), str(tmp_path / "f.pt")], f"{truncated} is truncated"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err, (argv, err)
        assert "Traceback" not in err
    assert existing.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crafted.pth", "damaged",
                                                          "exists.safetensors", "plain_dir",
                                                          "truncated.pth"]
    assert main([str(checkpoint), str(existing), "--force"]) == 0


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_an_export_gets_the_permissions_of_any_file_the_user_creates(export_runs, tmp_path, mask,
                                                                     suffix):
    """0o666 less the umask, as ``touch`` would give (safetensors alone creates 0o600)."""
    work_dir, _ = export_runs["ddp"]
    out = tmp_path / f"model{suffix}"
    previous = os.umask(mask)
    try:
        assert main([str(work_dir), str(out)]) == 0
        (tmp_path / "touched").touch()
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE((tmp_path / "touched").stat().st_mode)


def test_export_never_writes_a_training_runs_record(export_runs, tmp_path, capsys):
    work_dir, _ = export_runs["ddp"]
    run = shutil.copytree(work_dir, tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for part in ("train.log", "metrics.jsonl", "config.yaml", "checkpoints/last",
                 "checkpoints/model.pt", "checkpoints/iter_4.pth"):
        assert main([str(run), str(run / part), "--force"]) == 2, part
        err = capsys.readouterr().err
        assert f"OUT {run / part} is part of the record of the training run in {run}" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert main([str(run), str(run / "model.pt")]) == 0  # beside the record: a file of its own

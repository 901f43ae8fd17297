"""tools/export.py: a checkpoint of every strategy (one file, fsdp shards, ZeRO-3 partitions)
becomes one plain state-dict file that a bare model loads; bad input is exit 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.runner.toy import ToyModel, flip_byte
from trainrun.cli.export import main, plain_tensors
from trainrun.runner.runner import Runner

REPO = Path(__file__).resolve().parents[2]
STRATEGIES = {"ddp": "ddp", "fsdp": "fsdp", "zero3": {"type": "deepspeed", "zero_stage": 3}}


def _train_body(work_dir: str, strategy) -> dict[str, torch.Tensor]:
    """Train 4 steps, checkpoint at the end; the whole weights the model ended with."""
    runner = Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                          "batch_size": 4},
        optim={"type": "AdamW", "lr": 0.01}, strategy=strategy,
        schedule={"max_iters": 4}, randomness={"seed": 3},
        logging={"interval": 1, "backends": []}, checkpoint={"interval": 4},
    )
    runner.train()
    state = {k: v.detach().clone() for k, v in runner.strategy.model_state_dict(
        runner.model).items()}
    runner.close()
    return state


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dist_pools) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """One 2-rank run per strategy: its work_dir and its final weights."""
    from tests.procs import DistPool

    pool = dist_pools.setdefault(2, DistPool(2))
    base = tmp_path_factory.mktemp("export")
    out = {}
    for name, strategy in STRATEGIES.items():
        states = pool.run(_train_body, str(base / name), strategy)
        out[name] = (base / name, states[0])
    return out


def _loads_into_a_bare_model(state: dict[str, torch.Tensor]) -> ToyModel:
    model = ToyModel()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_exports_to_safetensors(trained, tmp_path, name):
    work_dir, weights = trained[name]
    checkpoint = work_dir / "checkpoints" / "iter_4.pth"
    out = tmp_path / "model.safetensors"
    assert main([str(checkpoint), str(out)]) == 0
    exported = load_file(out)
    _loads_into_a_bare_model(exported)
    assert exported.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(exported[key], value), key
    assert not list(tmp_path.glob(".tmp-*"))


def test_torch_format_dtype_and_a_work_dir(trained, tmp_path):
    work_dir, weights = trained["fsdp"]
    out = tmp_path / "model.pt"  # torch format from the suffix
    assert main([str(work_dir), str(out), "--dtype", "bf16"]) == 0  # newest checkpoint
    exported = torch.load(out, weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert torch.equal(exported["net.0.weight"], weights["net.0.weight"].to(torch.bfloat16))
    out_st = tmp_path / "model.bin"
    assert main([str(work_dir), str(out_st), "--format", "safetensors"]) == 0
    assert load_file(out_st).keys() == weights.keys()


def test_the_script_runs_as_documented(trained, tmp_path):
    work_dir, weights = trained["zero3"]
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


def test_bad_input_exits_2_with_one_line(trained, tmp_path, capsys):
    work_dir, _ = trained["ddp"]
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

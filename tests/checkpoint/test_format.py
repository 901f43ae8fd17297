"""The shipped checkpoint formats: registered by name, named by the strategies that write
them, found for a checkpoint on disk (the torch file the fallback), and read without any
strategy: trainrun/checkpoint/ imports neither a strategy nor the runner, and DCP or DeepSpeed
only when a checkpoint of theirs is read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

from tests.runner.toy import ToyModel
from trainrun.checkpoint import DCPDirectory, DeepSpeedDirectory, TorchFile, checkpoint_format
from trainrun.checkpoint.format import is_checkpoint
from trainrun.checkpoint.train_state import TRAIN_STATE
from trainrun.registry import FORMATS, STRATEGIES

PACKAGE = Path(__file__).resolve().parents[2] / "trainrun" / "checkpoint"


def test_the_shipped_formats_are_registered_and_every_strategy_names_one():
    assert {name: FORMATS[name] for name in ("torch_file", "dcp", "deepspeed")} == {
        "torch_file": TorchFile, "dcp": DCPDirectory, "deepspeed": DeepSpeedDirectory}
    assert all(FORMATS[name].name == name for name in FORMATS)
    assert {name: STRATEGIES[name].FORMAT for name in STRATEGIES} == {
        "none": "torch_file", "ddp": "torch_file", "separate_ddp": "torch_file",
        "fsdp": "dcp", "deepspeed": "deepspeed"}


def test_a_checkpoint_on_disk_is_found_in_its_format(tmp_path):
    file = tmp_path / "iter_1.pth"
    torch.save({"model": ToyModel().state_dict()}, file)
    dcp = tmp_path / "iter_2.pth"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    (dcp / TRAIN_STATE).write_bytes(b"")
    deepspeed = tmp_path / "iter_3.pth"
    (deepspeed / "state").mkdir(parents=True)
    (deepspeed / "state" / "mp_rank_00_model_states.pt").write_bytes(b"")
    plain = tmp_path / "checkpoints"
    plain.mkdir()
    assert [checkpoint_format(p) for p in (file, dcp, deepspeed, plain)] == [
        TorchFile, DCPDirectory, DeepSpeedDirectory, TorchFile]
    assert [is_checkpoint(p) for p in (file, dcp, deepspeed, plain, tmp_path / "none")] == [
        True, True, True, False, False]
    assert TorchFile.model_shapes(file) == {k: tuple(v.shape) for k, v in
                                            ToyModel().state_dict().items()}


def test_reading_a_checkpoint_imports_no_strategy():
    code = """if True:
        import sys
        import torch
        from trainrun.checkpoint import checkpoint_format
        from trainrun.checkpoint.read import read_weights
        path = sys.argv[1]
        torch.save({"model": {"w": torch.ones(2)}}, path)
        assert checkpoint_format(path).__name__ == "TorchFile"
        assert read_weights(path)["w"].tolist() == [1.0, 1.0]
        loaded = [m for m in sys.modules if m.startswith(("trainrun.wrappers", "trainrun.runner",
                                                          "trainrun.cli", "deepspeed",
                                                          "torch.distributed.checkpoint"))]
        print(loaded)
    """
    out = subprocess.run([sys.executable, "-c", code, str(Path("/tmp") / "trainrun-fmt.pt")],
                         capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def _imported(nodes) -> list[str]:
    return [name for node in nodes for name in (
        [alias.name for alias in node.names] if isinstance(node, ast.Import)
        else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])]


def test_the_package_imports_nothing_above_it():
    """Layering: cli -> runner -> wrappers -> checkpoint -> dist; DeepSpeed and DCP are
    imported inside the functions that read their checkpoints, never on import."""
    for module in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(module.read_text())
        for name in _imported(ast.walk(tree)):
            assert not name.startswith(("trainrun.wrappers", "trainrun.runner",
                                        "trainrun.cli")), f"{module.name} imports {name}"
        for name in _imported(tree.body):
            assert not name.startswith(("deepspeed", "torch.distributed.checkpoint")), \
                f"{module.name} imports {name} on import"

"""MMEngine's flexible-runner example, as its users bring it (scripts/flexible_example.py), runs
on 2 processes under each of its three strategies: DDP, FSDP and DeepSpeed ZeRO-3 with fp16."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.cli import run
from trainrun.dist.launch import free_port

SCRIPT = Path(__file__).parent / "scripts" / "flexible_example.py"


def deepspeed_has_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator runs fp16 here, as it decides (without importing
    DeepSpeed into the test's process)."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


@pytest.mark.slow
@pytest.mark.parametrize("option", ["", "--use-fsdp", "--use-deepspeed"])
def test_the_flexible_runner_example_trains_under_each_strategy(tmp_path: Path, option: str):
    done = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), str(SCRIPT), "--work-dir", str(tmp_path),
                *filter(None, [option])])
    if option == "--use-deepspeed" and not deepspeed_has_fp16():
        # the example's fp16 needs CPU fp16 kernels (oneDNN on AVX512-FP16 or AMX); without
        # them DeepSpeed refuses, and the user is told so in one line
        assert "exitcode  : 2" in done.stderr, done.stderr[-3000:]  # as torchrun reports
        assert "error: Type fp16 is not supported on your device." in done.stderr.splitlines()
        pytest.skip("DeepSpeed has no fp16 on this CPU: the refusal was checked, not training")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]  # MMEngine's default: every 10
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert [line["step"] for line in lines if line.get("mode") == "val"] == [2, 4, 6]
    newest = Path((tmp_path / "last_checkpoint").read_text())
    assert newest.name.startswith("epoch_3") and newest.exists()

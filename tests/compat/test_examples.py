"""MMEngine's flexible-runner example, as its users bring it (scripts/flexible_example.py), runs
on 2 processes under each of its three strategies: DDP, FSDP and DeepSpeed ZeRO-3 with fp16."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.cli import run
from trainrun.dist.launch import free_port

SCRIPT = Path(__file__).parent / "scripts" / "flexible_example.py"


def deepspeed_has_fp16() -> bool:
    """Whether DeepSpeed's accelerator runs fp16 here (on a CPU: only with AVX512-FP16 or
    AMX)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()


@pytest.mark.slow
@pytest.mark.parametrize("option", ["", "--use-fsdp", "--use-deepspeed"])
def test_the_flexible_runner_example_trains_under_each_strategy(tmp_path: Path, option: str):
    done = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), str(SCRIPT), "--work-dir", str(tmp_path),
                *filter(None, [option])])
    if option == "--use-deepspeed" and not deepspeed_has_fp16():
        # the example's fp16 is refused in one line, naming the key it maps to
        assert "exitcode  : 2" in done.stderr, done.stderr[-3000:]  # as torchrun reports
        assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
            "error: precision: 'fp16': DeepSpeed runs fp16 on a CPU only with oneDNN's fp16 "
            "kernels (AVX512-FP16 or AMX), which this CPU lacks; use bf16 or fp32"]
        pytest.skip("DeepSpeed has no fp16 on this CPU: the refusal was checked, not training")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]  # MMEngine's default: every 10
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert [line["step"] for line in lines if line.get("mode") == "val"] == [2, 4, 6]
    newest = Path((tmp_path / "last_checkpoint").read_text())
    assert newest.name.startswith("epoch_3") and newest.exists()

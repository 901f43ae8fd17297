"""A compiled run (inductor, ddp on 2 ranks) that crashes and resumes logs the losses of one
that never stopped, bit for bit, and its checkpoints keep the uncompiled model's keys; each
strategy compiles the modules it says it does.
(The same run against an uncompiled one, and fsdp, through the command line:
tests/tools/test_compile_cli.py.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from tests.records import losses
from tests.runner.toy import straight_crash_resume
from trainrun.examples.digits import DigitsMLP
from trainrun.examples.gan import ToyGAN
from trainrun.runner import Runner
from trainrun.runner.config import load_config
from trainrun.wrappers import DDPStrategy, FSDPStrategy, SeparateDDPStrategy, SingleDeviceStrategy

CONFIG = """\
model: {type: DigitsMLP, hidden: 64}   # dropout 0.1: compiled dropout must draw as eager's
data:
  train: {type: digits, batch_size: 32}
strategy: {type: ddp}
compile: true
optim: {type: AdamW, lr: 1.0e-3}
schedule: {max_iters: 12}
logging: {interval: 1, backends: [jsonl]}
checkpoint: {interval: 4}
"""



def _train_crash_resume(config: str, root: str) -> None:
    """On every rank: a compiled run straight through, and one that crashes after step 6
    then resumes; then the crashed run's checkpoint loaded into an uncompiled run."""
    def runner(name: str, *overrides: str, **more: Any) -> Runner:
        return Runner.from_cfg(load_config(config, [f"work_dir={root}/{name}", *overrides],
                                           values=more))

    straight_crash_resume(runner)
    with runner("uncompiled", "compile=false", "schedule.max_iters=1",
                f"load_from={root}/crashed/checkpoints/iter_4.pth") as run:
        run.train()


@pytest.mark.slow
def test_a_compiled_run_resumes_exactly_after_a_crash(run_on, tmp_path):
    config = tmp_path / "compiled.yaml"
    config.write_text(CONFIG)
    run_on(2)(_train_crash_resume, str(config), str(tmp_path), timeout=300)  # compiling
    log = (tmp_path / "crashed" / "train.log").read_text()
    assert re.search(r"resumed from \S+/iter_4\.pth at epoch 1, step 4\n", log), log
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "crashed")
    assert sorted(resumed) == list(range(1, 13)) and resumed == straight  # bit for bit
    checkpoint = torch.load(tmp_path / "crashed" / "checkpoints" / "iter_12.pth",
                            weights_only=True)
    assert list(checkpoint["model"]) == list(DigitsMLP(hidden=64).state_dict())
    assert "loaded weights from" in (tmp_path / "uncompiled" / "train.log").read_text()


def _compiled(model: torch.nn.Module) -> list[str]:
    """The names of the modules whose forward `compile_module` replaced."""
    return [name or "model" for name, module in model.named_modules()
            if "forward" in vars(module)]


@pytest.mark.parametrize(("strategy", "model", "expected"), [
    (SingleDeviceStrategy(), DigitsMLP(), ["model"]),
    (DDPStrategy(), DigitsMLP(), ["model"]),
    (SeparateDDPStrategy(), ToyGAN(), ["generator", "discriminator"]),
    (FSDPStrategy(), DigitsMLP(), ["model"]),  # no shard unit named: the whole model
    (FSDPStrategy(wrap={"classes": ["Linear"]}), DigitsMLP(), ["net.0", "net.3"]),
], ids=["none", "ddp", "separate_ddp", "fsdp", "fsdp-units"])
def test_each_strategy_compiles_what_it_says(strategy, model, expected):
    """In one process (no group, nothing wrapped), with the eager backend (no code made)."""
    keys = list(model.state_dict())
    strategy.use_compile({"backend": "eager"})
    built, _ = strategy.setup(model, torch.device("cpu"), None)
    assert _compiled(strategy.unwrap(built)) == expected
    assert list(strategy.model_state_dict(built)) == keys

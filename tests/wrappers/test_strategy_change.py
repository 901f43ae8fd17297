"""A run resumed under another strategy carries on exactly: each segment of a run is trained
under another strategy (ddp, fsdp, DeepSpeed ZeRO-1/2/3), resuming from the checkpoint the
one before it wrote, and the whole run logs the losses of a run that never stopped, bit for
bit, on the same 2 gloo ranks. What carries: the weights, the optimiser's moments, step
counts and parameter groups (two here: the biases without weight decay), the scheduler
(a warmup, then cosine), the RNG (the model has dropout) and the data position. A pair that
cannot carry on exactly is refused before anything is written."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from tests.records import loss_list
from tests.runner.toy import CrashAfter, Killed
from trainrun.checkpoint.deepspeed_dir import deepspeed_change_refusal
from trainrun.runner.config import ConfigError
from trainrun.runner.runner import Runner

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2]
                                                   / ".venv" / "torch_extensions"))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed")]

# 12 steps (an epoch is 4 on 2 ranks of 4), a checkpoint every 3: each segment of the chained
# run dies one step after a checkpoint, which the next segment resumes from
STEPS, INTERVAL = 12, 3
STRATEGIES = {"ddp": {"type": "ddp"}, "fsdp": {"type": "fsdp"},
              **{f"zero{stage}": {"type": "deepspeed", "zero_stage": stage}
                 for stage in (1, 2, 3)}}


def _runner(work_dir: str, strategy: str | dict[str, Any], accumulate: int = 1,
            **more: Any) -> Runner:
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                          "batch_size": 4},
        optim={"type": "AdamW", "lr": 0.01, "weight_decay": 0.1, "accumulate": accumulate,
               "paramwise": {"bias_decay_mult": 0.0}},
        scheduler={"type": "cosine", "warmup_iters": 3},
        strategy=STRATEGIES.get(strategy, strategy) if isinstance(strategy, str) else strategy,
        schedule={"max_iters": STEPS}, randomness={"seed": 7},
        logging={"interval": 1, "backends": ["jsonl"]}, checkpoint={"interval": INTERVAL},
        **more)


def _chain_body(root: str, chain: list[str]) -> None:
    """A straight run under the chain's first strategy, then the chained run: segment n
    under ``chain[n]``, killed after step 3n + 1 and resumed from step 3n by the next."""
    with _runner(f"{root}/straight", chain[0]) as runner:
        runner.train()
    for number, strategy in enumerate(chain):
        last = number == len(chain) - 1
        hooks = [] if last else [CrashAfter(INTERVAL * (number + 1) + 1)]
        with _runner(f"{root}/chained", strategy, resume=number > 0, hooks=hooks) as runner:
            if last:
                runner.train()
            else:
                with pytest.raises(Killed):
                    runner.train()


@pytest.mark.parametrize("chain", [["ddp", "fsdp", "zero3", "ddp"],
                                   ["zero1", "fsdp", "zero2", "zero3"]],
                         ids=lambda chain: "-".join(chain))
def test_a_run_resumed_under_other_strategies_logs_the_unbroken_runs_losses(run_on, tmp_path,
                                                                            chain):
    run_on(2)(_chain_body, str(tmp_path), chain)
    straight, chained = loss_list(tmp_path / "straight"), loss_list(tmp_path / "chained")
    assert [step for step, _ in straight] == list(range(1, STEPS + 1))
    assert chained == straight  # ==: bit for bit
    log = (tmp_path / "chained" / "train.log").read_text()
    for number, (before, after) in enumerate(zip(chain, chain[1:], strict=False), 1):
        names = [STRATEGIES[name]["type"] for name in (before, after)]
        where = tmp_path / "chained" / "checkpoints" / f"iter_{INTERVAL * number}.pth"
        step = INTERVAL * number  # an epoch is 4 steps
        said = f"resumed from {where} at epoch {step // 4 + 1}, step {step}"
        if names[0] != names[1]:
            said += f" (written under strategy {names[0]!r}, carried on under {names[1]!r})"
        assert said + "\n" in log


def _refused_body(root: str) -> list[str]:
    """A ddp run's checkpoint of step 3 resumed under ZeRO-2 with an accumulation group of 2
    (step 3 is inside one), and under DeepSpeed without ZeRO: each refusal's message."""
    with _runner(f"{root}/ddp", "ddp", hooks=[CrashAfter(4)]) as runner, \
            pytest.raises(Killed):
        runner.train()
    checkpoint = f"{root}/ddp/checkpoints/iter_3.pth"
    refusals = []
    for strategy, accumulate in (("zero2", 2), ({"type": "deepspeed", "zero_stage": 0}, 1)):
        with pytest.raises(ConfigError) as refused:
            _runner(f"{root}/refused", strategy, accumulate, resume=checkpoint).close()
        refusals.append(str(refused.value))
    return refusals


def test_a_change_that_cannot_carry_on_exactly_is_refused_before_anything_is_written(
        run_on, tmp_path):
    refusals = run_on(2)(_refused_body, str(tmp_path))[0]
    checkpoint = tmp_path / "ddp" / "checkpoints" / "iter_3.pth"
    assert refusals == [
        f"resume: {checkpoint}: it was written under strategy 'ddp' at step 3, inside an "
        f"accumulation group of 2 micro-steps whose gradients do not carry to or from "
        f"DeepSpeed: resume it under strategy 'ddp', or from a checkpoint at a multiple of "
        f"optim.accumulate",
        f"resume: {checkpoint}: strategy 'deepspeed' without ZeRO (zero_stage 0) takes only "
        f"its own checkpoints: resume with strategy.zero_stage 1, 2 or 3, or under the "
        f"strategy that wrote it"]
    assert not (tmp_path / "refused").exists()


def test_under_fp16_the_loss_scale_does_not_carry_to_or_from_deepspeed():
    meta = {"meta": {"strategy": "fsdp", "iter": 6}}
    assert deepspeed_change_refusal(meta, "fp16", 1) == (
        "it was written under strategy 'fsdp', and under fp16 the loss scale does not carry "
        "between DeepSpeed's scaler and torch's: resume it under strategy 'fsdp', or in bf16 "
        "or fp32")
    assert deepspeed_change_refusal(meta, "bf16", 1) is None
    assert deepspeed_change_refusal(meta, "fp32", 3) is None  # 6 is a multiple of 3

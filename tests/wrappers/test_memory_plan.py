"""The memory plan (`Strategy.memory_plan`, printed by ``--dry-run``): each rank's bytes of
parameters, gradients and optimiser state, planned on the meta device and checked against what
2 real gloo ranks hold after training steps under ddp, fsdp (tensor parallel too) and ZeRO
stages 1-3."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch

from tests.plans import plan_and_measure
from trainrun.cli import train as train_tool
from trainrun.runner.optim.factory import _STATES, state_tensors
from trainrun.wrappers import STRATEGIES as STRATEGY_CLASSES
from trainrun.wrappers.memory import KINDS, param_specs

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2]
                                                   / ".venv" / "torch_extensions"))
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SEVEN_B = ["model.n_embd=4096", "model.n_head=32", "model.n_layer=34", "model.block_size=2048"]
GIB = 2 ** 30


@pytest.mark.parametrize("options", [
    {"type": "Adam"}, {"type": "AdamW", "amsgrad": True}, {"type": "Adamax"}, {"type": "NAdam"},
    {"type": "RAdam"}, {"type": "Adadelta"}, {"type": "Adagrad"}, {"type": "SGD"},
    {"type": "SGD", "momentum": 0.9}, {"type": "RMSprop"},
    {"type": "RMSprop", "momentum": 0.9, "centered": True},
], ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_optimiser_state_count_is_what_torch_keeps(options):
    param = torch.nn.Parameter(torch.randn(3, 5))
    optimizer = getattr(torch.optim, options["type"])(
        [param], lr=0.01, **{k: v for k, v in options.items() if k != "type"})
    for _ in range(2):
        param.grad = torch.randn(3, 5)
        optimizer.step()
    kept = [t for t in optimizer.state[param].values()
            if isinstance(t, torch.Tensor) and t.shape == param.shape]
    assert state_tensors(options) == len(kept)
    assert options["type"] in _STATES


def _dry_run(capsys, config: str, *args: str) -> tuple[int, str, str]:
    code = train_tool.main([str(CONFIGS / config), "--dry-run", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _figure(text: str, label: str) -> float:
    """Bytes of ``label`` ('params', 'grads', 'optimiser state') on the plan's per-rank line."""
    line = re.search(r"per rank: (.*)", text).group(1)
    number, unit = re.search(rf"{label} ([\d.]+) (\w+)", line).groups()
    return float(number) * 2 ** {"B": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}[unit]


@pytest.mark.parametrize(("config", "params_per_rank", "grads"), [
    # fp32 partitions; ZeRO-3 copies its gradient partition for the step
    ("tinylm_deepspeed_zero3.yaml", lambda n: n * 4 / 64, 2),
    ("tinylm_fsdp.yaml", lambda n: n * 4 / 64, 1),
    ("tinylm_ddp.yaml", lambda n: n * 4, 1),
])
def test_a_7b_model_for_64_ranks_is_planned_in_seconds(capsys, config, params_per_rank, grads):
    start = time.perf_counter()
    code, out, err = _dry_run(capsys, config, "--world-size", "64", "--cfg-options", *SEVEN_B)
    took = time.perf_counter() - start
    assert code == 0, err
    assert took < 20, f"the plan took {took:.1f} s"
    total = int(re.search(r"([\d,]+) parameters \(all trainable\)", out).group(1).replace(",", ""))
    assert 6.5e9 < total < 7.5e9
    assert "world size   64 (given)" in out and "effective 32 x 64 ranks" in out
    params = _figure(out, "params")
    assert params == pytest.approx(params_per_rank(total), rel=0.03)  # + ZeRO's kept-whole
    assert _figure(out, "grads") == pytest.approx(grads * params_per_rank(total), rel=0.03)
    assert _figure(out, "optimiser state") == pytest.approx(2 * params_per_rank(total),
                                                            rel=0.03)  # AdamW
    assert "for the job (64 ranks)" in out and "not counted: activations" in out


def test_offloaded_state_is_shown_on_the_cpu_and_an_unknown_optimiser_is_said(capsys):
    code, out, _ = _dry_run(capsys, "tinylm_deepspeed_zero3.yaml", "--world-size", "8",
                            "--cfg-options", "strategy.offload_optimizer=true")
    assert code == 0
    cpu = re.search(r"per rank on the CPU \(offloaded\): (.*)", out).group(1)
    assert "params 0 B" not in cpu and "optimiser state 0 B" not in cpu
    assert "optimiser state 0 B" in re.search(r"per rank: (.*)", out).group(1)
    code, out, err = _dry_run(capsys, "tinylm_ddp.yaml", "--cfg-options", "optim.type=ASGD")
    assert code == 0, err
    assert "optimiser state not known" in out and "+ the optimiser's state" in out


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_world_size_is_exit_2_naming_the_flag(capsys, value):
    code, _, err = _dry_run(capsys, "tinylm_ddp.yaml", "--world-size", value)
    assert code == 2 and "--world-size" in err


def test_an_option_the_model_refuses_is_exit_2_in_the_plan_too(capsys):
    code, out, err = _dry_run(capsys, "tinylm_fsdp.yaml", "--world-size", "4", "--cfg-options",
                              "strategy.wrap={classes: [Nope]}")
    assert code == 2 and not out
    assert err == "error: strategy.wrap.classes: the model has no module of class 'Nope'\n"


def test_world_size_without_dry_run_is_refused(capsys):
    code = train_tool.main([str(CONFIGS / "tinylm_ddp.yaml"), "--world-size", "4"])
    assert code == 2 and "--world-size" in capsys.readouterr().err


# ---------------------------------------------------------------- planned against measured

CONFIG = """\
model: {type: tests.runner.toy.ToyModel, features: 256, hidden: 512, dropout: 0.0}
data:
  train: {type: tests.runner.toy.ToyRegression, size: 16, features: 256, batch_size: 4}
  val: null
optim: {type: AdamW, lr: 0.001}
schedule: {max_iters: 2}
logging: {interval: 1, backends: [jsonl]}
checkpoint: {interval: 0, save_last: false}
launcher: pytorch
"""

STRATEGIES = {
    "ddp": ["strategy.type=ddp"],
    "fsdp": ["strategy.type=fsdp"],
    # tensor parallel over both ranks (no data parallelism left): the split layers halve
    "fsdp-tp2": ["strategy.type=fsdp", "strategy.tp=2",
                 "strategy.tp_plan={net.0: colwise, net.3: rowwise}"],
    "zero0-bf16": ["strategy.type=deepspeed", "strategy.zero_stage=0", "precision=bf16"],
    "zero1": ["strategy.type=deepspeed", "strategy.zero_stage=1"],
    "zero2": ["strategy.type=deepspeed", "strategy.zero_stage=2"],
    "zero3": ["strategy.type=deepspeed", "strategy.zero_stage=3"],
    "zero3-bf16": ["strategy.type=deepspeed", "strategy.zero_stage=3", "precision=bf16"],
    # offloaded: the CPU is this machine's device too, so the kinds' totals are compared
    "fsdp-offload": ["strategy.type=fsdp", "strategy.cpu_offload=true"],
    "zero2-offload": ["strategy.type=deepspeed", "strategy.zero_stage=2",
                      "strategy.offload_optimizer=true"],
    "zero3-offload": ["strategy.type=deepspeed", "strategy.zero_stage=3",
                      "strategy.offload_optimizer=true", "strategy.offload_param=true"],
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_plan_is_within_10_percent_of_what_2_ranks_hold(run_on, tmp_path, name):
    """The plan is the most any rank holds: set beside the measured rank that holds most."""
    if name.startswith("zero"):
        pytest.importorskip("deepspeed")
    config = tmp_path / "toy.yaml"
    config.write_text(CONFIG)
    results = run_on(2)(plan_and_measure, str(config), STRATEGIES[name], str(tmp_path / "run"))
    planned = results[0][0]
    assert all(plan == planned for plan, _ in results)  # every rank plans the same
    for kind in KINDS:
        held = max(measured[kind] for _, measured in results)
        assert held > 0 and planned[kind] == pytest.approx(held, rel=0.10), (kind, results)


def test_frozen_parameters_have_no_gradient_or_optimiser_state():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))
    model[0].requires_grad_(False)
    specs = param_specs(model, lambda name: 2)
    cfg = {"strategy": {"type": "fsdp"}, "optim": {"type": "AdamW"}, "precision": "fp32"}
    whole, half = 10100 * 4, 10100 * 4 // 2
    ddp = STRATEGY_CLASSES["ddp"].memory_plan(specs, 2, cfg)
    assert (ddp.kind("params"), ddp.kind("grads"), ddp.kind("optim")) == (2 * whole, whole,
                                                                         2 * whole)
    fsdp = STRATEGY_CLASSES["fsdp"].memory_plan(specs, 2, cfg, model)
    assert (fsdp.kind("params"), fsdp.kind("grads"), fsdp.kind("optim")) == (2 * half, half,
                                                                           2 * half)

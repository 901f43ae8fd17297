"""Strategy 'fsdp' (`fully_shard`) on real gloo ranks: sharding, equivalence with DDP, sharded
checkpoints that reshard (2 -> 3 -> 2 ranks). What every strategy's checkpoints promise (exact
resume, weights across strategies, damage): tests/wrappers/test_conformance.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.records import assert_same_norms, grad_norms, loss_list
from tests.runner.toy import CrashAfter, Killed, ToyModel, newest
from trainrun.checkpoint.format import load_state_file
from trainrun.checkpoint.manager import CheckpointManager
from trainrun.runner.config import load_config
from trainrun.runner.hooks import Hook
from trainrun.runner.runner import Runner
from trainrun.wrappers import STRATEGIES, is_model_wrapper
from trainrun.wrappers.fsdp import (
    FSDPStrategy,
    MMFullyShardedDataParallel,
    mixed_precision_policy,
    shard_units,
)

DATASET = "tests.runner.toy.ToyRegression"
REPO = Path(__file__).resolve().parents[2]


class Seen(Hook):
    """Records (epoch, step, sample indices of this rank) after every training step."""

    def __init__(self):
        self.records = []

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        self.records.append((runner.epoch, runner.iter, batch["index"].tolist()))


def _runner(work_dir, strategy="fsdp", *, max_iters=8, size=64, checkpoint=None, resume=False,
            hooks=(), hidden=16, optim=None):
    return Runner(
        model={"type": "tests.runner.toy.ToyModel", "hidden": hidden},
        work_dir=work_dir,
        train_dataloader={"type": DATASET, "size": size, "batch_size": 4},
        optim=optim or {"type": "AdamW", "lr": 0.01},
        scheduler={"type": "cosine", "warmup_iters": 3},
        strategy=strategy, schedule={"max_iters": max_iters},
        randomness={"seed": 7},
        logging={"interval": 1, "backends": ["jsonl"]},
        checkpoint=checkpoint or {"interval": 0}, resume=resume, hooks=hooks,
    )



def _train_body(work_dir, strategy, max_iters, optim=None):
    runner = _runner(work_dir, strategy, max_iters=max_iters, optim=optim)
    runner.train()
    wrapped = is_model_wrapper(runner.model)
    runner.close()
    return wrapped


# ---------------------------------------------------------------- options, one process

def test_registered_and_options_validated():
    assert STRATEGIES["fsdp"] is FSDPStrategy
    with pytest.raises(ValueError, match="no option 'zero_stage'"):
        FSDPStrategy(zero_stage=3)
    with pytest.raises(ValueError, match="param_dtype"):
        mixed_precision_policy({"param_dtyp": "bf16"})
    with pytest.raises(ValueError, match="must be one of"):
        mixed_precision_policy({"param_dtype": "int8"})
    policy = mixed_precision_policy({"param_dtype": "bf16", "reduce_dtype": "fp32"})
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_shard_units_by_class_and_size():
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 64)),
                          nn.Linear(64, 1))
    assert shard_units(model, None) == []
    assert shard_units(model, {"classes": ["Linear"]}) == [model[0], model[2][0], model[3]]
    # the inner Sequential's Linear takes its 4160 parameters: the Sequential has none left
    assert shard_units(model, {"min_params": 300}) == [model[0], model[2][0]]
    with pytest.raises(ValueError, match="no module of class 'Block'"):
        shard_units(model, {"classes": ["Block"]})
    with pytest.raises(ValueError, match="classes and min_params"):
        shard_units(model, {"class": ["Linear"]})


def test_single_process_trains_unwrapped(run_on, tmp_path):
    assert run_on(1)(_train_body, str(tmp_path / "a"), "fsdp", 6) == [False]
    assert len(loss_list(tmp_path / "a")) == 6


def test_switching_a_ddp_config_to_fsdp(tmp_path):
    warnings = []
    cfg = load_config(REPO / "configs" / "digits_ddp.yaml", ["strategy.type=fsdp"],
                      on_warning=warnings.append)
    assert cfg.strategy.type == "fsdp" and cfg.strategy.sharding == "full"
    ignored = [w for w in warnings if "ignored for 'fsdp'" in w]
    assert sorted(ignored) == [
        "strategy.broadcast_buffers is a 'ddp'/'separate_ddp' option; ignored for 'fsdp'",
        "strategy.find_unused_parameters is a 'ddp'/'separate_ddp' option; ignored for 'fsdp'",
    ]


# ---------------------------------------------------------------- sharding, 2 and 3 ranks

def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
               for t in tensors)


def _memory_body():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    full = _local_bytes(model.parameters())
    sharded = MMFullyShardedDataParallel(model, wrap={"classes": ["Linear"]})
    optimizer = torch.optim.Adam(sharded.module.parameters())
    sharded(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    params = _local_bytes(sharded.module.parameters())
    grads = _local_bytes(p.grad for p in sharded.module.parameters())
    states = _local_bytes(t for s in optimizer.state.values() for t in s.values()
                          if t.dim() > 0)
    return full, params, grads, states


@pytest.mark.parametrize("world_size", [2, 3])
def test_per_rank_bytes_are_a_1_over_n_share(run_on, world_size):
    for full, params, grads, states in run_on(world_size)(_memory_body):
        limit = full / world_size * 1.1
        assert params <= limit and grads <= limit and states <= 2 * limit, (full, params)


def test_fsdp_losses_equal_ddp_for_40_steps(run_on, tmp_path):
    assert run_on(2)(_train_body, str(tmp_path / "ddp"), "ddp", 40) == [True, True]
    run_on(2)(_train_body, str(tmp_path / "fsdp"), "fsdp", 40)
    ddp, fsdp = loss_list(tmp_path / "ddp"), loss_list(tmp_path / "fsdp")
    assert [s for s, _ in fsdp] == list(range(1, 41))
    for (step, a), (_, b) in zip(ddp, fsdp, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b)
    # the logged gradient norm (no clipping: measured for the log) is the whole gradient's
    assert sorted(grad_norms(tmp_path / "fsdp")) == list(range(1, 41))
    assert_same_norms(grad_norms(tmp_path / "ddp"), grad_norms(tmp_path / "fsdp"))


@pytest.mark.parametrize("options", [
    {"sharding": "grad_op"},
    {"sharding": "none"},
    {"sharding": "hybrid", "hybrid_shard_size": 1},
    {"wrap": {"classes": ["Linear"]}, "activation_checkpointing": True, "cpu_offload": True},
    {"wrap": {"min_params": 50}, "mixed_precision": {"param_dtype": "bf16",
                                                     "reduce_dtype": "fp32"}},
], ids=["grad_op", "none", "hybrid", "wrap_ckpt_offload", "bf16"])
def test_every_option_trains(run_on, tmp_path, options):
    run_on(2)(_train_body, str(tmp_path / "ddp"), "ddp", 6)
    run_on(2)(_train_body, str(tmp_path / "fsdp"), {"type": "fsdp", **options}, 6)
    ddp, fsdp = loss_list(tmp_path / "ddp"), loss_list(tmp_path / "fsdp")
    tolerance = 5e-2 if "mixed_precision" in options else 1e-4
    for (step, a), (_, b) in zip(ddp, fsdp, strict=True):
        assert abs(a - b) <= tolerance * abs(a), (step, a, b)


@pytest.mark.parametrize("clip_grad", [{"max_norm": 0.5}, {"clip_value": 0.05}],
                         ids=["norm", "value"])
def test_accumulation_and_clipping_match_ddp(run_on, tmp_path, clip_grad):
    """Micro-steps that do not step skip the reduce-scatter (no_sync); clipping sees the
    norm over every rank's shards, or clips each value of each shard."""
    optim = {"type": "AdamW", "lr": 0.01, "accumulate": 2, "clip_grad": clip_grad}
    run_on(2)(_train_body, str(tmp_path / "ddp"), "ddp", 10, optim)
    run_on(2)(_train_body, str(tmp_path / "fsdp"), "fsdp", 10, optim)
    ddp, fsdp = loss_list(tmp_path / "ddp"), loss_list(tmp_path / "fsdp")
    assert len(fsdp) == 10
    for (step, a), (_, b) in zip(ddp, fsdp, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b)
    assert sorted(grad_norms(tmp_path / "fsdp")) == [2, 4, 6, 8, 10]  # the steps that stepped
    assert_same_norms(grad_norms(tmp_path / "ddp"), grad_norms(tmp_path / "fsdp"))


def test_checkpoint_manager_publishes_and_cleans_directories(tmp_path):
    manager = CheckpointManager(tmp_path, FSDPStrategy(), max_keep=1)
    model, optimizer = ToyModel(), None
    for step in (1, 2):
        manager.save(f"iter_{step}", model, optimizer, {"meta": {"iter": step}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_2.pth", "last"]
    assert newest(manager) == tmp_path / "iter_2.pth" and newest(manager).is_dir()
    partial = tmp_path / ".tmp-iter_3.pth"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    manager.clean_partial()
    assert not partial.exists()
    state = FSDPStrategy().load_checkpoint(str(tmp_path / "iter_2.pth"), ToyModel(), None)
    assert state == {"meta": {"iter": 2}}


# ---------------------------------------------------------------- checkpoints

def _first_part_body(work_dir, max_iters, interval, crash):
    seen = Seen()
    try:
        _runner(work_dir, size=48, max_iters=max_iters, checkpoint={"interval": interval},
                hooks=[seen, CrashAfter(crash)]).train()
    except Killed:
        pass
    return seen.records


def _reshard_body(work_dir, max_iters):
    seen = Seen()
    runner = _runner(work_dir, size=48, max_iters=max_iters, resume=True, hooks=[seen])
    runner.resume(runner.start_from[1])  # as train() does first
    restored = runner.strategy.model_state_dict(runner.model)
    runner.train()
    runner.close()
    return seen.records, restored


def _check_reshard(tmp_path, first, second, checkpoint):
    """Every sample of epoch 0 seen exactly once; the weights come back as saved."""
    saved_iter = int(checkpoint.split("_")[1].split(".")[0])
    before = [i for records in first for _, step, ids in records if step <= saved_iter for i in ids]
    after = [i for records, _ in second for epoch, _, ids in records if epoch == 0 for i in ids]
    assert sorted(before + after) == list(range(48))
    saved = load_state_file(str(tmp_path / "checkpoints" / checkpoint))["model"]
    for _, restored in second:
        assert saved.keys() == restored.keys()
        assert all(torch.equal(saved[k], restored[k]) for k in saved)
    assert "written by" in (tmp_path / "train.log").read_text()


def test_checkpoint_of_2_ranks_resumes_on_3_and_back(run_on, tmp_path):
    # 2 ranks: 8 samples a step; checkpoint at step 3 (24 samples), crash after step 4
    first = run_on(2)(_first_part_body, str(tmp_path / "a"), 6, 3, 4)
    # 3 ranks: 12 samples a step; the other 24 of epoch 0 in steps 4 and 5
    second = run_on(3)(_reshard_body, str(tmp_path / "a"), 5)
    assert [step for _, step, _ in second[0][0]] == [4, 5]
    _check_reshard(tmp_path / "a", first, second, "iter_3.pth")
    # 3 ranks: checkpoint at step 2 (24 samples), crash after 3; 2 ranks: steps 3, 4, 5
    first = run_on(3)(_first_part_body, str(tmp_path / "b"), 4, 2, 3)
    second = run_on(2)(_reshard_body, str(tmp_path / "b"), 5)
    assert [step for _, step, _ in second[0][0]] == [3, 4, 5]
    _check_reshard(tmp_path / "b", first, second, "iter_2.pth")


@pytest.mark.parametrize(("override", "words"), [
    ("strategy.sharding=fulll", ["strategy.sharding", "'fulll'", "grad_op"]),
    ("strategy.mixed_precision={param_dtype: fp8}", ["param_dtype", "'fp8'"]),
    ("strategy.wrap={layers: [Linear]}", ["strategy.wrap", "'layers'"]),
    ("optim.per_module={net: {}}", ["per_module", "separate_ddp"]),
])
def test_bad_fsdp_values_are_config_errors(tmp_path, override, words):
    """Refused when the config is checked, before any process group or model exists."""
    from trainrun.runner.config import ConfigError, load_config

    config = Path(__file__).resolve().parents[2] / "configs" / "digits_fsdp.yaml"
    with pytest.raises(ConfigError) as error:
        load_config(str(config), [override], values={"work_dir": str(tmp_path / "run")})
    for word in words:
        assert word in str(error.value), str(error.value)
    assert not (tmp_path / "run").exists()


def test_activation_checkpointing_without_shard_units_is_refused_by_the_dry_run(capsys):
    from trainrun.cli.plan import main as plan_main

    config = Path(__file__).resolve().parents[2] / "configs" / "tinylm_fsdp.yaml"
    assert plan_main([str(config), "--cfg-options", "strategy.wrap=null"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    assert "strategy.activation_checkpointing checkpoints the shard units: name them with " \
           "strategy.wrap" in err, err

"""Strategy 'deepspeed': the config it builds, training on 2 gloo ranks under ZeRO 1-3 with the
losses of ddp, one-process runs, checkpoints that resume on another number of processes, and
crafted ones refused. What every strategy's checkpoints promise (exact resume, weights across
strategies, damage): tests/wrappers/test_conformance.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.records import assert_same_norms, grad_norms, losses, records
from tests.runner.toy import Payload, rehash
from trainrun.runner.config import ConfigError, load_config
from trainrun.runner.runner import Runner
from trainrun.runner.sampler import ResumableSampler
from trainrun.wrappers import build_strategy, is_model_wrapper
from trainrun.wrappers.deepspeed import deepspeed_config

pytest.importorskip("deepspeed")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2]
                                                   / ".venv" / "torch_extensions"))

DATASET = "tests.runner.toy.ToyRegression"


def _config(options=None, batch_size=8, world_size=2, optim=None, precision="fp32"):
    return deepspeed_config({**build_strategy("deepspeed").options, **(options or {})},
                            batch_size, world_size, optim or {}, precision)


def test_config_comes_from_the_runs_own_keys():
    config = _config({"zero_stage": 3, "offload_optimizer": True, "offload_param": True,
                      "config": {"wall_clock_breakdown": False}},
                     optim={"accumulate": 2, "clip_grad": {"max_norm": 1.5}}, precision="bf16")
    assert config["train_micro_batch_size_per_gpu"] == 8
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 32
    assert config["gradient_clipping"] == 1.5
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}
    assert config["wall_clock_breakdown"] is False  # raw keys pass through


def test_raw_keys_that_agree_are_accepted():
    config = _config({"config": {"gradient_accumulation_steps": 4,
                                 "zero_optimization": {"stage": 2}}}, optim={"accumulate": 4})
    assert config["zero_optimization"]["stage"] == 2  # zero_stage left unset: config says


@pytest.mark.parametrize(("kwargs", "places"), [
    ({"optim": {"accumulate": 2}, "options": {"config": {"gradient_accumulation_steps": 4}}},
     ["optim.accumulate", "strategy.config.gradient_accumulation_steps"]),
    ({"options": {"config": {"train_micro_batch_size_per_gpu": 16}}},
     ["data.train.batch_size", "strategy.config.train_micro_batch_size_per_gpu"]),
    ({"options": {"config": {"train_batch_size": 64}}},
     ["data.train.batch_size x optim.accumulate", "strategy.config.train_batch_size"]),
    ({"optim": {"clip_grad": 1.0}, "options": {"config": {"gradient_clipping": 2.0}}},
     ["optim.clip_grad", "strategy.config.gradient_clipping"]),
    ({"options": {"config": {"bf16": {"enabled": True}}}},
     ["precision=fp32", "strategy.config.bf16.enabled"]),
    ({"precision": "fp16", "options": {"config": {"fp16": {"enabled": False}}}},
     ["precision=fp16", "strategy.config.fp16.enabled"]),
    ({"options": {"zero_stage": 3, "config": {"zero_optimization": {"stage": 1}}}},
     ["strategy.zero_stage", "strategy.config.zero_optimization.stage"]),
])
def test_a_setting_given_both_ways_differently_is_refused_naming_both(kwargs, places):
    with pytest.raises(ValueError) as error:
        _config(**kwargs)
    for place in places:
        assert place in str(error.value)


@pytest.mark.parametrize(("options", "needle"), [
    ({"config": {"optimizer": {"type": "Adam"}}}, "strategy.config.optimizer"),
    ({"offload_param": True, "zero_stage": 2}, "stage 3"),
    ({"zero_stage": 4}, "strategy.zero_stage"),
    ({"offload_optimizer": "yes"}, "strategy.offload_optimizer"),
])
def test_bad_options_are_refused(options, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        _config(options)


def _runner(work_dir, strategy, *, max_iters=40, checkpoint=None, resume=False, hooks=(),
            launcher="none", optim=None, precision="fp32"):
    return Runner(
        model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
        train_dataloader={"type": DATASET, "size": 64, "batch_size": 4},
        val_dataloader={"type": DATASET, "size": 21, "seed": 1, "batch_size": 4},
        optim={"type": "AdamW", "lr": 0.01, "weight_decay": 0.01, **(optim or {})},
        precision=precision,
        scheduler={"type": "cosine", "warmup_iters": 3},
        strategy=strategy, schedule={"max_iters": max_iters, "val_interval": 20},
        randomness={"seed": 7}, logging={"interval": 1, "backends": ["jsonl"]},
        checkpoint=checkpoint or {"interval": 0}, resume=resume, hooks=hooks, launcher=launcher,
    )




def _shares_master(strategy) -> bool:
    """Whether ZeRO-3's fp32 master partitions are the parameter partitions' memory."""
    zero = strategy.engine.optimizer
    return all(m.data_ptr() == p.data_ptr() for p, m in
               zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat,
                   strict=True))


def _equivalence_body(base, stage):
    for name, strategy in (("ddp", "ddp"), ("ds", {"type": "deepspeed", "zero_stage": stage})):
        runner = _runner(f"{base}/{name}", strategy)
        runner.train()
        wrapped = is_model_wrapper(runner.model)
        state = runner.strategy.model_state_dict(runner.model)
        shared = name == "ddp" or stage != 3 or _shares_master(runner.strategy)
        runner.close()
    return wrapped, sorted(state), state["net.0.weight"].shape, shared


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_log_the_losses_of_ddp(run_on, tmp_path, stage):
    """ZeRO 0 to 3 on 2 ranks log ddp's losses and gradient norms (relative 1e-4; the norm of
    the whole gradient, measured by the engine under ZeRO, by the wrapper at stage 0) at each
    of 40 steps (ZeRO-3 with its fp32 master sharing the parameters' memory), and give back
    whole weights under the plain keys."""
    for wrapped, keys, shape, shared in run_on(2)(_equivalence_body, str(tmp_path), stage):
        assert wrapped
        assert shared  # ZeRO-3 in fp32 keeps no second copy of its partition
        assert keys == ["net.0.bias", "net.0.weight", "net.3.bias", "net.3.weight"]
        assert shape == (16, 4)
    ddp, ds = losses(tmp_path / "ddp"), losses(tmp_path / "ds")
    assert sorted(ds) == list(range(1, 41))
    for step, loss in ddp.items():
        assert ds[step] == pytest.approx(loss, rel=1e-4), step
    assert [r["step"] for r in records(tmp_path / "ds") if r.get("mode") == "val"] == [20, 40]
    assert sorted(grad_norms(tmp_path / "ds")) == list(range(1, 41))
    assert_same_norms(grad_norms(tmp_path / "ddp"), grad_norms(tmp_path / "ds"))


def _options_body(base, strategy, max_iters, optim, precision):
    """ddp, then ``strategy``, on the same job: their losses and final weights."""
    out = []
    for name, chosen in (("ddp", "ddp"), ("ds", strategy)):
        runner = _runner(f"{base}/{name}", chosen, max_iters=max_iters, optim=optim,
                         precision=precision)
        runner.train()
        out.append(runner.strategy.model_state_dict(runner.model))
        runner.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "optim", "max_iters"), [
    (2, {"accumulate": 3, "clip_grad": 0.05}, 20),  # clipping bites; 20 = 6 groups + 2
    (3, {"accumulate": 3}, 8),
])
def test_accumulation_clipping_and_a_short_last_group_match_ddp(run_on, tmp_path, stage, optim,
                                                                 max_iters):
    """Accumulating over 3 micro-steps with clipping logs ddp's losses, and the last
    ``max_iters % 3`` micro-steps are applied as a short group of their own, as under ddp
    (DeepSpeed alone leaves them out): the final weights agree."""
    strategy = {"type": "deepspeed", "zero_stage": stage}
    for ddp, ds in run_on(2)(_options_body, str(tmp_path), strategy, max_iters, optim, "fp32"):
        for key, value in ddp.items():
            assert torch.allclose(ds[key], value, rtol=1e-4, atol=1e-6), key
    ddp, ds = losses(tmp_path / "ddp"), losses(tmp_path / "ds")
    assert sorted(ds) == list(range(1, max_iters + 1))
    for step, loss in ddp.items():
        assert ds[step] == pytest.approx(loss, rel=1e-4), step
    # norms (before clipping) on the steps that stepped: every third, and the short group's
    assert sorted(grad_norms(tmp_path / "ds")) == [*range(3, max_iters, 3), max_iters]
    assert_same_norms(grad_norms(tmp_path / "ddp"), grad_norms(tmp_path / "ds"))


@pytest.mark.slow
def test_bf16_with_optimizer_and_parameter_offload_trains_as_ddp_does(run_on, tmp_path):
    """ZeRO-3 in bf16 with optimiser state and parameters offloaded to the CPU: the losses
    follow ddp's bf16 run within bf16's rounding, and training lowers them."""
    strategy = {"type": "deepspeed", "zero_stage": 3, "offload_optimizer": True,
                "offload_param": True}
    run_on(2)(_options_body, str(tmp_path), strategy, 30, {"accumulate": 2, "clip_grad": 1.0},
              "bf16")
    ddp, ds = losses(tmp_path / "ddp"), losses(tmp_path / "ds")
    assert sorted(ds) == list(range(1, 31))
    for step, loss in ddp.items():
        assert ds[step] == pytest.approx(loss, rel=0.05), step
    assert sum(ds[s] for s in range(26, 31)) < sum(ds[s] for s in range(1, 6))


def _full_state(runner) -> dict[str, torch.Tensor]:
    """Every parameter's whole fp32 value and Adam moments, assembled from the ZeRO partitions
    (every rank must call this)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, param in runner.strategy.unwrap(runner.model).named_parameters():
        out[name] = safe_get_full_fp32_param(param).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).clone()
    return out


class _AfterLoading:
    """Records the state right after resuming, and the samples of the epoch resumed."""

    priority = 99

    def __getattr__(self, name):
        return lambda *args: None

    def before_run(self, runner):
        self.state = _full_state(runner)
        self.position = (runner.iter, runner.train_dataloader.sampler.state_dict())
        self.read = []

    def before_train_iter(self, runner, batch_idx, batch):
        if runner.epoch == 0:
            self.read += batch["index"].tolist()

    def after_train_iter(self, runner, *args):
        if "steps" not in vars(self):  # each flat group's step count, after one step more
            zero = runner.strategy.engine.optimizer.optimizer
            self.steps = [float(state["step"]) for state in zero.state.values()]


def _groups(stage):
    """Two parameter groups under ZeRO-3 (whose loading of a universal checkpoint gave both
    one step count); one under ZeRO-2, where DeepSpeed's ``safe_get_full_optimizer_state``
    (`_full_state`) cannot read a group so small that a rank holds none of a parameter."""
    return {"paramwise": {"bias_decay_mult": 0.0}} if stage == 3 else None


def _save_on_two_body(base, stage):
    runner = _runner(base, {"type": "deepspeed", "zero_stage": stage}, max_iters=6,
                     checkpoint={"interval": 6}, optim=_groups(stage))
    runner.train()
    state = _full_state(runner)
    runner.close()
    return state


def _resume_on_three_body(base, stage):
    hook = _AfterLoading()
    runner = _runner(base, {"type": "deepspeed", "zero_stage": stage}, max_iters=9,
                     checkpoint={"interval": 6}, resume=True, hooks=[hook],
                     optim=_groups(stage))
    runner.train()
    runner.close()
    return hook.state, hook.position, hook.read, hook.steps


def _file_hashes(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_of_two_processes_resumes_on_three(run_on, tmp_path, stage):
    """Saved mid-epoch at step 6 by 2 processes, resumed by 3: DeepSpeed's universal
    checkpoint, made beside the checkpoint and removed, gives every rank the saved weights and
    Adam moments (under ZeRO-3, each of two parameter groups its own step count); the run
    goes on from step 6 and the sampler's cursor (each unread sample of
    the epoch read once, on 3 ranks); the published checkpoint is left as it was."""
    saved = run_on(2)(_save_on_two_body, str(tmp_path), stage)[0]
    checkpoints = tmp_path / "checkpoints"
    hashes = _file_hashes(checkpoints / "iter_6.pth")
    results = run_on(3)(_resume_on_three_body, str(tmp_path), stage)
    order = ResumableSampler(64, seed=7, num_replicas=1, rank=0).epoch_order()
    for state, position, _, steps in results:
        assert position == (6, {"epoch": 0, "cursor": 48, "seed": 7})  # 6 steps of 2 x 4
        assert steps == [7.0] * (2 if stage == 3 else 1)  # each group counts step 7 once
        assert state.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(state[key], value), key
    read = sorted(index for _, _, indices, _ in results for index in indices)
    assert read == sorted(order[48:] + order[:2])  # 16 left, 2 padding samples: 3 x 2 x 3
    assert sorted(losses(tmp_path)) == list(range(1, 10))
    assert all(loss == loss for loss in losses(tmp_path).values())  # no NaN
    log = (tmp_path / "train.log").read_text()
    assert (f"resume: {checkpoints / 'iter_6.pth'} was written by 2 processes, this job has "
            "3: loaded through DeepSpeed's universal checkpoint") in log
    assert "this job has 3: random streams restart" in log
    assert _file_hashes(checkpoints / "iter_6.pth") == hashes
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_6.pth", "iter_9.pth", "last"]


def _single_process_body(work_dir):
    runner = _runner(work_dir, {"type": "deepspeed", "zero_stage": 2}, max_iters=6)
    runner.train()
    state = runner.strategy.model_state_dict(runner.model)
    runner.close()
    return sorted(state), torch.distributed.is_initialized()


@pytest.mark.slow
def test_a_run_without_a_process_group_gets_a_one_process_group(run_on, tmp_path):
    keys, still_grouped = run_on(1)(_single_process_body, str(tmp_path))[0]
    assert keys == ["net.0.bias", "net.0.weight", "net.3.bias", "net.3.weight"]
    assert not still_grouped  # the strategy's own group is gone after close()
    assert sorted(losses(tmp_path)) == list(range(1, 7))


def _crafted_body(base):
    """DeepSpeed reads its own files with weights_only=False; a crafted partition file must
    still be refused, on resume and as weights, and never run."""
    import pickle

    strategy = {"type": "deepspeed", "zero_stage": 2}
    _runner(base, strategy, max_iters=4, checkpoint={"interval": 4}).train()
    marker = Path(base) / "pwned"
    if torch.distributed.get_rank() == 0:
        for part in (Path(base) / "checkpoints" / "iter_4.pth").rglob("*optim_states.pt"):
            state = torch.load(part, weights_only=False)
            state["payload"] = Payload(str(marker))
            torch.save(state, part)
        rehash(Path(base) / "checkpoints" / "iter_4.pth")
    torch.distributed.barrier()
    refused = []
    runner = _runner(base, strategy, max_iters=8, checkpoint={"interval": 4}, resume=True)
    try:
        runner.train()
    except pickle.UnpicklingError as error:
        refused.append(str(error))
    runner.close()
    try:
        _runner(f"{base}/ddp", "ddp").load_weights(f"{base}/checkpoints/iter_4.pth")
    except pickle.UnpicklingError as error:
        refused.append(str(error))
    return refused, marker.exists()


def test_a_crafted_deepspeed_checkpoint_is_refused_not_run(run_on, tmp_path):
    for refused, ran in run_on(2)(_crafted_body, str(tmp_path)):
        assert not ran
        assert len(refused) == 2 and all("refused to load: it holds posix.system" in text
                                          for text in refused), refused


def test_a_conflict_is_a_config_error_and_the_cli_exits_2(tmp_path):
    root = Path(__file__).resolve().parents[2]
    config = root / "configs" / "digits_deepspeed_zero2.yaml"
    with pytest.raises(ConfigError, match="optim.accumulate.*strategy.config.gradient_acc"):
        load_config(config, ["optim.accumulate=2",
                             "strategy.config.gradient_accumulation_steps=4"])
    work_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(root / "tools" / "train.py"), str(config), "--launcher", "none",
         "--work-dir", str(work_dir), "--cfg-options", "optim.clip_grad=1.0",
         "strategy.config.gradient_clipping=2.0"],
        capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "optim.clip_grad" in errors[0] and \
        "strategy.config.gradient_clipping" in errors[0], done.stderr
    assert not work_dir.exists()


def test_asynchronous_checkpoints_are_refused_at_config_time(tmp_path):
    """DeepSpeed's engine saves synchronously: `checkpoint.async: true` is a config error."""
    config = Path(__file__).resolve().parents[2] / "configs" / "digits_deepspeed_zero2.yaml"
    with pytest.raises(ConfigError, match=r"checkpoint\.async: got true.*'deepspeed'"):
        load_config(str(config), ["checkpoint.async=true"],
                    values={"work_dir": str(tmp_path / "run")})
    assert not (tmp_path / "run").exists()


class _Recorder(torch.nn.Module):
    """Stands in for a DeepSpeed engine: keeps what its forward was given."""

    def forward(self, *args, **kwargs):
        self.seen = (args, kwargs)
        return {}


def test_fp16_trains_or_is_refused_naming_the_key_where_deepspeed_has_none(tmp_path):
    from deepspeed.accelerator import get_accelerator

    def runner_of():
        return _runner(str(tmp_path / "run"), {"type": "deepspeed", "zero_stage": 2},
                       max_iters=2, precision="fp16")

    if get_accelerator().is_fp16_supported():
        runner = runner_of()
        runner.train()
        runner.close()
        assert sorted(losses(tmp_path / "run")) == [1, 2]
        return
    with pytest.raises(ConfigError) as refused:
        runner_of()
    assert str(refused.value) == (
        "precision: 'fp16': DeepSpeed runs fp16 on a CPU only with oneDNN's fp16 kernels "
        "(AVX512-FP16 or AMX), which this CPU lacks; use bf16 or fp32")
    assert not torch.distributed.is_initialized()  # refused before the strategy's own group
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                             ("fp32", torch.float32)])
def test_the_training_forward_gets_floats_in_the_engines_dtype(precision, dtype):
    # DeepSpeed holds bf16/fp16 weights and, on CUDA, turns an outer autocast off inside its
    # forward: float32 inputs would meet bf16 weights (seen on an H200). Labels stay integers.
    from trainrun.wrappers.deepspeed import MMDeepSpeedEngineWrapper

    engine = _Recorder()
    batch = {"inputs": torch.ones(2, 3), "labels": torch.tensor([1, 2]),
             "extra": [torch.zeros(1, dtype=torch.float64)]}
    MMDeepSpeedEngineWrapper(engine, precision)(batch, mode="loss")
    (seen,), kwargs = engine.seen
    assert kwargs == {"mode": "loss"}
    assert seen["inputs"].dtype == dtype and seen["labels"].dtype == torch.int64
    assert seen["extra"][0].dtype == (torch.float64 if precision == "fp32" else dtype)

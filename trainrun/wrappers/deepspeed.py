"""Strategy 'deepspeed': DeepSpeed's engine (ZeRO stages 0 to 3) behind the runner's step contract.

DeepSpeed is imported only inside this strategy's methods, so it is needed only when used.
The DeepSpeed config is built from the run's own keys (per-rank batch size, ``optim.accumulate``,
``optim.clip_grad``, ``precision``) and this strategy's options; ``strategy.config`` adds raw
DeepSpeed keys. A setting given both ways with different values is refused, naming both places.

The engine owns accumulation, clipping and precision, so ``train_step`` gets a
``DeepSpeedOptimWrapper`` (``engine.backward`` then ``engine.step``) instead of the runner's
``OptimWrapper``. Checkpoints are DeepSpeed's own directories, written and read by every rank; one
written by another number of processes is loaded through DeepSpeed's universal checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

from trainrun.checkpoint.deepspeed_dir import (
    TAG,
    deepspeed_change_refusal,
    saved_world_size,
    saved_zero_stage,
    universal_copy,
    weights_only_loads,
    write_universal,
)
from trainrun.checkpoint.files import fsync_and_hash, save_state_file
from trainrun.checkpoint.format import checkpoint_format, load_state_file
from trainrun.checkpoint.optimizer_state import (
    Groups,
    named_optimizer_state,
    optimizer_groups,
    optimizer_order,
)
from trainrun.checkpoint.train_state import TRAIN_STATE
from trainrun.dist import (
    barrier,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
    leave_dist,
    phase,
)
from trainrun.dist.device import autocast_dtype, map_tensors
from trainrun.dist.waits import waiting_for_gradients
from trainrun.registry import FORMATS
from trainrun.wrappers.base import MakeOptimizer, Optimizers, Strategy, compile_module
from trainrun.wrappers.base_model import loss_step
from trainrun.wrappers.memory import ParamSpec, StateBytes

log = logging.getLogger("trainrun")


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` in the nested ``config``, or ``_MISSING``."""
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _put(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value


_MISSING = object()


def _max_norm(clip_grad: Any) -> float | None:
    if not clip_grad:
        return None
    if isinstance(clip_grad, (int, float)):
        return float(clip_grad)
    if "clip_value" in clip_grad:
        raise ValueError(f"optim.clip_grad: got {dict(clip_grad)!r}, expected null, a number "
                         "> 0 or {max_norm: ...} with strategy 'deepspeed' (its engine clips "
                         "the total norm only, as gradient_clipping; the other strategies "
                         "clip by value too)")
    norm_type = float(clip_grad.get("norm_type", 2.0))
    if norm_type != 2.0:
        raise ValueError(f"optim.clip_grad.norm_type={norm_type:g}: DeepSpeed clips only the "
                         "L2 norm (norm_type 2)")
    return float(clip_grad["max_norm"])


def deepspeed_config(options: Mapping[str, Any], batch_size: int, world_size: int | None,
                     optim: Mapping[str, Any], precision: str) -> dict[str, Any]:
    """DeepSpeed's config for this run: the raw ``options['config']`` plus what the run's own
    keys and this strategy's options say; a key set both ways with different values is a
    ValueError naming both places. ``world_size`` None (not known yet): no train_batch_size."""
    raw = _plain(options.get("config") or {})
    for key in ("optimizer", "scheduler"):
        if key in raw:
            raise ValueError(f"strategy.config.{key}: the optimiser and its schedule come from "
                             f"the config's optim and scheduler sections; remove {key!r}")
    accumulate = int(optim.get("accumulate") or 1)
    derived: dict[str, tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (batch_size, "data.train.batch_size"),
        "gradient_accumulation_steps": (accumulate, "optim.accumulate"),
        "gradient_clipping": (_max_norm(optim.get("clip_grad")) or 0.0, "optim.clip_grad"),
        "bf16.enabled": (precision == "bf16", f"precision={precision}"),
        "fp16.enabled": (precision == "fp16", f"precision={precision}"),
    }
    if world_size is not None:
        derived["train_batch_size"] = (batch_size * accumulate * world_size,
                                       "data.train.batch_size x optim.accumulate x world size")
    stage = options.get("zero_stage")
    if stage is not None:
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"strategy.zero_stage must be 0, 1, 2 or 3; got {stage!r}")
        derived["zero_optimization.stage"] = (stage, "strategy.zero_stage")
    for option, section in (("offload_optimizer", "offload_optimizer"),
                            ("offload_param", "offload_param")):
        value = options.get(option)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise ValueError(f"strategy.{option} must be true or false; got {value!r}")
        derived[f"zero_optimization.{section}.device"] = ("cpu" if value else "none",
                                                          f"strategy.{option}")
    config = raw
    for key, (value, where) in derived.items():
        given = _lookup(raw, key)
        if given is not _MISSING and given != value:
            raise ValueError(f"{where} gives {key}={value!r} but strategy.config.{key} is "
                             f"{given!r}: set it in one place only")
        _put(config, key, value)
    if _lookup(config, "zero_optimization.offload_param.device") == "cpu" and \
            _lookup(config, "zero_optimization.stage") != 3:
        raise ValueError("strategy.offload_param needs ZeRO stage 3 (strategy.zero_stage: 3)")
    # the runner's own torch optimiser also steps offloaded state (DeepSpeed would insist on
    # its CPU Adam otherwise)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("steps_per_print", 2**31 - 1)  # the runner logs
    return config


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    dtype = autocast_dtype(precision)
    return torch.autocast(device_type, dtype) if dtype is not None else contextlib.nullcontext()


def _floats_to(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with its floating-point tensors cast to ``dtype``; integer tensors and
    everything else as they are."""
    return map_tensors(data, lambda tensor: tensor.to(dtype) if tensor.is_floating_point()
                       else tensor)


def _fsync(files: list[Path]) -> None:
    """Put on disk what DeepSpeed wrote (it saves without fsync), so that a checkpoint is
    never published before its bytes are durable; hashing them meanwhile."""
    for file in files:
        with open(file, "rb") as f:
            fsync_and_hash(f, file)


def share_fp32_master(zero_optimizer: Any) -> int:
    """Under ZeRO-3 with fp32 parameters, make each fp32 master partition share the memory
    of the parameter partition it copies; returns the bytes freed per rank.

    DeepSpeed means to (stage3.py aliases the two when dtype and device match) but compares a
    `torch.device` with a device-name string, which is never equal, so each rank keeps a
    second fp32 copy of its partition: a quarter more state than needed. Right after
    `deepspeed.initialize` both copies hold the same values, so sharing changes no number.
    Offloaded and NVMe-swapped partitions live elsewhere and are left alone.
    """
    low = getattr(zero_optimizer, "fp16_partitioned_groups_flat", None)
    master = getattr(zero_optimizer, "fp32_partitioned_groups_flat", None)
    if not low or not master or getattr(zero_optimizer, "offload_optimizer", True) \
            or getattr(zero_optimizer, "params_in_nvme_and_cpu", True):
        return 0
    freed = 0
    for param, copy in zip(low, master, strict=True):
        if (param is not None and copy is not param and copy.dtype == param.dtype
                and copy.device == param.device and copy.shape == param.shape
                and copy.data_ptr() != param.data_ptr()):
            freed += copy.untyped_storage().nbytes()
            copy.data = param.data
    return freed


# ZeRO optimisers' flat buffers (DeepSpeed 0.19): parameters as the model computes with them,
# fp32 master copies the optimiser steps, and gradient partitions
_PARAM_BUFFERS = ("bit16_groups_flat", "fp16_partitioned_groups_flat", "fp16_groups_flat")
_MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
            "fp32_groups_flat", "fp32_groups")
_GRAD_BUFFERS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")


def _own_step_counts(zero_optimizer: Any) -> None:
    """Give each of the ZeRO optimiser's flat groups a step count of its own: loading a
    universal checkpoint, ZeRO-3 gives them all one tensor, which torch's optimisers count in
    place (with two groups, every step would count twice)."""
    for state in zero_optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _tensors_in(value: Any) -> list[Tensor]:
    """The tensors in nested lists, tuples and dicts."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def zero_memory_plan(specs: Sequence[ParamSpec], world_size: int,
                     config: Mapping[str, Any]) -> StateBytes:
    """One rank's bytes under DeepSpeed ``config`` (DeepSpeed 0.19's layout, measured in
    bench/memory_plan.py). Trainable parameters T (their elements), frozen ones F; the model
    computes in 2 bytes an element under bf16/fp16 (its own dtype otherwise, b); N ranks;
    a partition is a ceil(1/N) share (the last rank's padded to the others' size):

    - stage 0: T and F whole; under 16 bits also an fp32 master copy of T and fp32 gradients
      beside the 16-bit ones; the optimiser's state in fp32, whole.
    - stages 1 and 2: T and F whole, plus an fp32 master partition of T (a copy even in fp32);
      gradients: the whole of each parameter reaching into the rank's partition, reduced,
      then an fp32 partition for the step (`_add_zero12_grads`); optimiser state a partition.
    - stage 3: each parameter a partition in b (plus the whole of those of at most
      ``stage3_param_persistence_threshold`` elements, kept gathered); an fp32 master
      partition beside it under 16 bits (the same memory in fp32); gradient partitions in b,
      and an fp32 copy of them for the step (even in fp32); optimiser state a partition.

    ``offload_optimizer`` puts the master partition, its gradient and the optimiser state on
    the CPU; ``offload_param`` (stage 3) the parameter partitions.
    """
    stage = _lookup(config, "zero_optimization.stage")
    stage = 0 if stage is _MISSING else stage
    low = _lookup(config, "bf16.enabled") is True or _lookup(config, "fp16.enabled") is True
    off_optim = _lookup(config, "zero_optimization.offload_optimizer.device") in ("cpu", "nvme")
    off_param = _lookup(config, "zero_optimization.offload_param.device") in ("cpu", "nvme")
    threshold = _lookup(config, "zero_optimization.stage3_param_persistence_threshold")
    threshold = 100_000 if threshold is _MISSING else threshold
    plan = StateBytes()
    for spec in specs:
        b = 2 if low else spec.itemsize
        n = spec.numel
        share = -(-n // world_size) if stage else n  # ZeRO's partition of it
        if stage == 3:
            plan.add("params", share * b, cpu=off_param)
            if n <= threshold:
                plan.add("params", n * b)
        else:
            plan.add("params", n * b)
        if not spec.trainable:
            continue
        master = low or stage in (1, 2) or off_optim  # a copy of its own, in fp32
        if master:
            plan.add("params", share * 4, cpu=off_optim)
        if stage == 0:
            plan.add("grads", n * b + (n * 4 if low else 0))
        elif stage == 3:  # the partition in b, and in fp32 (a copy) at the step
            plan.add("grads", share * b, cpu=off_optim)
            plan.add("grads", share * 4, cpu=off_optim)
        plan.add_optim(spec.states, share * 4 if master or stage else n * b, cpu=off_optim)
    if stage in (1, 2):
        _add_zero12_grads(plan, [spec for spec in specs if spec.trainable], world_size,
                          2 if low else None, off_optim)
    where = {0: "every rank holds everything", 1: "optimiser state partitioned",
             2: "optimiser state and gradients partitioned",
             3: "parameters, gradients and optimiser state partitioned"}[stage]
    plan.notes.append(f"ZeRO stage {stage} over {world_size} ranks: {where}"
                      + ("; 16-bit parameters, fp32 master copies" if low else ""))
    return plan


def _add_zero12_grads(plan: StateBytes, trainable: Sequence[ParamSpec], world_size: int,
                      low: int | None, offload: bool) -> None:
    """ZeRO-1/2's gradients on the rank that holds most. The flat group of the trainable
    parameters is cut in ``world_size`` equal partitions. Between backward and the step a
    rank holds the reduced gradient of the whole of each parameter reaching into its
    partition (in the model's dtype, or ``low`` bytes); the step then takes an fp32
    partition of them, which replaces them. With ``offload`` they go to an fp32 partition on
    the CPU as they are reduced."""
    total = sum(spec.numel for spec in trainable)
    if not total:
        return
    share = -(-total // world_size)
    reached = [0] * world_size  # bytes of the whole parameters reaching into each partition
    offset = 0
    for spec in trainable:
        for rank in range(offset // share, min(world_size, -(-(offset + spec.numel) // share))):
            reached[rank] += spec.numel * (low or spec.itemsize)
        offset += spec.numel
    if offload:  # copied to the CPU's fp32 partition as they are reduced
        plan.add("grads", share * 4, cpu=True)
    else:
        plan.add("grads", max(max(reached), share * 4))


_ds_groups_for: list[Any] = [None]  # the default group DeepSpeed's cached groups belong to


def _check_fp16(precision: str, device: torch.device) -> None:
    """Refuse ``precision: fp16`` where DeepSpeed's accelerator has no fp16, naming the key
    (DeepSpeed's own refusal names neither it nor what to do). On a CPU its fp16 needs
    oneDNN's fp16 kernels, which only CPUs with AVX512-FP16 or AMX have."""
    if precision != "fp16":
        return
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        return
    if device.type == "cpu":
        why = ("DeepSpeed runs fp16 on a CPU only with oneDNN's fp16 kernels (AVX512-FP16 or "
               "AMX), which this CPU lacks")
    else:
        why = f"DeepSpeed has no fp16 on this {device.type} device"
    raise ValueError(f"precision: 'fp16': {why}; use bf16 or fp32")


def _skip_shared_memory_comm_build() -> None:
    """On the CPU accelerator DeepSpeed compiles a shared-memory all-reduce kernel (its
    ``deepspeed_shm_comm`` op, about 50 s of C++ the first time in an environment) when its
    communication starts; only its inference all-reduce uses it, never training. Marking the
    op unavailable makes DeepSpeed skip the build, as it does on platforms without it."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict) and "deepspeed_shm_comm" in compatible:
        compatible["deepspeed_shm_comm"] = False


def _forget_stale_deepspeed_groups() -> None:
    """DeepSpeed caches the groups it derives from the default process group in module
    globals; after that group is destroyed and another created in the same process, they are
    stale (and unregistered), so they are dropped for DeepSpeed to derive them again."""
    world = torch_dist.group.WORLD
    if _ds_groups_for[0] is world:
        return
    from deepspeed.utils import groups

    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
                 "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
                 "_ALL_TO_ALL_GROUP"):
        cached = getattr(groups, name, None)
        if isinstance(cached, dict):
            cached.clear()
    _ds_groups_for[0] = world


class MMDeepSpeedEngineWrapper(nn.Module):
    """A DeepSpeed engine with ``train_step``/``val_step``/``test_step`` and ``.module``.

    ``train_step(data, optim_wrapper)`` runs the forward in loss mode through the engine and
    hands the loss to the ``DeepSpeedOptimWrapper`` (the engine's backward and step); it
    returns the values to log, as ``BaseModel.train_step`` does. ``val_step`` and
    ``test_step`` are the user's model's own, without gradients, under autocast in
    ``precision``. ``.module`` is the user's model inside the engine.

    Args:
        engine: the engine ``deepspeed.initialize`` returned.
        precision: ``'fp32'``, ``'bf16'`` or ``'fp16'``: the autocast of validation and
            testing.
    """

    def __init__(self, engine: nn.Module, precision: str = "fp32"):
        super().__init__()
        self.engine = engine
        self.precision = precision

    @property
    def module(self) -> nn.Module:  # type: ignore[override]
        return self.engine.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's forward, floating-point inputs cast to the weights' bf16/fp16 first:
        DeepSpeed keeps the weights in that dtype, and on CUDA turns an autocast from outside
        off inside its forward, so float32 inputs would meet bf16 weights."""
        dtype = autocast_dtype(self.precision)
        if dtype is not None:
            args, kwargs = _floats_to(args, dtype), _floats_to(kwargs, dtype)
        return self.engine(*args, **kwargs)

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, Tensor]:
        return loss_step(self, data, optim_wrapper)

    def _eval(self, data: Any, step: str) -> Any:
        with _autocast(self.precision, self.engine.device.type), torch.no_grad():
            return getattr(self.engine.module, step)(data)

    def val_step(self, data: Any) -> Any:
        return self._eval(data, "val_step")

    def test_step(self, data: Any) -> Any:
        return self._eval(data, "test_step")


class DeepSpeedOptimWrapper:
    """What ``train_step`` gets under DeepSpeed: the engine does backward (loss scaling and
    division by the accumulation steps), accumulation, clipping and the optimiser step.

    It has the ``OptimWrapper`` methods a ``train_step`` uses (``optim_context``,
    ``update_params``) and those the runner uses (``set_total``, ``get_lr``,
    ``state_dict``, ``grad_norm``).

    Args:
        engine: the DeepSpeed engine.
        optimizer: the torch optimiser the engine steps.
        precision: ``'fp32'``, ``'bf16'`` or ``'fp16'``: the autocast around the forward.
    """

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer, precision: str):
        self.engine = engine
        self.optimizer = optimizer
        self.precision = precision
        # the global norm, before clipping, of the step the last micro-step took (None if it
        # took none); the engine's own, measured here where it keeps none (ZeRO stage 0 in
        # fp32 without clipping) when the logger asks through `measure_grad_norm`
        self.grad_norm: Tensor | None = None
        self.measure_grad_norm = False
        # the guard's skip_step: steps whose gradients are not finite are skipped (ZeRO's
        # stages skip them by themselves; at stage 0 the gradients are dropped before the
        # step), and the micro-steps skipped are kept for the guard to take
        self.skip_nonfinite = False
        self.skipped: list[int] = []
        self.done = self.tail = self.tail_from = 0  # micro-steps: done, in the short last group

    def set_total(self, done_iters: int, max_iters: int) -> None:
        """Where training starts and ends: the last ``max_iters % accumulate`` micro-steps
        form a short group of their own that is applied (as the runner's `OptimWrapper`
        does), where DeepSpeed alone would leave them unapplied."""
        accumulate = self.engine.gradient_accumulation_steps()
        self.done = done_iters
        self.tail = max_iters % accumulate
        self.tail_from = max_iters - self.tail

    def _in_tail(self, micro_step: int) -> bool:
        return self.tail > 0 and micro_step > self.tail_from

    @property
    def will_step(self) -> bool:
        if self._in_tail(self.done + 1):
            return self.done + 1 == self.tail_from + self.tail
        return bool(self.engine.is_gradient_accumulation_boundary())

    def optim_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return _autocast(self.precision, self.engine.device.type)

    def update_params(self, loss: Tensor) -> None:
        stepping = self.will_step
        self.done += 1
        with phase("backward"), waiting_for_gradients(loss):
            if self._in_tail(self.done):  # mean over the short group's micro-steps
                self.engine.set_gradient_accumulation_boundary(
                    self.done == self.tail_from + self.tail)
                self.engine.backward(loss / self.tail, scale_wrt_gas=False)
            else:
                self.engine.backward(loss)
        checks = self.measure_grad_norm or self.skip_nonfinite
        own = self._own_norm() if stepping and checks else None
        dropped = self.skip_nonfinite and own is not None and not torch.isfinite(own)
        if dropped:  # stage 0 steps whatever it is given: a step without gradients moves nothing
            for param in self.engine.module.parameters():
                param.grad = None
        with phase("optimizer step"):
            self.engine.step()
        if self.skip_nonfinite and stepping and (dropped or not self.engine.was_step_applied()):
            self.skipped.append(self.done)
        norm = self.engine.get_global_grad_norm() if stepping else None
        self.grad_norm = own if norm is None else torch.as_tensor(norm)

    def _own_norm(self) -> Tensor | None:
        """The norm of the whole gradients, where every rank holds them (stage 0, reduced in
        backward at the step's boundary); None under ZeRO, whose engine measures it."""
        if self.engine.zero_optimization_stage() != 0:
            return None
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return nn.utils.get_total_norm(grads) if grads else None

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {}  # the engine's own state travels in its checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# Measured on the digits MLP (2 CPU processes, compiled before deepspeed.initialize): under
# ZeRO-3 the hooks that gather each submodule's parameters break the graph at every submodule
# and recompile it again and again (20 steps in 50 s against 1 s uncompiled); stages 0-2 leave
# the module alone and compile cleanly, their losses within 1e-6 of the uncompiled run's.
NO_COMPILE_AT_ZERO_3 = ("compile: not under ZeRO stage 3 (its parameter-gathering hooks break "
                        "the compiled graph at every submodule and recompile it, far slower "
                        "than not compiling); use strategy.zero_stage 0-2, or compile: false")


class DeepSpeedStrategy(Strategy):
    """DeepSpeed's engine: ZeRO stage 0-3 sharding of optimiser state, gradients, parameters.

    Options left ``None`` are DeepSpeed's defaults (or what ``config`` says).

    ``strategy.type: deepspeed``. The DeepSpeed config is built from the run's own keys
    (per-rank batch size, ``optim.accumulate``, ``optim.clip_grad``, ``precision``) and these
    options; a setting given both ways with different values is refused, naming both places.
    It takes one optimiser (not ``optim.per_module``) and clips the total gradient norm only
    (not ``optim.clip_grad.clip_value``); ``compile`` works under ZeRO stages 0-2 only, and
    checkpoints are written synchronously (no ``checkpoint.async``).
    Checkpoints are DeepSpeed's own directories, written and read by every rank.

    Args:
        zero_stage: the ZeRO stage, 0, 1, 2 or 3.
        offload_optimizer: keep the optimiser state (and its step) on the CPU.
        offload_param: keep the parameters on the CPU (ZeRO stage 3 only).
        config: raw DeepSpeed config keys, added to what the run's keys give (not
            ``optimizer`` or ``scheduler``: those come from ``optim`` and ``scheduler``).
    """

    name = "deepspeed"

    # DeepSpeed's engine by name, so that DeepSpeed is never imported just to ask
    WRAPPERS = (MMDeepSpeedEngineWrapper, "DeepSpeedEngine")
    WRITER_RANK = re.compile(r"zero_pp_rank_(\d+)_")  # each rank's partition files
    FORMAT = "deepspeed"  # DeepSpeed's own directory (trainrun/checkpoint/deepspeed_dir.py)
    COMPILES = "the model, before deepspeed.initialize (ZeRO stages 0-2)"
    OPTIONS = {
        "zero_stage": None,  # 0 | 1 | 2 | 3
        "offload_optimizer": None,  # optimiser state (and step) on the CPU
        "offload_param": None,  # parameters on the CPU (stage 3 only)
        "config": None,  # raw DeepSpeed keys, added to what the run's keys give
    }
    ACCEPTS = {
        "zero_stage": "null (DeepSpeed's default), 0, 1, 2 or 3",
        "offload_optimizer": "null, true or false",
        "offload_param": "null, true or false",
        "config": "null or a mapping of DeepSpeed config keys",
    }

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.settings: dict[str, Any] = {"batch_size": 1, "optim": {}, "precision": "fp32"}
        self.engine: Any = None
        self.config: dict[str, Any] | None = None
        self._own_group = False
        self._set_local_rank = False
        # the optimiser's parameters by name, and its groups, before the engine took them over
        self._group_names: list[list[str]] = []
        self._groups: Groups | None = None

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        """The DeepSpeed config must build from ``cfg`` (no setting given both ways with
        different values); the total batch size is checked when the job's size is known."""
        options = cls.options_in(cfg)
        world_size = os.environ.get("WORLD_SIZE")
        train = (cfg.get("data") or {}).get("train") or {}
        config = deepspeed_config(options, train.get("batch_size") or 1,
                                  int(world_size) if world_size else None,
                                  cfg.get("optim") or {}, cfg.get("precision", "fp32"))
        if cfg.get("compile") and _lookup(config, "zero_optimization.stage") == 3:
            raise ValueError(NO_COMPILE_AT_ZERO_3)
        if (cfg.get("checkpoint") or {}).get("async"):
            raise ValueError("checkpoint.async: got true, expected false with strategy "
                             "'deepspeed' (its engine writes checkpoints synchronously; ddp "
                             "and fsdp save in the background)")

    @classmethod
    def memory_plan(cls, specs: Sequence[ParamSpec], world_size: int, cfg: Mapping[str, Any],
                    model: nn.Module | None = None) -> StateBytes:
        """What ZeRO's stage keeps on each of ``world_size`` ranks (`zero_memory_plan`), from
        the DeepSpeed config this run's keys and options make."""
        train = (cfg.get("data") or {}).get("train") or {}
        config = deepspeed_config(cls.options_in(cfg), train.get("batch_size") or 1, world_size,
                                  cfg.get("optim") or {}, cfg.get("precision", "fp32"))
        return zero_memory_plan(specs, world_size, config)

    def state_tensors(self, model: nn.Module, optimizer: Optimizers | None
                      ) -> dict[str, list[Tensor]]:
        """The module's parameters and gradients, and ZeRO's flat buffers of them: its
        16-bit (or fp32) parameter groups or partitions, fp32 master partitions and gradient
        partitions (communication buckets are not state); the optimiser's own state."""
        found = super().state_tensors(model, optimizer)
        zero = getattr(self.engine, "optimizer", None)
        if zero is None or zero is optimizer:  # ZeRO-0 in fp32: the torch optimiser itself
            return found
        masters = _tensors_in([getattr(zero, name, None) for name in _MASTERS])
        found["params"] += _tensors_in([getattr(zero, name, None) for name in _PARAM_BUFFERS])
        found["params"] += [getattr(p, "ds_tensor", None) for p in self.unwrap(model).parameters()]
        found["params"] += masters
        found["grads"] += [t.grad for t in masters]
        found["grads"] += _tensors_in([getattr(zero, name, None) for name in _GRAD_BUFFERS])
        return found

    def measure_inside_step(self, take: Callable[[], None]) -> None:
        """Also right after the engine's backward: ZeRO-1/2 hold their reduced gradients
        there, before the optimiser step takes its fp32 partition of them."""
        if self.engine is None:
            return
        backward = self.engine.backward

        def measured(*args: Any, **kwargs: Any) -> Any:
            result = backward(*args, **kwargs)
            take()
            return result

        self.engine.backward = measured

    def configure(self, batch_size: int | None, optim: Mapping[str, Any],
                  precision: str) -> None:
        self.settings = {"batch_size": batch_size or 1, "optim": dict(optim or {}),
                         "precision": precision}

    def _ensure_group(self) -> None:
        """DeepSpeed needs a process group: a run without one gets a 1-process gloo group,
        which `teardown` destroys."""
        if not is_distributed():
            store = tempfile.NamedTemporaryFile(prefix="trainrun-ds-", delete=False)
            store.close()
            os.unlink(store.name)
            torch_dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0,
                                          world_size=1)
            self._own_group = True
        if "LOCAL_RANK" not in os.environ:  # DeepSpeed asserts it is there
            os.environ["LOCAL_RANK"] = str(get_local_rank())
            self._set_local_rank = True

    def setup(self, model: nn.Module, device: torch.device,
              make_optimizer: MakeOptimizer | None) -> tuple[nn.Module, Optimizers | None]:
        settings = self.settings
        self.config = deepspeed_config(self.options, settings["batch_size"], get_world_size()
                                       if is_distributed() else 1, settings["optim"],
                                       settings["precision"])
        model = model.to(device)
        if self.compile_options is not None:
            if self._stage() == 3:
                raise ValueError(NO_COMPILE_AT_ZERO_3)
            compile_module(model, "model", self.compile_options)
        if make_optimizer is None:  # evaluation only: no engine needed
            return model, None
        optimizer = make_optimizer(model)
        if isinstance(optimizer, Mapping):
            raise ValueError("strategy 'deepspeed' takes one optimiser; optim.per_module "
                             "needs strategy 'separate_ddp'")
        # how a checkpoint of another strategy is matched to them (_load_whole)
        self._group_names = optimizer_order(optimizer, model)
        self._groups = optimizer_groups(optimizer)
        _check_fp16(settings["precision"], device)
        _skip_shared_memory_comm_build()
        self._ensure_group()
        import deepspeed

        _forget_stale_deepspeed_groups()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=self.config)
        self.engine = engine
        if self._stage() == 3:
            share_fp32_master(engine.optimizer)
        return MMDeepSpeedEngineWrapper(engine, settings["precision"]), optimizer

    def resume_refusal(self, path: Path, precision: str, accumulate: int) -> str | None:
        """Another strategy's checkpoint reaches the engine's optimiser through ZeRO's
        universal loading: not without ZeRO, nor under fp16 or inside an accumulation group
        (`deepspeed_change_refusal`)."""
        written = checkpoint_format(path)
        if written.name == self.FORMAT:
            stage = saved_zero_stage(path)
            if stage == self._stage() or 0 not in (stage, self._stage()):
                return None
            return (f"it was written under ZeRO stage {stage}, and this run has stage "
                    f"{self._stage()}: without ZeRO DeepSpeed keeps its optimiser state in a "
                    f"form of its own; resume it with strategy.zero_stage {stage}")
        if self._stage() == 0:
            return ("strategy 'deepspeed' without ZeRO (zero_stage 0) takes only its own "
                    "checkpoints: resume with strategy.zero_stage 1, 2 or 3, or under the "
                    "strategy that wrote it")
        return deepspeed_change_refusal(written.read_train_state(path), precision, accumulate)

    def _stage(self) -> int:
        """The engine's ZeRO stage (0 without ZeRO)."""
        stage = _lookup(self.config or {}, "zero_optimization.stage")
        return 0 if stage is _MISSING else int(stage)

    def optimizer_groups(self, optimizer: Optimizers | None) -> Groups | None:
        """The groups as the config made them: the engine holds each as one flat tensor."""
        return self._groups if self.engine is not None else super().optimizer_groups(optimizer)

    def optim_wrapper(self, model: nn.Module, optimizer: Optimizers | None) -> Any:
        if self.engine is None or optimizer is None:
            return None
        return DeepSpeedOptimWrapper(self.engine, optimizer, self.settings["precision"])

    # ------------------------------------------------------------------ weights

    @contextlib.contextmanager
    def _gathered(self, model: nn.Module, modifier_rank: int | None) -> Any:
        """ZeRO-3's partitioned parameters whole for the duration (every rank must enter)."""
        if not self._partitioned():
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.unwrap(model).parameters()),
                                               modifier_rank=modifier_rank):
            yield

    def model_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """The whole model with plain keys, on every rank (under ZeRO-3 every rank must call
        this: the parameters are gathered)."""
        with self._gathered(model, None):
            return {k: v.detach().to("cpu", copy=True)
                    for k, v in self.unwrap(model).state_dict().items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Tensor]) -> None:
        """Load whole weights on every rank, and refresh the optimiser's fp32 master copies."""
        with self._gathered(model, 0):
            self.unwrap(model).load_state_dict(state)
        refresh = getattr(getattr(self.engine, "optimizer", None), "refresh_fp32_params", None)
        if refresh is not None:
            refresh()

    # ---------------------------------------------- ZeRO-3's partitions (see Strategy's four)

    def _partitioned(self) -> bool:
        return self.engine is not None and self._stage() == 3

    def param_shards(self, model: nn.Module) -> dict[str, Tensor]:
        """Under ZeRO-3, each parameter's partition on this rank (``ds_tensor``: flat, of one
        size on every rank, the last rank's padded with zeros)."""
        if not self._partitioned():
            return super().param_shards(model)
        return {name: param.ds_tensor.detach()
                for name, param in self.unwrap(model).named_parameters()}

    def shards_written(self, model: nn.Module) -> None:
        """Parameters ZeRO-3 keeps gathered (those under its persistence threshold, which it
        gathers again only after an optimiser step) take their partitions' new values."""
        if not self._partitioned():
            return
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        gathered = {name: param for name, param in self.unwrap(model).named_parameters()
                    if param.ds_status == ZeroParamStatus.AVAILABLE}
        whole = self.full_params(model, {name: param.ds_tensor
                                         for name, param in gathered.items()})
        for name, param in gathered.items():
            param.data.copy_(whole[name])

    def full_params(self, model: nn.Module, shards: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Whole tensors from every rank's partitions (one all-gather per parameter)."""
        if not self._partitioned():
            return super().full_params(model, shards)
        params = dict(self.unwrap(model).named_parameters())
        whole = {}
        for name, shard in shards.items():
            parts = [torch.empty_like(shard) for _ in range(get_world_size())]
            torch_dist.all_gather(parts, shard.contiguous())
            param = params[name]
            whole[name] = torch.cat(parts)[:param.ds_numel].view(param.ds_shape)
        return whole

    def shard_params(self, model: nn.Module, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's partition of each whole tensor, padded as ZeRO-3 pads its own."""
        if not self._partitioned():
            return super().shard_params(model, full)
        params = dict(self.unwrap(model).named_parameters())
        shards = {}
        for name, tensor in full.items():
            local = params[name].ds_tensor
            size = local.numel()
            flat = tensor.reshape(-1).to(local.device)
            piece = torch.zeros(size, dtype=flat.dtype, device=flat.device)
            mine = flat[get_rank() * size:(get_rank() + 1) * size]
            piece[:mine.numel()] = mine
            shards[name] = piece
        return shards

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, model: nn.Module, optimizer: Optimizers | None,
                        extra: dict[str, Any]) -> None:
        """DeepSpeed's directory at ``path`` (every rank writes its part) plus the runner's
        ``extra`` in ``train_state.pt`` from rank 0."""
        if self.engine is None:
            return super().save_checkpoint(path, model, optimizer, extra)
        if self.engine.micro_steps % self.engine.gradient_accumulation_steps():
            log.warning("this checkpoint falls between the micro-steps of an accumulation "
                        "group; DeepSpeed does not save the gradients accumulated so far, so a "
                        "run resumed from it will differ from one that never stopped (make "
                        "checkpoint.interval a multiple of optim.accumulate)")
        self.engine.save_checkpoint(path, tag=TAG, save_latest=False)
        _fsync(self.own_files(path, get_rank()))
        if is_main_process():
            save_state_file(Path(path) / TRAIN_STATE, extra)
        barrier()
        return None

    def load_checkpoint(self, path: str, model: nn.Module,
                        optimizer: Optimizers | None) -> dict[str, Any]:
        """Restore the engine on every rank from a DeepSpeed checkpoint of any number of
        processes, or from another strategy's (`_load_whole`); returns the runner's state."""
        if checkpoint_format(path).name != self.FORMAT or self.engine is not None and \
                saved_zero_stage(path) != self._stage():  # cut for another stage: read whole
            return self._load_whole(path, model, optimizer)
        if self.engine is None:
            raise ValueError(f"{path} is a DeepSpeed checkpoint; resuming it needs training "
                             "(an optimiser)")
        saved = saved_world_size(path)
        if saved is None or saved == get_world_size():
            self._load_engine(path)
        else:  # ZeRO's partitions are cut for `saved` processes
            with universal_copy(path, saved) as universal:
                self._load_engine(universal, universal=True)
            _own_step_counts(self.engine.optimizer)
            if is_main_process():
                log.info("resume: %s was written by %d processes, this job has %d: loaded "
                         "through DeepSpeed's universal checkpoint (converted beside it, then "
                         "removed)", path, saved, get_world_size())
        return FORMATS[self.FORMAT].read_train_state(Path(path))

    def _load_whole(self, path: str, model: nn.Module,
                    optimizer: Optimizers | None) -> dict[str, Any]:
        """Restore the engine from a checkpoint another strategy (or another ZeRO stage)
        wrote, read whole on every rank: the weights, then each parameter's fp32 master copy
        and optimiser state (matched by name) through a universal checkpoint written in a
        temporary directory of this rank's own, which the ZeRO optimiser cuts into its
        partitions. Returns the runner's state."""
        stage = self._stage()
        if self.engine is None or stage == 0:  # the torch optimiser steps itself
            return super().load_checkpoint(path, model, optimizer)
        state = load_state_file(path)
        weights = state.pop("model")
        self.load_model_state_dict(model, weights)
        saved = state.pop("optimizer", None)
        if saved is None:
            return state
        named = named_optimizer_state(saved, self._group_names)
        zero = self.engine.optimizer
        import deepspeed

        records = {"loss_scaler": zero.loss_scaler, "dynamic_loss_scale":
                   zero.dynamic_loss_scale, "clip_grad": getattr(zero, "clip_grad", 0.0),
                   "ds_version": deepspeed.__version__}
        with tempfile.TemporaryDirectory(prefix="trainrun-universal-") as folder:
            write_universal(folder, weights, named, records)
            zero.load_state_dict(state_dict_list=None, load_optimizer_states=True,
                                 load_from_fp32_weights=True, checkpoint_folder=folder)
        _own_step_counts(zero)
        if stage == 3:  # its loader gave every group the first group's settings
            for group, saved_group in zip(zero.optimizer.param_groups, named["param_groups"],
                                          strict=True):
                group.update((key, value) for key, value in saved_group.items()
                             if key != "params")
        else:  # the model's weights from the fp32 master copies, as DeepSpeed's loading does
            zero.update_lp_params()
        return state

    def _load_engine(self, path: str | os.PathLike, universal: bool = False) -> None:
        """The engine's state from the DeepSpeed directory ``path``; ``universal``: one in
        DeepSpeed's universal form, which the engine reads when its config says so (a setting
        read only while loading)."""
        config = self.engine._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = universal or before
        try:
            with weights_only_loads(path):
                loaded, _ = self.engine.load_checkpoint(str(path), tag=TAG)
        finally:
            config.load_universal_checkpoint = before
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}")

    def save_checkpoint_async(self, path: str, model: nn.Module, optimizer: Optimizers | None,
                              extra: dict[str, Any]) -> Future:
        raise ValueError("checkpoint.async: strategy 'deepspeed' writes its checkpoints through "
                         "its engine, which has no asynchronous save here; use ddp or fsdp")

    def teardown(self) -> None:
        super().teardown()
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        if self._own_group:
            leave_dist()
        if self._set_local_rank:
            os.environ.pop("LOCAL_RANK", None)
        self._own_group = self._set_local_rank = False

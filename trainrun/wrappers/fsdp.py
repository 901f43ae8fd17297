"""Strategy 'fsdp': fully sharded data parallel on PyTorch's ``fully_shard`` (FSDP2).

Every rank keeps only its shard of each parameter, gradient and optimiser state (DTensors);
parameters are gathered around each shard unit's forward and backward. ``fully_shard`` trains
on CPU with gloo as well as on CUDA with NCCL (the older ``FullyShardedDataParallel`` class
needs an accelerator). Checkpoints are directories written with
``torch.distributed.checkpoint``, every rank its own shard, so they reshard: a checkpoint of 2
ranks resumes on 3.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

from trainrun.checkpoint.dcp import check_metadata, flat_optimizer_state, quiet_single_process
from trainrun.checkpoint.files import save_state_file
from trainrun.checkpoint.format import checkpoint_format, load_state_file
from trainrun.checkpoint.optimizer_state import (
    OPTIMIZER_MISMATCH_HINT,
    Groups,
    OptimizerMismatch,
    named_optimizer_state,
    optimizer_order,
)
from trainrun.checkpoint.train_state import TRAIN_STATE
from trainrun.dist import barrier, get_local_size, get_world_size, is_distributed, is_main_process
from trainrun.dist.device import DTYPE_ALIASES, DTYPES
from trainrun.dist.timeouts import get_timeout
from trainrun.messages import human
from trainrun.registry import FORMATS
from trainrun.wrappers.base import MakeOptimizer, Optimizers, Strategy, compile_module
from trainrun.wrappers.base_model import loss_step
from trainrun.wrappers.memory import ParamSpec, StateBytes, replicated
from trainrun.wrappers.pipeline import (
    Pipeline,
    check_model_parallel,
    check_pp,
    check_protocol,
    cut,
    held_parts,
    rank_stages,
    shared_parameters,
)
from trainrun.wrappers.tensor_parallel import (
    apply_plan,
    check_plan,
    held_plan,
    model_plan,
    split_after_checkpoint,
    split_shapes,
    split_within_parts,
    whole_for_checkpoint,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

# torch.distributed.checkpoint and torch.distributed.fsdp are imported where they are used:
# together they cost about 1.4 s, which every process of a run under another strategy (and
# every tool reading the config) would otherwise pay at start-up.

log = logging.getLogger("trainrun")

SHARDINGS = ("full", "grad_op", "none", "hybrid")


def parse_dtype(key: str, name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    short = DTYPE_ALIASES.get(name, name)
    if short not in DTYPES:
        raise ValueError(f"strategy.mixed_precision.{key} must be one of "
                         f"{', '.join([*DTYPES, *DTYPE_ALIASES])} (or null); got {name!r}")
    return DTYPES[short]


def mixed_precision_policy(options: dict[str, Any] | None) -> MixedPrecisionPolicy:
    """``{param_dtype, reduce_dtype, output_dtype}`` by name (e.g. 'bf16') as FSDP2's policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    options = dict(options or {})
    unknown = sorted(set(options) - {"param_dtype", "reduce_dtype", "output_dtype"})
    if unknown:
        raise ValueError(f"strategy.mixed_precision takes param_dtype, reduce_dtype and "
                         f"output_dtype; not {unknown[0]!r}")
    return MixedPrecisionPolicy(**{key: parse_dtype(key, value) for key, value in
                                   options.items()})


def check_sharding(sharding: Any) -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"strategy.sharding must be one of {', '.join(SHARDINGS)}; "
                         f"got {sharding!r}")


def check_wrap_keys(wrap: Mapping[str, Any] | None) -> None:
    unknown = sorted(set(wrap or {}) - {"classes", "min_params"})
    if unknown:
        raise ValueError(f"strategy.wrap takes classes and min_params; not {unknown[0]!r}")


def check_tp(tp: Any, world: int | None = None) -> None:
    """Refuse a ``strategy.tp`` that is not a positive int, or that does not divide ``world``
    (where known)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"strategy.tp must be a positive int (the tensor-parallel ranks); "
                         f"got {tp!r}")
    if world is not None and world % tp:
        raise ValueError(f"strategy.tp: {tp} must divide the world size; got {world} "
                         f"process(es)")


def check_pipeline(pp: int, split: Any, microbatches: Any, schedule: Any,
                   sequence_parallel: bool, world: int | None = None, tp: int = 1,
                   virtual: Any = 1) -> None:
    """Refuse pipeline options of the wrong kind (`check_pp`), and sequence parallelism with
    them: a stage would hand the next one its part of the sequence only."""
    check_pp(pp, pp if microbatches is None else microbatches, schedule, split, world, tp,
             virtual)
    if pp > 1 and sequence_parallel:
        raise ValueError("strategy.sequence_parallel does not compose with strategy.pp yet: a "
                         "stage would hand the next only its part of the sequence; set one "
                         "of them")


def check_pipeline_batches(train: Mapping[str, Any] | None, microbatches: int) -> None:
    """Refuse training batches the pipeline cannot take: its shapes are fixed at the first
    step, so every batch must be whole (``drop_last``), and cut evenly into the microbatches."""
    if not train:
        return
    batch = train.get("batch_size")
    if isinstance(batch, int) and batch % microbatches:
        raise ValueError(f"strategy.pp_microbatches: {microbatches} microbatches must divide "
                         f"data.train.batch_size; got {batch}")
    if not train.get("drop_last", False):
        raise ValueError("strategy.pp fixes the pipeline's shapes at its first step: every "
                         "training batch must be whole; set data.train.drop_last: true")


NO_UNITS = ("strategy.activation_checkpointing checkpoints the shard units: name them with "
            "strategy.wrap (classes or min_params)")


def check_sequence_parallel(sequence_parallel: Any, tp: int) -> None:
    """Refuse a ``strategy.sequence_parallel`` that is not a bool, or true without ``tp`` > 1
    (it cuts what lies between tensor-parallel layers)."""
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"strategy.sequence_parallel must be true or false; got "
                         f"{sequence_parallel!r}")
    if sequence_parallel and tp == 1:
        raise ValueError("strategy.sequence_parallel: true needs tensor parallelism "
                         "(strategy.tp > 1): it cuts the activations between the layers tp "
                         "splits; got tp 1")


def device_mesh(sharding: str, device: torch.device, shard_size: int | None,
                tp: int = 1, pp: int = 1) -> DeviceMesh:
    """The ranks as a mesh of named dimensions: ``dp_shard`` (full, grad_op) or
    ``dp_replicate`` x ``dp_shard`` (none, hybrid), then ``pp`` and ``tp`` where they are
    above 1. A rank's tensor-parallel peers are consecutive ranks (on one node, where it has
    ``tp`` or more), and the stages of its pipeline are the next ones after them."""
    from torch.distributed.device_mesh import init_device_mesh

    world = get_world_size()
    check_tp(tp, world)
    check_model_parallel(world, tp, pp)
    data = world // (tp * pp)
    if sharding in ("full", "grad_op"):
        dims = {"dp_shard": data}
    else:
        size = 1 if sharding == "none" else shard_size or max(get_local_size() // tp, 1)
        if size < 1 or data % size:
            raise ValueError(f"strategy.hybrid_shard_size must divide the data-parallel ranks "
                             f"({data} = world size {world} / tp {tp} / pp {pp}); got {size}")
        dims = {"dp_replicate": data // size, "dp_shard": size}
    if pp > 1:
        dims["pp"] = pp
    if tp > 1:
        dims["tp"] = tp
    return init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimensions of ``mesh`` that ``fully_shard`` shards and replicates over."""
    names = [name for name in mesh.mesh_dim_names if name.startswith("dp_")]
    return mesh if len(names) == mesh.ndim else mesh[tuple(names)]


def shard_units(model: nn.Module, wrap: dict[str, Any] | None,
                check: bool = True) -> list[nn.Module]:
    """The submodules that become their own shard units, innermost first: those whose class
    is named in ``wrap['classes']``, or that hold at least ``wrap['min_params']`` parameters
    not already in a unit below them. ``check``: refuse a class the model does not have (a
    pipeline stage need not have every class the whole model has)."""
    check_wrap_keys(wrap)
    wrap = dict(wrap or {})
    classes = set(wrap.get("classes") or ())
    min_params = wrap.get("min_params")
    found = {type(m).__name__ for m in model.modules()}
    missing = sorted(classes - found)
    if missing and check:
        raise ValueError(f"strategy.wrap.classes: the model has no module of class "
                         f"{missing[0]!r}")
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        """Parameters of ``module`` not in a unit (post-order, so children go first)."""
        free = sum(visit(child) for child in module.children())
        free += sum(p.numel() for p in module.parameters(recurse=False))
        if module is model:
            return free
        if type(module).__name__ in classes or (min_params is not None and free >= min_params):
            units.append(module)
            return 0
        return free

    visit(model)
    return units


def _shard_group(options: Mapping[str, Any], world_size: int) -> tuple[int, str]:
    """How many ranks share each parameter's shards under ``options``, and that in words."""
    sharding = options["sharding"]
    if sharding in ("full", "grad_op"):
        return world_size, f"{world_size} ranks (sharding {sharding})"
    if sharding == "none":
        return 1, "1 rank: every rank holds everything (sharding none)"
    size = options["hybrid_shard_size"]
    if size is not None:
        return size, f"{size} ranks (sharding hybrid, hybrid_shard_size), replicated across"
    size = get_local_size()
    return size, (f"{size} rank{'s' if size != 1 else ''} (sharding hybrid: a node's ranks, "
                  f"{size} as this process was started; set strategy.hybrid_shard_size to "
                  f"plan for another)")


def _shard_numel(shape: tuple[int, ...], size: int) -> int:
    """Elements of one rank's padded shard of a parameter of ``shape`` over ``size`` ranks."""
    if not shape:
        return 1
    rows = -(-shape[0] // size)
    return rows * math.prod(shape[1:])


def _gathered_note(model: nn.Module, options: Mapping[str, Any]) -> str:
    """The parameters a shard unit gathers whole while it computes, in the gathered dtype."""
    dtype = parse_dtype("param_dtype", (options["mixed_precision"] or {}).get("param_dtype"))

    def nbytes(params: Any) -> int:
        return sum(p.numel() * (dtype.itemsize if dtype else p.element_size()) for p in params)

    units = shard_units(model, options["wrap"])  # innermost first: a unit's own parameters
    claimed: set[int] = set()
    sizes = []
    for unit in [*units, model]:
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        sizes.append(nbytes(own))
    largest, whole = max(sizes), sum(sizes)
    if options["sharding"] == "grad_op":
        return (f"not in the total: parameters gathered whole from forward to backward "
                f"(sharding grad_op keeps them): up to the whole model, {human(whole)}")
    return (f"not in the total: each shard unit's parameters gathered whole while it computes "
            f"(the largest of {len(sizes)} units: {human(largest)}; prefetching may hold two)")


def stage_specs(model: nn.Module, specs: Sequence[ParamSpec], pp: int,
                split: Sequence[str] | None, virtual: int = 1) -> list[list[ParamSpec]]:
    """The parameters each of the ``pp`` ranks of a pipeline holds: its stage's (its
    ``virtual`` stages' under an interleaved schedule), one shared by two stages (a tied
    embedding) on both; cut from copies of ``model`` (built on the meta device)."""
    check_protocol(model, pp)
    first = {}  # every name of a parameter -> the name its spec has (its first)
    for names in [[name] for name, _ in model.named_parameters()] + shared_parameters(model):
        first.update(dict.fromkeys(names, names[0]))
    by_name = {spec.name: spec for spec in specs}
    ranks = []
    for rank in range(pp):
        held: dict[str, None] = {}
        for stage in range(rank, pp * virtual, pp):
            part = copy.deepcopy(model)
            cut(part, pp * virtual, stage, split)
            held.update(dict.fromkeys(first[name] for name, _ in
                                      part.named_parameters(remove_duplicate=False)))
        ranks.append([by_name[name] for name in held])
    return ranks


def _pipeline_note(plans: list[StateBytes], plan: StateBytes, options: Mapping[str, Any],
                   staged: bool) -> str:
    """What the memory plan says of the pipeline: which stage the figures are, and the
    activations in flight it leaves out."""
    pp, schedule, virtual = options["pp"], options["pp_schedule"], options["pp_virtual_stages"]
    microbatches = options["pp_microbatches"] or pp
    held = min(pp, microbatches) if schedule == "1f1b" else microbatches
    what = f"pipeline of {pp} stages (strategy.pp)" if virtual == 1 else \
        f"pipeline of {pp * virtual} stages on {pp} ranks (strategy.pp, pp_virtual_stages)"
    each = "stage" if virtual == 1 else "rank"
    if not staged:
        where = f"{what}: the figures are the whole model's"
    else:
        totals = ", ".join(human(one.total) for one in plans)
        where = (f"{what}: the figures are {each} {plans.index(plan) + 1}'s, the largest "
                 f"({each}s: {totals})")
    return (f"{where}; not in the total: the activations of up to {held} microbatches in "
            f"flight on the first stage ({schedule}, {microbatches} microbatches)")


def _shard(module: nn.Module, wrap: dict[str, Any] | None, plan: dict[str, str] | None,
           mesh: DeviceMesh, sequence_parallel: bool, activation_checkpointing: bool,
           compile: dict[str, Any] | None, kwargs: dict[str, Any]) -> list[nn.Module]:
    """Shard ``module`` (the model, or one pipeline stage of it) in place: its units, split by
    the tensor-parallel ``plan`` (where given), checkpointed, compiled, then ``fully_shard``
    with ``kwargs``, units first. Returns the units."""
    from torch.distributed.fsdp import fully_shard

    units = shard_units(module, wrap, check=False)
    if plan is not None:
        apply_plan(module, held_plan(module, plan), mesh["tp"], sequence_parallel)
    if activation_checkpointing:
        if not units:
            raise ValueError(NO_UNITS)
        from torch.distributed._composable import checkpoint

        for unit in units:
            checkpoint(unit)
    if compile is not None:
        compile_units(module, units, compile)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)
    return units


def compile_units(model: nn.Module, units: list[nn.Module], options: dict[str, Any]) -> None:
    """Compile each shard unit (the whole model where there are none), as torchtitan compiles
    each transformer block: every unit is then one compiled region between FSDP's gathers."""
    names = {id(module): name for name, module in model.named_modules()}
    for unit in units or [model]:
        compile_module(unit, f"model.{names[id(unit)]}" if unit is not model else "model",
                       options)


def _data_parallel_placement(param: nn.Parameter) -> Any:
    """How ``fully_shard`` cuts ``param`` over the data-parallel ranks: its rows (None: the
    default), or its columns where tensor parallelism already cut the rows within parts
    (``colwise_fused``): two strided cuts of one dimension do not compose in DTensor, whose
    whole tensor would then come out in the wrong order."""
    from torch.distributed.tensor import Shard

    return Shard(1) if param.ndim > 1 and split_within_parts(param) else None


class MMFullyShardedDataParallel(nn.Module):
    """A model sharded with ``fully_shard``, behind ``train_step``/``val_step``/``test_step``.

    ``module`` is the user's model, sharded in place (its parameters become DTensors, its
    state dict keeps its keys). The arguments come from the config as plain strings and
    dicts. ``train_step(data, optim_wrapper)`` runs the forward in loss mode through the
    sharded model and returns the values to log, as ``BaseModel.train_step`` does;
    ``val_step`` and ``test_step`` are the module's own; ``no_sync`` accumulates gradients
    without reducing them (micro-steps that do not step). The user's model is ``.module``.

    Args:
        module: the user's model, on its device.
        sharding: ``full`` | ``grad_op`` (no resharding after forward) | ``none``
            (replicated) | ``hybrid`` (sharded within groups of ``hybrid_shard_size`` ranks,
            replicated across them).
        mixed_precision: ``{param_dtype, reduce_dtype, output_dtype}`` by dtype name (e.g.
            ``bf16``); None: everything in the model's dtype.
        cpu_offload: keep the parameters, gradients and optimiser state on the CPU.
        wrap: ``{classes, min_params}``: the submodules that become their own shard units
            (those of the classes named, or holding at least ``min_params`` parameters not
            already in a unit); None: the whole model is one unit.
        activation_checkpointing: recompute those units' activations in backward.
        hybrid_shard_size: the ranks in each sharding group under ``hybrid`` (it must
            divide the world size); None: a node's ranks.
        device: the device of the mesh; None: that of the module's parameters.
        compile: ``torch.compile`` options (see ``compile_module``) for each unit, or for the
            whole model where no unit is named, before it is sharded (its hooks stay eager);
            None: no compiling.
        tp: the tensor-parallel ranks: consecutive ranks that split each planned layer
            between them (see ``trainrun.wrappers.tensor_parallel``); 1: none.
        tp_plan: module-name patterns to tensor-parallel styles; None: the model's own.
        sequence_parallel: between the split layers, cut the activations along the sequence
            (the plan's ``sequence_parallel`` and ``sequence_split`` modules); needs ``tp`` > 1.
        pp: the pipeline stages: the model is cut into ``pp`` parts, each rank holding one and
            its pipeline's ranks running them in turn (see ``trainrun.wrappers.pipeline``);
            1: none.
        pp_split: the names of the parts where stages 2, 3, ... begin; None: between the
            model's blocks, evenly.
        pp_microbatches: the parts each batch is cut into for the pipeline; None: ``pp``.
        pp_schedule: the order the stages run the microbatches in: ``gpipe`` (all forwards,
            then all backwards), ``1f1b`` (one forward, one backward, once the pipeline is
            full: fewer activations held) or ``interleaved_1f1b`` (1f1b over several stages a
            rank: a smaller bubble).
        pp_virtual_stages: the stages each rank holds under ``interleaved_1f1b``; 1
            otherwise.

    Raises:
        ValueError: an unknown sharding, dtype name or wrap key, a class ``wrap`` names that
            the model does not have, a ``hybrid_shard_size`` or ``tp`` that does not divide
            the world size, ``activation_checkpointing`` without shard units, ``tp`` > 1
            without a plan, ``sequence_parallel`` under a plan without a sequence-parallel
            module, or ``pp`` > 1 for a model that does not say how it runs in parts.
    """

    def __init__(self, module: nn.Module, sharding: str = "full",
                 mixed_precision: dict[str, Any] | None = None, cpu_offload: bool = False,
                 wrap: dict[str, Any] | None = None, activation_checkpointing: bool = False,
                 hybrid_shard_size: int | None = None, device: torch.device | None = None,
                 compile: dict[str, Any] | None = None, tp: int = 1,
                 tp_plan: dict[str, str] | None = None, sequence_parallel: bool = False,
                 pp: int = 1, pp_split: list[str] | None = None,
                 pp_microbatches: int | None = None, pp_schedule: str = "1f1b",
                 pp_virtual_stages: int = 1):
        super().__init__()
        check_sharding(sharding)
        check_sequence_parallel(sequence_parallel, tp)
        check_pipeline(pp, pp_split, pp_microbatches, pp_schedule, sequence_parallel,
                       virtual=pp_virtual_stages)
        device = device or next(module.parameters()).device
        shard_units(module, wrap)  # (the whole model has the classes wrap names)
        mesh = device_mesh(sharding, device, hybrid_shard_size, tp, pp)
        plan = model_plan(module, tp_plan, tp, sequence_parallel) if tp > 1 else None
        shared = shared_parameters(module)
        chunks = [module]  # what is sharded: the model, or each stage this rank holds
        if pp > 1:
            check_protocol(module, pp)
            stages = rank_stages(mesh, pp_virtual_stages)
            chunks = [module] if len(stages) == 1 else \
                [copy.deepcopy(module) for _ in stages]
            for chunk, stage in zip(chunks, stages, strict=True):
                cut(chunk, pp * pp_virtual_stages, stage, pp_split)
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs: dict[str, Any] = {
            "mesh": data_mesh(mesh),
            "reshard_after_forward": sharding != "grad_op",
            "mp_policy": mixed_precision_policy(mixed_precision),
        }
        if tp > 1:
            kwargs["shard_placement_fn"] = _data_parallel_placement
        if cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        self.units = [unit for chunk in chunks for unit in _shard(
            chunk, wrap, plan, mesh, sequence_parallel, activation_checkpointing, compile,
            kwargs)]
        self.roots = chunks  # the fully_shard roots
        self.module = chunks[0] if len(chunks) == 1 else held_parts(module, chunks)
        self.mesh = mesh
        self.pipeline = Pipeline(self.module, chunks, mesh, pp_microbatches or pp, pp_schedule,
                                 shared, device) if pp > 1 else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (micro-steps that do not step)."""
        for root in self.roots:
            root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for root in self.roots:
                root.set_requires_gradient_sync(True)

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, Tensor]:
        if self.pipeline is not None:
            return self.pipeline.train_step(data, optim_wrapper)
        return loss_step(self, data, optim_wrapper)

    def val_step(self, data: Any) -> Any:
        if self.pipeline is not None:
            return self.pipeline.predict(data, "predict")
        return self.module.val_step(data)

    def test_step(self, data: Any) -> Any:
        if self.pipeline is not None:
            return self.pipeline.predict(data, "predict")
        return self.module.test_step(data)


# ---------------------------------------------------------------- checkpoints

def _sharded_state(module: nn.Module, optimizer: Optimizers | None,
                   flat: bool = False) -> dict[str, Any]:
    """This rank's shards of model and optimiser, keyed by the plain model's names: what DCP
    saves, and the template it loads into (tensors that a tensor-parallel fused layer splits
    within its parts are whole: see `whole_for_checkpoint`). ``flat``: the optimiser's
    options per parameter name instead of per group (`flat_optimizer_state`)."""
    return _checkpoint_state(module, optimizer, flat)[0]


def _checkpoint_state(module: nn.Module, optimizer: Optimizers | None, flat: bool = False
                      ) -> tuple[dict[str, Any], dict[tuple[str, ...], Any]]:
    """`_sharded_state`, and the tensors made whole in it (for `split_after_checkpoint`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(
        module, [optimizer] if optimizer is not None else [],
        options=StateDictOptions(flatten_optimizer_state_dict=flat))
    return whole_for_checkpoint({"model": model_state} if optimizer is None else
                                {"model": model_state, "optimizer": optim_state})


def _held(model: MMFullyShardedDataParallel, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The entries of a whole model's ``state`` that ``model`` holds: under ``pp``, its
    stage's; otherwise all of them (an entry it lacks is an error then)."""
    if model.pipeline is None:
        return state
    keys = model.module.state_dict().keys()
    return {key: value for key, value in state.items() if key in keys}


def _start_directory(path: str, extra: dict[str, Any]) -> None:
    """Rank 0 creates checkpoint directory ``path`` and writes the runner's ``extra`` in it;
    every rank returns once it exists, ready for its shard."""
    if is_main_process():
        os.makedirs(path, exist_ok=True)
        save_state_file(Path(path) / TRAIN_STATE, extra)
    barrier()


# ---------------------------------------------------------------- the strategy

class FSDPStrategy(Strategy):
    """Parameters, gradients and optimiser state sharded over ranks (``fully_shard``).

    ``strategy.type: fsdp``. In a distributed job the model is wrapped in
    ``MMFullyShardedDataParallel``; in a single process it is not sharded. It takes one
    optimiser over the whole model (not ``optim.per_module``). Checkpoints are
    ``torch.distributed.checkpoint`` directories, every rank writing its own shard, so a
    checkpoint resumes on another number of ranks.

    Args:
        sharding: ``full`` | ``grad_op`` (no resharding after forward) | ``none``
            (replicated) | ``hybrid`` (sharded within groups of ``hybrid_shard_size`` ranks,
            replicated across them).
        mixed_precision: ``{param_dtype, reduce_dtype, output_dtype}`` by dtype name; None:
            the model's dtype.
        cpu_offload: keep the parameters, gradients and optimiser state on the CPU.
        wrap: ``{classes, min_params}``: the submodules that become their own shard units.
        activation_checkpointing: recompute the shard units' activations in backward (needs
            ``wrap``).
        hybrid_shard_size: the ranks in each sharding group under ``hybrid``; None: a
            node's ranks (divided by ``tp``).
        tp: the tensor-parallel ranks: consecutive ranks that split each layer the plan
            names between them, and see the same batches; the data-parallel ranks are the
            world size divided by it.
        tp_plan: module-name patterns to tensor-parallel styles (see
            ``trainrun.wrappers.tensor_parallel``); None: the model's ``tp_plan``, else a
            Hugging Face model's own.
        sequence_parallel: between the split layers, cut the activations along the sequence
            (norms and dropout compute each rank's part); needs ``tp`` > 1 and a plan that
            names its ``sequence_parallel`` modules.
        pp: the pipeline stages: the model is cut into ``pp`` parts that consecutive groups
            of ``tp`` ranks hold and run in turn, on the same batches, cut into
            ``pp_microbatches``; the model says how it runs in parts (see
            ``trainrun.wrappers.pipeline``).
        pp_split: the names of the parts where stages 2, 3, ... begin; None: between the
            model's blocks, evenly.
        pp_microbatches: the parts each batch is cut into; None: ``pp``.
        pp_schedule: ``gpipe``, ``1f1b`` or ``interleaved_1f1b`` (several stages a rank).
        pp_virtual_stages: the stages each rank holds under ``interleaved_1f1b`` (``pp`` x it
            in all; rank ``r`` holds stages ``r``, ``r + pp``, ...); 1 otherwise.
    """

    name = "fsdp"
    COMPILES = ("each shard unit strategy.wrap names (the whole model where it names none), "
                "before fully_shard")

    # trainrun's wrapper, and torch's fully sharded modules of both generations (by name: see
    # the note on imports at the top)
    WRAPPERS = (MMFullyShardedDataParallel, "FSDPModule", "FullyShardedDataParallel")
    WRITER_RANK = re.compile(r"^__(\d+)[_.]")  # DCP's shards: __<rank>_<n>.distcp
    FORMAT = "dcp"  # a torch.distributed.checkpoint directory (trainrun/checkpoint/dcp.py)
    OPTIONS = {
        "sharding": "full",
        "mixed_precision": None,
        "cpu_offload": False,
        "wrap": None,
        "activation_checkpointing": False,
        "hybrid_shard_size": None,
        "tp": 1,
        "tp_plan": None,
        "sequence_parallel": False,
        "pp": 1,
        "pp_split": None,
        "pp_microbatches": None,
        "pp_schedule": "1f1b",
        "pp_virtual_stages": 1,
    }
    ACCEPTS = {
        "sharding": f"one of {', '.join(SHARDINGS)}",
        "mixed_precision": "null or {param_dtype, reduce_dtype, output_dtype} (dtype names)",
        "cpu_offload": "true or false",
        "wrap": "null or {classes: [class names], min_params: an int}",
        "activation_checkpointing": "true or false",
        "hybrid_shard_size": "null or an int that divides the world size",
        "tp": "a positive int that divides the world size",
        "tp_plan": "null or {module-name pattern: colwise | rowwise | colwise_gather_output | "
                   "colwise_fused:N | vocab_embedding | sequence_parallel | sequence_split}",
        "sequence_parallel": "true or false (true needs tp > 1)",
        "pp": "a positive int; pp x tp divides the world size",
        "pp_split": "null or a list of pp - 1 module names (where stages 2, 3, ... begin)",
        "pp_microbatches": "null (pp) or an int, at least pp, that divides the batch",
        "pp_schedule": "gpipe, 1f1b or interleaved_1f1b",
        "pp_virtual_stages": "1, or 2 or more under interleaved_1f1b",
    }

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._save_group: torch_dist.ProcessGroup | None = None  # async saves' collectives
        self.model_parallel_size = self.options["tp"] * self.options["pp"]
        # Pipeline stages optimise different parameters: their optimisers' options are saved
        # per parameter name, which do not collide as group numbers would
        self._flat = self.options["pp"] > 1

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        """Option values that need no model: sharding, dtype names, wrap keys, one optimiser."""
        options = cls.options_in(cfg)
        check_sharding(options["sharding"])
        mixed_precision_policy(options["mixed_precision"])
        check_wrap_keys(options["wrap"])
        check_tp(options["tp"])
        check_sequence_parallel(options["sequence_parallel"], options["tp"])
        check_pipeline(options["pp"], options["pp_split"], options["pp_microbatches"],
                       options["pp_schedule"], options["sequence_parallel"],
                       virtual=options["pp_virtual_stages"])
        if options["pp"] > 1:
            check_pipeline_batches((cfg.get("data") or {}).get("train"),
                                   options["pp_microbatches"] or options["pp"])
        if options["activation_checkpointing"] and not options["wrap"]:
            raise ValueError(NO_UNITS)
        if options["tp_plan"] is not None:
            check_plan(options["tp_plan"])
        if (cfg.get("optim") or {}).get("per_module"):
            raise ValueError("strategy 'fsdp' takes one optimiser over the whole model "
                             "(optim.per_module is for separate_ddp)")

    @classmethod
    def memory_plan(cls, specs: Sequence[ParamSpec], world_size: int, cfg: Mapping[str, Any],
                    model: nn.Module | None = None) -> StateBytes:
        """Each parameter, gradient and optimiser state is this rank's shard of it:
        `fully_shard` cuts dimension 0 in ``ceil(rows / S)`` rows (the last rank's padded) over
        S ranks (all for full and grad_op, 1 for none, a node or ``hybrid_shard_size`` for
        hybrid); all in the model's dtype (``mixed_precision`` casts only the gathered copy),
        on the CPU with ``cpu_offload``. The parameters gathered whole while a shard unit
        computes are named beside it, not counted. Under ``tp``, S counts the data-parallel
        ranks, and each parameter the tensor-parallel plan splits is first cut in ``tp``.

        Raises:
            ValueError: ``tp`` does not divide ``world_size``, or the model (where given) has
                no plan under ``tp`` > 1, the plan names modules it does not have, or no
                sequence-parallel module under ``sequence_parallel``."""
        options = cls.options_in(cfg)
        tp, pp = options["tp"], options["pp"]
        check_tp(tp, world_size)
        check_pipeline(pp, options["pp_split"], options["pp_microbatches"],
                       options["pp_schedule"], options["sequence_parallel"], world_size, tp,
                       options["pp_virtual_stages"])
        split = split_shapes(model, model_plan(model, options["tp_plan"], tp,
                                               options["sequence_parallel"]), tp) \
            if tp > 1 and model is not None else {}
        size, how = _shard_group(options, world_size // (tp * pp))
        stages = stage_specs(model, specs, pp, options["pp_split"],
                             options["pp_virtual_stages"]) \
            if pp > 1 and model is not None else [specs]
        plans = [replicated(held, lambda spec: _shard_numel(split.get(spec.name, spec.shape),
                                                            size) * spec.itemsize,
                            cpu=bool(options["cpu_offload"])) for held in stages]
        plan = max(plans, key=lambda each: each.total)
        plan.notes.append(f"sharded over {how}" + ("; all of it offloaded to the CPU "
                                                   "(cpu_offload)" if options["cpu_offload"]
                                                   else ""))
        if split:
            plan.notes.append(f"tensor parallel over {tp} ranks (strategy.tp): {len(split)} "
                              f"parameters split by the plan, the others whole on each")
        if pp > 1:
            plan.notes.append(_pipeline_note(plans, plan, options, model is not None))
        gathered = _gathered_note(model, options) if model is not None else None
        if gathered is not None and size > 1:  # (built on any world size: checks the wrap)
            plan.notes.append(gathered)
        return plan

    def setup(self, model: nn.Module, device: torch.device,
              make_optimizer: MakeOptimizer | None) -> tuple[nn.Module, Optimizers | None]:
        model = model.to(device)
        if is_distributed():
            model = MMFullyShardedDataParallel(model, device=device,
                                               compile=self.compile_options, **self.options)
        else:
            check_tp(self.options["tp"], 1)
            check_pipeline(self.options["pp"], self.options["pp_split"],
                           self.options["pp_microbatches"], self.options["pp_schedule"],
                           self.options["sequence_parallel"], world=1,
                           virtual=self.options["pp_virtual_stages"])
            log.info("strategy 'fsdp' in a single process: the model is not sharded")
            if self.compile_options is not None:
                compile_units(model, shard_units(model, self.options["wrap"]),
                              self.compile_options)
        optimizer = make_optimizer(self.unwrap(model)) if make_optimizer is not None else None
        if isinstance(optimizer, dict):
            raise ValueError("strategy 'fsdp' takes one optimiser over the whole model "
                             "(optim.per_module is for separate_ddp)")
        return model, optimizer

    def _sharded(self, model: nn.Module) -> bool:
        return isinstance(model, MMFullyShardedDataParallel)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full state with the plain model's keys; a collective: call it on every rank."""
        if not self._sharded(model):
            return super().model_state_dict(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.unwrap(model), options=StateDictOptions(
            full_state_dict=True))
        state = {key: value.cpu() for key, value in state.items()}  # on every rank
        return state if model.pipeline is None else model.pipeline.from_every_stage(state)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full state (every rank holds it) into the shards."""
        if not self._sharded(model):
            return super().load_model_state_dict(model, state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.unwrap(model), _held(model, state),
                             options=StateDictOptions(full_state_dict=True))
        return None

    def _sharded_params(self, model: nn.Module) -> dict[str, Any]:
        """The model's parameters (DTensors), every unit resharded first: the root unit keeps
        its parameters gathered after a forward without backward (validation), and a gathered
        copy would not see what is written into the shards."""
        for unit in (*model.units, *model.roots):
            unit.reshard()
        return dict(self.unwrap(model).named_parameters())

    def param_shards(self, model: nn.Module) -> dict[str, Tensor]:
        """This rank's shard of each parameter (the DTensor's local tensor)."""
        if not self._sharded(model):
            return super().param_shards(model)
        return {name: param.detach().to_local()
                for name, param in self._sharded_params(model).items()}

    def shards_written(self, model: nn.Module) -> None:
        if self._sharded(model):
            self._sharded_params(model)  # drop any gathered copy of the old values

    def full_params(self, model: nn.Module, shards: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Whole tensors from every rank's shards (all-gathers over the model's mesh; under
        ``pp``, those of every stage of the pipeline as well)."""
        if not self._sharded(model):
            return super().full_params(model, shards)
        from torch.distributed.tensor import DTensor

        params = self._sharded_params(model)
        whole = {name: DTensor.from_local(shard, params[name].device_mesh,
                                          params[name].placements, shape=params[name].shape,
                                          stride=params[name].stride()).full_tensor()
                 for name, shard in shards.items()}
        return whole if model.pipeline is None else model.pipeline.from_every_stage(whole)

    def shard_params(self, model: nn.Module, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's shard of each whole tensor, cut as `fully_shard` (and the tp plan) cut
        its parameter. Cut by redistributing a replica, which needs no communication and,
        unlike ``distribute_tensor``, knows a tp shard that fsdp cut again (strided)."""
        if not self._sharded(model):
            return super().shard_params(model, full)
        from torch.distributed.tensor import DTensor, Replicate

        params = self._sharded_params(model)
        # a pipeline stage holds its part of the model; a tied parameter, saved by two stages
        # under both its names, is a parameter once under its first name
        full = {name: tensor for name, tensor in full.items() if name in params}
        out = {}
        for name, tensor in full.items():
            mesh = params[name].device_mesh
            replica = DTensor.from_local(tensor.to(params[name].device), mesh,
                                         [Replicate()] * mesh.ndim, run_check=False)
            out[name] = replica.redistribute(mesh, params[name].placements).to_local()
        return out

    def save_checkpoint(self, path: str, model: nn.Module, optimizer: Optimizers | None,
                        extra: dict[str, Any]) -> None:
        """A directory: every rank's shard of model and optimiser (DCP) plus rank 0's
        ``extra`` in a plain torch file. Called on every rank."""
        import torch.distributed.checkpoint as dcp

        state = _sharded_state(self.unwrap(model), optimizer, self._flat)
        _start_directory(path, extra)
        with quiet_single_process():
            dcp.save(state, checkpoint_id=path, no_dist=not is_distributed())
        barrier()

    def save_checkpoint_async(self, path: str, model: nn.Module, optimizer: Optimizers | None,
                              extra: dict[str, Any]) -> Future:
        """`save_checkpoint` through DCP's `async_save`: the shards are copied to CPU memory,
        then written by a background thread whose collectives run on a gloo group of their
        own, so they never interleave with training's. Called on every rank."""
        import torch.distributed.checkpoint as dcp

        state = _sharded_state(self.unwrap(model), optimizer, self._flat)
        _start_directory(path, extra)
        if self._save_group is None and is_distributed():
            self._save_group = torch_dist.new_group(backend="gloo", timeout=get_timeout())
        with quiet_single_process():
            saving = dcp.async_save(state, checkpoint_id=path, process_group=self._save_group,
                                    no_dist=not is_distributed())
        return getattr(saving, "upload_completion", saving)

    def _load_whole(self, path: str, model: nn.Module,
                    optimizer: Optimizers | None) -> dict[str, Any]:
        """Restore model and optimiser from a checkpoint another strategy wrote, read whole
        on every rank: each rank keeps its shard of the weights and of the optimiser's state
        (its parameters matched by name). Returns the runner's state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = load_state_file(path)
        module = self.unwrap(model)
        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, _held(model, state.pop("model")), options=whole)
        saved = state.pop("optimizer", None)
        if optimizer is not None and saved is not None and model.pipeline is not None:
            raise OptimizerMismatch(
                f"a checkpoint of strategy {checkpoint_format(path).name!r} holds one optimiser "
                f"state for the whole model, which strategy.pp does not cut into its stages' "
                f"parts: start from its weights alone (load_from: {path}, in another "
                f"work_dir), or resume it without strategy.pp")
        if optimizer is not None and saved is not None:
            named = named_optimizer_state(saved, optimizer_order(optimizer, module))
            try:
                set_optimizer_state_dict(module, optimizer, named, options=whole)
            except (KeyError, ValueError) as error:
                raise OptimizerMismatch(f"its optimiser state does not fit this run's "
                                        f"optimiser ({error}): {OPTIMIZER_MISMATCH_HINT}") from None
        return state

    def _load_into_stage(self, path: str, model: nn.Module,
                         optimizer: Optimizers | None) -> dict[str, Any]:
        """Restore this pipeline stage from a checkpoint written without ``pp`` (its optimiser
        state by group, not by parameter), read whole on every rank: the stage keeps its
        parameters and their optimiser state, cut to its shards. Returns the runner's state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = FORMATS[self.FORMAT].read_state(Path(path))
        module = self.unwrap(model)
        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, _held(model, state["model"]), options=whole)
        saved = state.get("optimizer")
        if optimizer is not None and saved is not None:
            try:
                cut = model.pipeline.stage_optimizer_state(
                    saved, optimizer_order(optimizer, module))
                set_optimizer_state_dict(module, optimizer, cut, options=whole)
            except (KeyError, ValueError) as error:
                raise OptimizerMismatch(f"its optimiser state does not fit this run's "
                                        f"optimiser ({error}): {OPTIMIZER_MISMATCH_HINT}") from None
        return FORMATS[self.FORMAT].read_train_state(Path(path))

    def optimizer_groups(self, optimizer: Optimizers | None) -> Groups | None:
        """None under ``pp``: a stage's optimiser holds its part of the model's parameters,
        and its checkpoint records options per parameter, not groups, to check against."""
        return None if self._flat else super().optimizer_groups(optimizer)

    def teardown(self) -> None:
        super().teardown()
        if self._save_group is not None and is_distributed():
            torch_dist.destroy_process_group(self._save_group)
        self._save_group = None

    def load_checkpoint(self, path: str, model: nn.Module,
                        optimizer: Optimizers | None) -> dict[str, Any]:
        """Restore model and optimiser on every rank, resharding to this job's ranks; returns
        the runner's state. Reads checkpoints of any world size, and those of any other
        strategy (`_load_whole`)."""
        if checkpoint_format(path).name != self.FORMAT:
            return self._load_whole(path, model, optimizer) if self._sharded(model) else \
                super().load_checkpoint(path, model, optimizer)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        flat = flat_optimizer_state(check_metadata(path))
        if self._sharded(model) and model.pipeline is not None and not flat:
            return self._load_into_stage(path, model, optimizer)
        module = self.unwrap(model)
        state, made_whole = _checkpoint_state(module, optimizer, flat)
        try:
            with quiet_single_process():
                dcp.load(state, checkpoint_id=path, no_dist=not is_distributed())
        except dcp.CheckpointException as error:
            if "Missing key in checkpoint state_dict: optimizer." in str(error):
                raise OptimizerMismatch(f"its optimiser state does not fit this run's "
                                        f"optimiser ({OPTIMIZER_MISMATCH_HINT})") from None
            raise
        split_after_checkpoint(state, made_whole)
        set_state_dict(module, [optimizer] if optimizer is not None else [],
                       model_state_dict=state["model"],
                       optim_state_dict=state.get("optimizer", {}),
                       options=StateDictOptions(flatten_optimizer_state_dict=flat))
        return FORMATS[self.FORMAT].read_train_state(Path(path))

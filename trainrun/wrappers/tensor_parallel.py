"""Tensor parallelism for strategy 'fsdp' (``strategy.tp``): the plan that says how a model's
layers are split over the tensor-parallel ranks, and applying it.

A plan maps module-name patterns (``*`` matches one name: ``blocks.*.attn.proj``) to a style,
by name:

- ``colwise``: a Linear's output features are split; its output stays split (the next layer
  is ``rowwise``);
- ``rowwise``: a Linear's input features are split; its output is summed over the ranks;
- ``colwise_gather_output``: as ``colwise``, the output gathered whole (an output layer);
- ``colwise_fused:N``: a Linear whose output is N equal parts side by side (a fused q, k, v
  projection is ``colwise_fused:3``): each rank keeps its share of every part, in order;
- ``vocab_embedding`` (Hugging Face's ``embedding_rowwise``): an Embedding's rows (the
  vocabulary) are split; the looked-up vectors are summed over the ranks.

Two more take effect with sequence parallelism (``strategy.sequence_parallel``) and are left
out without it. Between the split layers, what is computed whole on every rank (norms,
dropout, the residual stream) is then cut along the sequence (dimension 1) instead: the
``rowwise`` layers hand on their sums cut that way (a reduce-scatter), and the ``colwise``
ones gather the sequence back first.

- ``sequence_parallel``: a module (a norm) that computes each rank's part of the sequence;
  its parameters stay whole on every rank;
- ``sequence_split``: a module whose input, whole on every rank, is cut along the sequence:
  where the sequence-parallel region begins (the model's first norm computes on a part).

The plan comes from the config (``strategy.tp_plan``), else the model (a ``tp_plan`` method or
attribute), else a Hugging Face model's own (its config's ``base_model_tp_plan``, and the
class's ``_tp_plan`` for its output layer). Parameters shared by several modules (tied
embeddings) stay shared where their splits agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_fused:N", "vocab_embedding",
          "sequence_parallel", "sequence_split")
SEQUENCE_STYLES = ("sequence_parallel", "sequence_split")  # only with sequence parallelism
ALIASES = {"embedding_rowwise": "vocab_embedding"}  # Hugging Face's names for the same
FUSED = re.compile(r"^colwise_fused:(\d+)$")
NO_PLAN = ("strategy.tp: {tp} splits the model over {tp} ranks, but it has no plan saying how: "
           "give strategy.tp_plan (module-name patterns to styles: {styles}), or a tp_plan on "
           "the model")


def style(name: str, key: str, sequence_parallel: bool = False) -> ParallelStyle:
    """The torch ParallelStyle a style name stands for (see the module's docstring).

    Args:
        name: the style's name.
        key: the config key it was given under, for the error.
        sequence_parallel: the activations between split layers are cut along the sequence.

    Raises:
        ValueError: a name that is none of ``STYLES``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # what lies between split layers
    name = ALIASES.get(name, name) if isinstance(name, str) else name
    fused = FUSED.match(name) if isinstance(name, str) else None
    if fused and int(fused.group(1)) >= 1:
        return _fused_colwise(int(fused.group(1)), between)
    made = {
        "colwise": lambda: ColwiseParallel(input_layouts=between),
        "rowwise": lambda: RowwiseParallel(output_layouts=between),
        "colwise_gather_output": lambda: ColwiseParallel(input_layouts=between,
                                                         output_layouts=Replicate()),
        "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
        "sequence_split": _sequence_split,
    }.get(name) if isinstance(name, str) else None
    if made is None:
        raise ValueError(f"{key}: {name!r} is not a tensor-parallel style; expected one of "
                         f"{', '.join(STYLES)}")
    return made()


def _sequence_split() -> ParallelStyle:
    """``sequence_split``: the module's first input, whole on every rank, is cut along the
    sequence (dimension 1), each rank keeping its part. A length that the ranks do not divide
    is refused before any collective (gloo would abort the process on the uneven parts)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    class SequenceSplit(PrepareModuleInput):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            ranks = device_mesh.size()

            def check(_: nn.Module, args: tuple[Any, ...]) -> None:
                length = args[0].shape[1]
                if length % ranks:
                    raise ValueError(f"strategy.sequence_parallel: a sequence of {length} "
                                     f"positions does not split evenly over tp {ranks} ranks; "
                                     f"make the sequence length a multiple of {ranks}")

            module.register_forward_pre_hook(check)  # before the cut's own hook
            return super()._apply(module, device_mesh)

    return SequenceSplit(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                         use_local_output=True)


def _fused_colwise(parts: int, input_layout: Any) -> ParallelStyle:
    """``colwise`` for a Linear whose output is ``parts`` equal parts side by side: its weight
    is split within each part (DTensor's strided shard), so each rank's output is its share
    of part 1, then of part 2, and so on. Its bias stays whole on every rank (each takes its
    share as it adds it): a one-dimensional strided shard, cut again by ``fully_shard``,
    would not come back whole in the right order. ``input_layout``: how its input lies on the
    ranks (whole, or cut along the sequence)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedColwise(ColwiseParallel):
        def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            for param_name, param in module.named_parameters():
                placement = _StridedShard(0, split_factor=parts) if param.ndim > 1 \
                    else Replicate()
                shard = distribute_tensor(param, mesh, [placement],
                                          src_data_rank=self.src_data_rank)
                module.register_parameter(param_name, nn.Parameter(
                    shard, requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                               outputs: Any, device_mesh: DeviceMesh) -> Any:
            return outputs.to_local() if use_local_output else outputs  # kept as it was split

    return FusedColwise(input_layouts=input_layout)


def _matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` is one ``pattern`` names (``*`` stands for one name)."""
    return fnmatchcase(name, pattern) and name.count(".") == pattern.count(".")


def check_plan(plan: Any, key: str = "strategy.tp_plan") -> None:
    """Refuse a plan that is not a mapping of module-name patterns to style names.

    Args:
        plan: the plan, as the config or a model gives it.
        key: where it was given, for the error.

    Raises:
        ValueError: naming ``key``, the pattern and what was expected.
    """
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"{key} must map module-name patterns to styles ({', '.join(STYLES)}); "
                         f"got {plan!r}")
    for pattern, name in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{key}: {pattern!r} is not a module-name pattern")
        if not isinstance(name, str):
            raise ValueError(f"{key}.{pattern}: expected a style name ({', '.join(STYLES)}); "
                             f"got {name!r}")
        style(name, f"{key}.{pattern}")


def hf_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan of the outermost Hugging Face model inside ``model`` (its ``_tp_plan``, which
    ``transformers`` fills from its config's ``base_model_tp_plan`` and its class's own), with
    the module names from ``model``; None where there is none.

    Args:
        model: the model, which may hold the Hugging Face model anywhere inside it.
    """
    for prefix, module in model.named_modules():
        plan = getattr(module, "_tp_plan", None)
        if plan and hasattr(getattr(module, "config", None), "base_model_tp_plan"):
            at = f"{prefix}." if prefix else ""
            return {f"{at}{pattern}": name for pattern, name in plan.items()}
    return None


def model_plan(model: nn.Module, configured: Mapping[str, str] | None, tp: int,
               sequence_parallel: bool = False) -> dict[str, str]:
    """The plan for ``model``: ``configured`` (the config's), else the model's own ``tp_plan``
    (a method or an attribute), else a Hugging Face model's.

    Args:
        model: the model to split.
        configured: ``strategy.tp_plan``; None: the model's own.
        tp: the tensor-parallel ranks, for the error.
        sequence_parallel: the plan must name its ``sequence_parallel`` modules.

    Returns:
        The plan, module-name patterns to style names.

    Raises:
        ValueError: there is none, a pattern names no module of the model, or (with
            ``sequence_parallel``) it names no ``sequence_parallel`` module.
    """
    own = getattr(model, "tp_plan", None)
    plan = configured or (own() if callable(own) else own) or hf_plan(model)
    if not plan:
        raise ValueError(NO_PLAN.format(tp=tp, styles=", ".join(STYLES)))
    key = "strategy.tp_plan" if configured else f"{type(model).__name__}.tp_plan"
    check_plan(plan, key)
    names = [name for name, _ in model.named_modules()]
    for pattern in plan:
        if not any(_matches(name, pattern) for name in names):
            raise ValueError(f"{key}: {pattern!r} matches no module of the model "
                             f"({type(model).__name__})")
    if sequence_parallel:
        check_sequence_plan(plan, key)
    return dict(plan)


def held_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """The entries of ``plan`` (checked on the whole model) that name a module ``model`` holds:
    a pipeline stage holds some of the whole model's modules.

    Args:
        model: the model, or one pipeline stage of it.
        plan: module-name patterns to style names.
    """
    names = [name for name, _ in model.named_modules()]
    return {pattern: name for pattern, name in plan.items()
            if any(_matches(each, pattern) for each in names)}


def check_sequence_plan(plan: Mapping[str, str], key: str) -> None:
    """Refuse sequence parallelism under a plan that says where no part of the sequence is
    computed (no ``sequence_parallel`` module).

    Args:
        plan: the plan.
        key: where it was given, for the error.

    Raises:
        ValueError: naming what is missing.
    """
    if "sequence_parallel" not in plan.values():
        raise ValueError(f"strategy.sequence_parallel: {key} names no module as "
                         f"'sequence_parallel' (the norms between the split layers, which then "
                         f"compute each rank's part of the sequence), and 'sequence_split' where "
                         f"the sequence is first cut")


def apply_plan(model: nn.Module, plan: Mapping[str, str], mesh: DeviceMesh,
               sequence_parallel: bool = False) -> None:
    """Split ``model``'s planned modules over ``mesh`` (the tensor-parallel ranks), in place;
    parameters that several modules share are shared again after.

    Args:
        model: the model, not yet sharded by ``fully_shard``.
        plan: module-name patterns to style names (`model_plan`'s).
        mesh: the one-dimensional mesh of a rank's tensor-parallel peers.
        sequence_parallel: cut what lies between the split layers along the sequence (the
            plan's sequence styles apply); False: those entries are left out.

    Raises:
        ValueError: a shared parameter that the plan splits differently in its modules.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    parallelize_module(model, mesh, {
        pattern: style(name, f"tp_plan.{pattern}", sequence_parallel)
        for pattern, name in plan.items()
        if sequence_parallel or name not in SEQUENCE_STYLES})
    for first, *others in (names for names in shared.values() if len(names) > 1):
        param = model.get_parameter(first)
        for other in others:
            placements = getattr(model.get_parameter(other), "placements", None)
            if placements != getattr(param, "placements", None):
                raise ValueError(f"strategy.tp_plan: {first} and {other} are one parameter "
                                 f"(tied), but the plan splits them differently "
                                 f"({getattr(param, 'placements', 'whole')} against "
                                 f"{placements or 'whole'})")
            owner, _, attribute = other.rpartition(".")
            setattr(model.get_submodule(owner), attribute, param)


def split_within_parts(value: Any) -> bool:
    """Whether ``value`` is a DTensor whose tensor-parallel shard is cut within parts
    (``colwise_fused``): each rank's rows lie in several places of the whole, which no
    checkpoint chunk describes.

    Args:
        value: any tensor (or other value) of a state dict.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(value, DTensor) or "tp" not in (value.device_mesh.mesh_dim_names or ()):
        return False
    return isinstance(value.placements[value.device_mesh.mesh_dim_names.index("tp")],
                      _StridedShard)


def whole_for_checkpoint(state: dict[str, Any]
                         ) -> tuple[dict[str, Any], dict[tuple[str, ...], Any]]:
    """``state`` (nested model and optimiser state dicts) with each tensor split within parts
    replaced by its whole tensor (gathered: a collective), so that
    ``torch.distributed.checkpoint`` can write or read it. The dicts on the way are copies:
    the optimiser's own state is left as it is. Returns that state, and where each replaced
    tensor was with its DTensor, for `split_after_checkpoint`.

    Args:
        state: ``{'model': ..., 'optimizer': ...}`` as ``get_state_dict`` gives them.
    """
    replaced: dict[tuple[str, ...], Any] = {}

    def visit(node: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        copy = {}
        for key, value in node.items():
            if isinstance(value, dict):
                value = visit(value, (*path, key))
            elif split_within_parts(value):
                replaced[(*path, key)] = value
                value = value.full_tensor()
            copy[key] = value
        return copy

    return visit(state, ()), replaced


def split_after_checkpoint(state: dict[str, Any], replaced: dict[tuple[str, ...], Any]) -> None:
    """Put back, in ``state`` (as `whole_for_checkpoint` returned it, now read from a
    checkpoint), the whole tensors as DTensors split as before (each rank keeps its own
    shard: no communication).

    Args:
        state: the state `whole_for_checkpoint` returned, filled from a checkpoint.
        replaced: the places and DTensors it returned beside it.
    """
    from torch.distributed.tensor import distribute_tensor

    for path, before in replaced.items():
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = distribute_tensor(node[path[-1]], before.device_mesh,
                                           before.placements, src_data_rank=None)


# the dimension each style splits, by parameter (weight, bias); None: whole on every rank
SPLIT_DIMS = {"colwise": (0, 0), "colwise_gather_output": (0, 0), "rowwise": (1, None),
              "vocab_embedding": (0, None), "sequence_parallel": (None, None),
              "sequence_split": (None, None)}


def split_shapes(model: nn.Module, plan: Mapping[str, str], tp: int
                 ) -> dict[str, tuple[int, ...]]:
    """The shape of each rank's part of every parameter ``plan`` splits over ``tp`` ranks,
    by parameter name (for the memory plan; the last rank's part may be smaller).

    Args:
        model: the model (its shapes are all that is read: the meta device will do).
        plan: module-name patterns to style names.
        tp: the tensor-parallel ranks.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        for pattern, style_name in plan.items():
            if not _matches(name, pattern):
                continue
            dims = SPLIT_DIMS.get(style_name, (0, None))  # colwise_fused:N as colwise
            for which, dim in zip(("weight", "bias"), dims, strict=True):
                param = getattr(module, which, None)
                if dim is None or param is None:
                    continue
                shape = list(param.shape)
                shape[dim] = -(-shape[dim] // tp)
                shapes[f"{name}.{which}" if name else which] = tuple(shape)
    return shapes

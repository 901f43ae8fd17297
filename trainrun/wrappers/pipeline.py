"""Pipeline parallelism for strategy 'fsdp' (``strategy.pp``): the model cut into stages, one
a rank (or several, under ``interleaved_1f1b``), run through ``torch.distributed.pipelining``'s
schedules.

A model that can be cut says how its forward runs in three steps, and says which of its
children are its repeated blocks:

- ``pp_blocks``: the name of the child that holds the repeated blocks (an ``nn.Sequential``,
  ``nn.ModuleList`` or ``nn.ModuleDict``); ``strategy.pp`` cuts between blocks, evenly where
  ``strategy.pp_split`` does not name the cuts;
- ``pp_inputs(batch)``: the tensor the first stage takes from a batch;
- ``pp_forward(x)``: the forward from that tensor to the outputs, skipping the children a
  stage does not hold (they are None there) and, in the blocks, running those it holds;
- ``pp_outputs(y, batch, mode)``: on the last stage, ``forward``'s result (the losses in mode
  ``'loss'``, the predictions in mode ``'predict'``) from the outputs ``y``.

The unsplit model's ``forward`` is ``pp_outputs(pp_forward(pp_inputs(batch)), batch, mode)``,
so the pipeline computes what it computes.

The model's parts in order are its children as registered, with the blocks one by one
(``blocks.0``, ``blocks.1``, ...). A stage keeps a contiguous run of them; the others become
None, and the blocks child keeps the stage's blocks under their own names, so state dicts
keep the plain model's keys and checkpoints reshard to any other mesh. Parameters shared by
two stages (tied embeddings) are kept on both, and their gradients are summed between them
before the optimiser steps, so both copies stay equal. A rank holding several stages holds
each as a module of its own (each a ``fully_shard`` root), and their parts together under the
model's names (`held_parts`) for the optimiser and checkpoints.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

from trainrun.wrappers.base_model import parse_losses

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# what one stage hands the next in validation: its output's dtype (by index) and shape first
SENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
HEADER = 10
PROTOCOL = ("pp_blocks", "pp_inputs", "pp_forward", "pp_outputs")
NO_PROTOCOL = ("strategy.pp: {pp} cuts the model into {pp} stages, but {name} does not say how "
               "its forward runs in parts: it needs {missing} (see docs/parallelism.md, "
               "pipeline parallelism)")


def check_pp(pp: Any, microbatches: Any, schedule: Any, split: Any,
             world: int | None = None, tp: int = 1, virtual: Any = 1) -> None:
    """Refuse pipeline options of the wrong kind, or a ``pp`` x ``tp`` that does not divide
    ``world`` (where known).

    Args:
        pp: ``strategy.pp``, the pipeline stages.
        microbatches: ``strategy.pp_microbatches``, the parts each batch is cut into.
        schedule: ``strategy.pp_schedule``, one of ``SCHEDULES``.
        split: ``strategy.pp_split``, None or the names of the parts where stages 2, 3, ...
            begin.
        world: the world size, where known.
        tp: ``strategy.tp``, the tensor-parallel ranks.
        virtual: ``strategy.pp_virtual_stages``, the stages each rank holds (``pp`` x it in
            all); above 1 only under ``interleaved_1f1b``, which needs 2 or more.
    """
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"strategy.pp must be a positive int (the pipeline stages); got {pp!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"strategy.pp_microbatches must be a positive int (the parts each "
                         f"batch is cut into); got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"strategy.pp_schedule must be one of {', '.join(SCHEDULES)}; got "
                         f"{schedule!r}")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"strategy.pp_virtual_stages must be a positive int (the stages each "
                         f"rank holds); got {virtual!r}")
    if (schedule == "interleaved_1f1b") != (virtual > 1):
        raise ValueError(f"strategy.pp_virtual_stages: several stages a rank (2 or more) go "
                         f"with pp_schedule interleaved_1f1b, one with gpipe or 1f1b; got "
                         f"{virtual} under {schedule}")
    stages = pp * virtual
    if split is not None:
        if not isinstance(split, Sequence) or isinstance(split, str) or \
                not all(isinstance(name, str) for name in split):
            raise ValueError(f"strategy.pp_split must be null or a list of module names (where "
                             f"stages 2, 3, ... begin); got {split!r}")
        if len(split) != stages - 1:
            raise ValueError(f"strategy.pp_split names where stages 2 to {stages} begin: "
                             f"{stages - 1} name(s) for {stages} stages; got {len(split)}")
    if pp > 1 and microbatches < pp:
        raise ValueError(f"strategy.pp_microbatches must be at least pp ({pp}), so that every "
                         f"stage has work while the pipeline is full; got {microbatches}")
    if world is not None:
        check_model_parallel(world, tp, pp)


def check_model_parallel(world: int, tp: int, pp: int) -> None:
    """Refuse a world size that ``pp`` x ``tp`` (the ranks holding one copy of the model)
    does not divide."""
    if world % (pp * tp):
        raise ValueError(f"strategy.pp {pp} x strategy.tp {tp} must divide the world size; got "
                         f"{world} process(es)")


def check_protocol(model: nn.Module, pp: int) -> None:
    """Refuse a model that does not say how it runs in parts (see the module's docstring)."""
    missing = [name for name in PROTOCOL if getattr(model, name, None) is None]
    if missing:
        raise ValueError(NO_PROTOCOL.format(pp=pp, name=type(model).__name__,
                                            missing=", ".join(missing)))
    if not isinstance(getattr(model, model.pp_blocks, None), (nn.Sequential, nn.ModuleList,
                                                             nn.ModuleDict)):
        raise ValueError(f"{type(model).__name__}.pp_blocks names {model.pp_blocks!r}, which is "
                         f"not a child holding blocks (nn.Sequential, ModuleList or ModuleDict)")


def parts(model: nn.Module) -> list[str]:
    """The model's parts in the order its forward runs them: its children, with the blocks
    (``pp_blocks``) one by one."""
    out = []
    for name, child in model.named_children():
        if name == model.pp_blocks:
            out += [f"{name}.{key}" for key, _ in child.named_children()]
        else:
            out.append(name)
    return out


def stage_starts(model: nn.Module, pp: int, split: Sequence[str] | None) -> list[int]:
    """Where each stage begins in `parts`: at the parts ``split`` names, else at blocks
    spread evenly (the parts before the blocks go with the first stage, those after with the
    last).

    Raises:
        ValueError: ``split`` names a part the model does not have, or not in order; or the
            model has fewer blocks than ``pp``.
    """
    names = parts(model)
    if split is not None:
        unknown = [name for name in split if name not in names]
        if unknown:
            raise ValueError(f"strategy.pp_split: the model has no part {unknown[0]!r}; its "
                             f"parts in order: {', '.join(names)}")
        starts = [0, *(names.index(name) for name in split)]
        if starts != sorted(set(starts)) or starts[1] == 0:
            raise ValueError(f"strategy.pp_split must name parts after the first, in the "
                             f"model's order ({', '.join(names)}); got {list(split)}")
        return starts
    blocks = [i for i, name in enumerate(names) if name.startswith(f"{model.pp_blocks}.")]
    if len(blocks) < pp:
        raise ValueError(f"strategy.pp: {pp} stages need at least {pp} blocks; "
                         f"{type(model).__name__}.{model.pp_blocks} has {len(blocks)}")
    return [0, *(blocks[stage * len(blocks) // pp] for stage in range(1, pp))]


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor under several names (tied embeddings)."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def cut(model: nn.Module, pp: int, stage: int, split: Sequence[str] | None) -> None:
    """Keep only ``stage``'s parts of ``model``, in place: the other children become None, and
    the blocks child keeps the stage's blocks under their own names."""
    names = parts(model)
    starts = [*stage_starts(model, pp, split), len(names)]
    kept = set(names[starts[stage]:starts[stage + 1]])
    blocks = getattr(model, model.pp_blocks)
    for name, _ in list(model.named_children()):
        if name != model.pp_blocks and name not in kept:
            setattr(model, name, None)
    held = [(key, block) for key, block in blocks.named_children()
            if f"{model.pp_blocks}.{key}" in kept]
    setattr(model, model.pp_blocks, nn.ModuleDict(held) if isinstance(blocks, nn.ModuleDict)
            else nn.Sequential(OrderedDict(held)))


def _pp_lines(mesh: DeviceMesh) -> list[list[int]]:
    """The ranks of each pipeline (one a data-parallel and tensor-parallel position), in stage
    order."""
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1)
    return ranks.reshape(-1, ranks.shape[-1]).tolist()


def _whole(value: Tensor) -> Tensor:
    """``value`` as a plain tensor (a DTensor's whole value)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _take(batch: Any, index: Tensor) -> Any:
    """The samples ``index`` of a batch (a tensor, or a dict, list or tuple of them)."""
    if isinstance(batch, Tensor):
        return batch[index.to(batch.device)]
    if isinstance(batch, Mapping):
        return {key: _take(value, index) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(value, index) for value in batch)
    return batch


def rank_stages(mesh: DeviceMesh, virtual: int) -> list[int]:
    """The stages this rank holds, in order: with ``pp`` ranks in the pipeline, stage ``i`` is
    on its rank ``i % pp`` (``virtual`` of them each)."""
    pp = mesh["pp"].size()
    return [mesh["pp"].get_local_rank() + k * pp for k in range(virtual)]


def held_parts(whole: nn.Module, chunks: Sequence[nn.Module]) -> nn.Module:
    """One module holding the parts of several stages of ``whole`` (``chunks``, each `cut`),
    under the whole model's names: what a rank of an interleaved pipeline saves, loads and
    optimises. Its parts are the chunks' own (shared, not copied)."""
    held = nn.Module()
    blocks = OrderedDict((key, block) for chunk in chunks
                         for key, block in getattr(chunk, whole.pp_blocks).named_children())
    for name, _ in whole.named_children():
        if name == whole.pp_blocks:
            held.add_module(name, nn.Sequential(OrderedDict(
                sorted(blocks.items(), key=lambda item: parts(whole).index(
                    f"{name}.{item[0]}")))))
            continue
        owner = [getattr(chunk, name) for chunk in chunks if getattr(chunk, name) is not None]
        held.add_module(name, owner[0] if owner else None)
    return held


class Pipeline:
    """One rank's stages of a model cut by ``strategy.pp``, and the schedule that runs them.

    Args:
        module: what the rank holds of the model, under the model's names: its one stage
            (`cut`), or the stages' parts together (`held_parts`) under an interleaved
            schedule; what is optimised, saved and loaded.
        chunks: the rank's stages (`cut`), in order, each sharded by ``fully_shard``
            (``[module]`` with one stage); each one's ``forward`` becomes ``pp_forward``,
            which its stage calls.
        mesh: the job's device mesh, with a ``pp`` dimension.
        microbatches: the parts each batch is cut into.
        schedule: one of ``SCHEDULES``.
        shared: `shared_parameters` of the whole model, before the cut.
        device: this rank's device.
    """

    def __init__(self, module: nn.Module, chunks: Sequence[nn.Module], mesh: DeviceMesh,
                 microbatches: int, schedule: str, shared: list[list[str]],
                 device: torch.device):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self.module, self.chunks = module, list(chunks)
        self.group = mesh["pp"].get_group()
        self.stage = mesh["pp"].get_local_rank()  # this rank's place in its pipeline
        self.ranks = torch_dist.get_process_group_ranks(self.group)
        self.held = rank_stages(mesh, len(self.chunks))  # the stages it holds
        self.stages = len(self.ranks) * len(self.chunks)  # the pipeline's stages in all
        self.is_first, self.is_last = self.held[0] == 0, self.held[-1] == self.stages - 1
        self.device = device
        self.methods = self.chunks[0]  # the model's pp_inputs and pp_outputs
        for chunk in self.chunks:
            chunk.forward = chunk.pp_forward  # what the stage calls on its input
        self._tied, self._tie_group = self._ties(mesh, shared)
        # this stage's name of each parameter -> the whole model's (a tied one's first name)
        self.whole_names = {name: names[0] for names in shared for name in names}
        self._batch: Any = None
        self._log_vars: list[dict[str, Tensor]] = []
        self._scale = 1.0
        self.microbatches = microbatches
        stages = [PipelineStage(chunk, index, self.stages, device, group=self.group)
                  for chunk, index in zip(self.chunks, self.held, strict=True)]
        made = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                "interleaved_1f1b": ScheduleInterleaved1F1B}[schedule]
        self.schedule = made(stages if schedule == "interleaved_1f1b" else stages[0],
                             n_microbatches=microbatches, loss_fn=self._loss,
                             scale_grads=False)  # (the loss is divided instead: `_loss`)

    def _ties(self, mesh: DeviceMesh, shared: list[list[str]]
              ) -> tuple[list[nn.Parameter], torch_dist.ProcessGroup | None]:
        """The parameters this rank shares with another stage, and the group of
        the first and last stage of its pipeline that sums their gradients. Every rank makes
        every pipeline's group, in the same order, as ``new_group`` asks."""
        held = dict(self.module.named_parameters(remove_duplicate=False))
        tied = []
        for names in shared:
            here = [name for name in names if name in held]
            if here and len(here) < len(names):  # some of its names are on another stage
                tied.append(held[here[0]])
        if not any(shared) or self.stages == 1:
            return tied, None
        group = None
        for line in _pp_lines(mesh):
            made = torch_dist.new_group([line[0], line[-1]])
            if torch_dist.get_rank() in (line[0], line[-1]):
                group = made
        return tied, group

    def _loss(self, outputs: Tensor, index: Tensor) -> Tensor:
        """The loss of one microbatch on the last stage (its samples ``index`` of the batch),
        its values kept for logging; divided by the microbatches and the accumulated
        micro-steps, so that the gradients add up to those of the batches' mean loss. (The
        schedule's own division would divide the gradients accumulated before as well.)"""
        losses = self.methods.pp_outputs(outputs, _take(self._batch, index), "loss")
        loss, log_vars = parse_losses(losses)
        self._log_vars.append({key: value.detach() for key, value in log_vars.items()})
        return loss * self._scale

    def _run(self, batch: Any) -> None:
        """One pass of the schedule over ``batch``, forward and backward, microbatched."""
        self._batch, self._log_vars = batch, []
        # the first stage feeds the inputs; the last counts them, to index the batch's targets
        inputs = self.methods.pp_inputs(batch) if self.is_first or self.is_last else None
        index = torch.arange(len(inputs), device=self.device) if self.is_last else None
        self.schedule.step(*((inputs,) if self.is_first else ()), target=index,
                           losses=[] if self.is_last else None)
        self._batch = None

    def stage_optimizer_state(self, saved: Mapping[str, Any],
                              order: list[list[str]]) -> dict[str, Any]:
        """A whole model's optimiser state by name (``{'state', 'param_groups'}``, as a run
        without ``pp`` saves it), cut to this stage's optimiser: each parameter's state, and
        each group's options from the saved group that held its first parameter.

        Args:
            saved: the whole model's state, parameters by name.
            order: this stage's optimiser's parameter names, group by group.
        """
        whole = {name: self.whole_names.get(name, name) for group in order for name in group}
        options = {name: {key: value for key, value in group.items() if key != "params"}
                   for group in saved["param_groups"] for name in group["params"]}
        return {"state": {name: saved["state"][whole[name]] for name in whole
                          if whole[name] in saved["state"]},
                "param_groups": [{**options[whole[names[0]]], "params": names}
                                 for names in order if names]}

    def from_every_stage(self, part: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``part`` (by name, this rank's part of the model) of every rank of
        the pipeline, merged: a collective over it."""
        parts: list[Any] = [None] * len(self.ranks)
        torch_dist.all_gather_object(parts, part, group=self.group)
        return {key: value for each in parts for key, value in each.items()}

    def _from_last(self, value: Any) -> Any:
        """``value`` of the last stage, on every stage of the pipeline."""
        box = [value if self.is_last else None]
        torch_dist.broadcast_object_list(box, src=self.ranks[-1], group=self.group,
                                         device=self.device if self.device.type == "cuda"
                                         else None)
        return box[0]

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, Tensor]:
        """Forward and backward ``data`` through the stages (microbatched), sum the shared
        parameters' gradients between stages, then step as the optimiser wrapper steps.
        Returns the values to log (their mean over the microbatches), on every stage."""
        self._scale = 1.0 / (optim_wrapper.group_size() * self.microbatches)
        optim_wrapper.grad_norm = None
        optim_wrapper.combine_norms = self.combine_norms
        with optim_wrapper.optim_context(self.module):
            self._run(data)
        if optim_wrapper.will_step:
            self.sum_tied_grads()
        optim_wrapper.gradients_in()
        means = None
        if self.is_last:  # (the first step's shape inference calls the loss once before)
            kept = self._log_vars[-self.microbatches:]
            means = {key: torch.stack([each[key] for each in kept]).mean().cpu()
                     for key in kept[0]}
        return {key: value.to(self.device) for key, value in self._from_last(means).items()}

    def sum_tied_grads(self) -> None:
        """Sum the gradients of parameters two stages share (tied embeddings), so that the
        optimiser makes the same step on both copies."""
        if self._tie_group is None:
            return
        for param in self._tied:
            grad = param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            torch_dist.all_reduce(local, group=self._tie_group)

    def combine_norms(self, norm: Tensor, norm_type: float) -> Tensor:
        """The whole model's gradient norm from this stage's ``norm``: the stages' norms
        combined over the pipeline, each shared parameter counted once (on the first stage)."""
        norm = _whole(norm)
        if norm_type == math.inf:
            torch_dist.all_reduce(norm, op=torch_dist.ReduceOp.MAX, group=self.group)
            return norm
        powered = norm ** norm_type
        if self._tied and not self.is_first:
            tied = nn.utils.get_total_norm([param.grad for param in self._tied], norm_type)
            powered = powered - _whole(tied) ** norm_type
        torch_dist.all_reduce(powered, group=self.group)
        return powered ** (1.0 / norm_type)

    def predict(self, data: Any, mode: str) -> Any:
        """``forward(data, mode)`` through the stages in turn, whole batch at once (forward
        only), on every rank: validation and test batches may be of any size, which the
        microbatched schedule (its shapes fixed at the first step) does not take."""
        y = None
        for index, chunk in zip(self.held, self.chunks, strict=True):
            x = self.methods.pp_inputs(data) if index == 0 else self._receive()
            with torch.no_grad():
                y = chunk(x)  # (its forward is pp_forward, through the sharding hooks)
            if index < self.stages - 1:
                self._send(y)
        for chunk in self.chunks:  # (a forward alone leaves a root's parameters gathered)
            chunk.reshard()
        if not self.is_last:
            return self._from_last(None)
        return self._from_last(self.methods.pp_outputs(y, data, mode))

    def _send(self, y: Tensor) -> None:
        """``y`` to the next stage's rank: its dtype and shape (`HEADER` numbers), then its
        values."""
        to = self.ranks[(self.stage + 1) % len(self.ranks)]
        header = [SENT_DTYPES.index(y.dtype), y.ndim, *y.shape]
        torch_dist.send(torch.tensor(header + [0] * (HEADER - len(header)), device=y.device),
                        to, group=self.group)
        torch_dist.send(y.contiguous(), to, group=self.group)

    def _receive(self) -> Tensor:
        """The previous stage's output (see `_send`)."""
        frm = self.ranks[(self.stage - 1) % len(self.ranks)]
        header = torch.zeros(HEADER, dtype=torch.long, device=self.device)
        torch_dist.recv(header, frm, group=self.group)
        dtype, ndim, *shape = header.tolist()
        y = torch.empty(shape[:ndim], dtype=SENT_DTYPES[dtype], device=self.device)
        torch_dist.recv(y, frm, group=self.group)
        return y

"""Tensor collectives that work on any backend, with any tensor, in any process.

Compared with calling torch.distributed directly these: accept reduce ops by name (and
'mean', integer tensors included), move tensors to the device the backend communicates on
and back, accept non-contiguous tensors, gather tensors of different shapes, and simply
return in a process that never joined a group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ProcessGroup, ReduceOp

from trainrun.dist.device import get_comm_device
from trainrun.dist.info import get_default_group, get_rank, get_world_size
from trainrun.dist.timeouts import named_operation

#: The reduce ops every collective here takes by name, in any case ('mean' is a sum
#: divided by the world size).
REDUCE_OPS = ("sum", "mean", "product", "min", "max", "band", "bor", "bxor")
_TORCH_OPS = {
    "sum": ReduceOp.SUM,
    "mean": ReduceOp.SUM,  # summed, then divided by the world size
    "product": ReduceOp.PRODUCT,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
    "band": ReduceOp.BAND,
    "bor": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR,
}
_MAX_DIMS = 16  # of a tensor whose shape `all_gather` exchanges


def reduce_op_name(op: str) -> str:
    """The lower-case name of ``op``, or ValueError naming the allowed ones."""
    name = op.lower() if isinstance(op, str) else op
    if name not in _TORCH_OPS:
        raise ValueError(f"reduce op must be one of {', '.join(REDUCE_OPS)}; got {op!r}")
    return name


class WrongArgument(TypeError, AssertionError):
    """A collective got an argument of the wrong kind (``all_reduce_dict`` no dict,
    ``broadcast_object_list`` no list): a TypeError, and the AssertionError MMEngine raises
    there, which code and tests written for MMEngine catch."""


class Handle:
    """What a collective called with ``async_op=True`` returns, to finish its work later.

    ``wait()`` finishes all of the collective's work: the communication and what comes after
    it (the division of a 'mean', the copy back into a tensor that was moved for the backend).
    ``result()`` waits and returns what the collective made where it makes something new
    (``gather_rows``: the rows on ``dst``, None elsewhere), None where it works in place. In a
    process that is not distributed the collectives return a handle that never waits.

    Args:
        work: the backend's pending work (torch's ``Work``); None when nothing is pending.
        finish: what to run once ``work`` is done; what it returns is ``result()``. None: nothing.
        name: the collective's name, for the message of a timeout.
        group: the process group the collective runs on, for the message of a timeout.
    """

    def __init__(self, work: Any = None, finish: Callable[[], Any] | None = None,
                 name: str = "collective", group: ProcessGroup | None = None) -> None:
        self._work = work
        self._finish = finish
        self._name, self._group = name, group  # for a timeout's message
        self._result: Any = None

    def wait(self) -> bool:
        """Wait until the collective is done on this rank, then finish its work.

        Calling it again returns at once.

        Returns:
            True, as torch's ``Work.wait`` does.

        Raises:
            DistTimeoutError: when the backend reports that the collective ran out of time.
        """
        if self._work is not None:
            with named_operation(self._name, self._group):
                self._work.wait()
            self._work = None
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        return True

    def result(self) -> Any:
        """Wait for the collective (as ``wait`` does), then return what it made.

        Returns:
            What the collective made, for those that make something new (for ``gather_rows``
            the (world_size, length) tensor on ``dst``, None on the other ranks); None for the
            collectives that work in place.

        Raises:
            DistTimeoutError: when the backend reports that the collective ran out of time.
        """
        self.wait()
        return self._result

    def is_completed(self) -> bool:
        """Whether ``wait`` would return without waiting for other ranks: their part is done.

        Returns:
            True once the backend's work is complete, or when there was none to wait for.
        """
        return self._work is None or self._work.is_completed()


def _group(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else get_default_group()


def _for_comm(data: Tensor, group: ProcessGroup) -> Tensor:
    """``data`` itself when the backend can use it as it is, else a contiguous copy on its
    device."""
    device = get_comm_device(group)
    if data.device == device and data.is_contiguous():
        return data
    return data.to(device).contiguous()


def _run(name: str, group: ProcessGroup, async_op: bool, start: Callable[[bool], Any],
         finish: Callable[[], None] | None) -> Handle | None:
    """Start a collective; finish it now, or hand back a ``Handle`` that finishes it."""
    with named_operation(name, group):
        work = start(async_op)
        if async_op:
            return Handle(work, finish, name, group)
        if finish is not None:
            finish()
    return None


def all_reduce(data: Tensor, op: str = "sum", group: ProcessGroup | None = None,
               async_op: bool = False) -> Handle | None:
    """Reduce ``data`` across the ranks of ``group``, in place.

    Works for any tensor on any backend: a CPU tensor on nccl or a CUDA tensor on gloo is
    moved to the device the backend communicates on, and the result copied back. 'mean' is a
    sum divided by the world size (true division, then stored in ``data``'s dtype), so it works
    for integer tensors too: they hold the truncated mean. When not distributed, ``data`` stays
    as it is.

    Args:
        data: the tensor to reduce; on every rank it holds the result afterwards.
        op: 'sum', 'mean', 'product', 'min', 'max', 'band', 'bor' or 'bxor', in any case.
        group: the process group to reduce over; None for the default group.
        async_op: return a ``Handle`` at once instead of waiting for the result.

    Returns:
        With ``async_op``, a ``Handle`` whose ``wait()`` finishes the work, the division of
        'mean' and the copy back included; else None.

    Raises:
        ValueError: when ``op`` is none of the above; the message names the allowed ones.
    """
    op = reduce_op_name(op)
    if get_world_size(group) == 1:
        return Handle() if async_op else None
    group = _group(group)
    buffer = _for_comm(data, group)
    world_size = get_world_size(group)

    def finish() -> None:
        result = torch.true_divide(buffer, world_size) if op == "mean" else buffer
        if result is not data:
            data.copy_(result)

    return _run(f"all_reduce({op})", group, async_op,
                lambda a: torch_dist.all_reduce(buffer, _TORCH_OPS[op], group, async_op=a), finish)


def _shape_of_each_rank(data: Tensor, group: ProcessGroup) -> list[torch.Size]:
    if data.dim() > _MAX_DIMS:
        raise ValueError(f"all_gather takes tensors of up to {_MAX_DIMS} dimensions")
    mine = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64)
    mine[0] = data.dim()
    mine[1 : data.dim() + 1] = torch.tensor(data.shape, dtype=torch.int64)
    mine = mine.to(get_comm_device(group))
    shapes = [torch.empty_like(mine) for _ in range(get_world_size(group))]
    torch_dist.all_gather(shapes, mine, group)
    return [torch.Size(s[1 : int(s[0]) + 1].tolist()) for s in (s.cpu() for s in shapes)]


def _gather_uneven(data: Tensor, group: ProcessGroup, shapes: list[torch.Size],
                   dst: int | None) -> list[Tensor]:
    """All-gather (dst None) or gather to ``dst`` tensors whose shapes differ by rank."""
    longest = max(s.numel() for s in shapes)
    padded = torch.zeros(longest, dtype=data.dtype, device=get_comm_device(group))
    padded[: data.numel()] = data.reshape(-1).to(padded.device)
    if dst is None:
        out = [torch.empty_like(padded) for _ in shapes]
        torch_dist.all_gather(out, padded, group)
    else:
        rows = gather_rows(padded, dst, group)
        if rows is None:
            return []
        out = list(rows)
    return [t[: s.numel()].reshape(s).to(data.device) for t, s in zip(out, shapes, strict=True)]


def _global_rank(group: ProcessGroup, rank: int) -> int:
    """torch's gather/broadcast/reduce take ``dst``/``src`` as global ranks."""
    if group is None or group is get_default_group():
        return rank
    return torch_dist.get_global_rank(group, rank)


def _all_gather(data: Tensor, group: ProcessGroup | None = None) -> list[Tensor]:
    if get_world_size(group) == 1:
        return [data]
    group = _group(group)
    with named_operation("all_gather", group):
        shapes = _shape_of_each_rank(data, group)
        if all(s == data.shape for s in shapes):
            buffer = _for_comm(data, group)
            out = [torch.empty_like(buffer) for _ in shapes]
            torch_dist.all_gather(out, buffer, group)
            return [t.to(data.device) for t in out]
        return _gather_uneven(data, group, shapes, dst=None)


def _all_gather_into(tensor_list: list[Tensor], tensor: Tensor,
                     group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """torch's call shape: fills ``tensor_list`` with every rank's ``tensor``."""
    if get_world_size(group) == 1:
        tensor_list[0].copy_(tensor)
        return Handle() if async_op else None
    group = _group(group)
    same = all(t.shape == tensor.shape and t.device == tensor.device for t in tensor_list)
    if not (same and tensor.device == get_comm_device(group) and tensor.is_contiguous()):
        for target, gathered in zip(tensor_list, _all_gather(tensor, group), strict=False):
            target.copy_(gathered)
        return Handle() if async_op else None
    return _run("all_gather", group, async_op,
                lambda a: torch_dist.all_gather(tensor_list, tensor, group, async_op=a), None)


def all_gather(data: Tensor | list[Tensor], *args: Any, **kwargs: Any) -> Any:
    """Gather ``data`` from every rank: ``all_gather(data, group=None) -> list[Tensor]``.

    Tensors may have different shapes on different ranks (the shapes are exchanged first).
    Also accepts torch's call shape ``all_gather(tensor_list, tensor, group=None,
    async_op=False)``, which fills ``tensor_list`` with every rank's ``tensor``.

    Args:
        data: this rank's tensor, of up to 16 dimensions; in torch's call shape, the list of
            one tensor per rank to fill.
        *args: ``group``, the process group (None: the default group); in torch's call shape
            ``tensor``, ``group`` and ``async_op``.
        **kwargs: the same arguments by name.

    Returns:
        One tensor per rank, in rank order, each on ``data``'s device (``[data]`` when not
        distributed). In torch's call shape None, or a ``Handle`` with ``async_op``.

    Raises:
        ValueError: when a tensor of more than 16 dimensions is gathered across ranks.
    """
    if isinstance(data, list):
        return _all_gather_into(data, *args, **kwargs)
    return _all_gather(data, *args, **kwargs)


def _gather(data: Tensor, dst: int = 0, group: ProcessGroup | None = None) -> list[Tensor]:
    if get_world_size(group) == 1:
        return [data]
    group = _group(group)
    with named_operation("gather", group):
        shapes = _shape_of_each_rank(data, group)
        return _gather_uneven(data, group, shapes, dst=dst)


def gather(data: Tensor, *args: Any, **kwargs: Any) -> Any:
    """Gather every rank's ``data`` to one rank: ``gather(data, dst=0, group=None) -> list``.

    Works on nccl too, where torch has no gather, and with tensors whose shapes differ by
    rank. Also accepts torch's call shape ``gather(tensor, gather_list, dst, group, async_op)``
    (told apart by a second positional argument that is a list or None, or by
    ``gather_list`` given by name), which fills ``gather_list`` on ``dst``.

    Args:
        data: this rank's tensor, of up to 16 dimensions.
        *args: ``dst``, the rank in ``group`` that receives (default 0), and ``group``, the
            process group (None: the default group); in torch's call shape ``gather_list``,
            ``dst``, ``group`` and ``async_op``.
        **kwargs: the same arguments by name.

    Returns:
        On ``dst``, every rank's tensor in rank order, each on ``data``'s device; ``[]`` on
        the other ranks (``[data]`` when not distributed). In torch's call shape None, or with
        ``async_op`` a ``Handle`` (the gather has already finished).

    Raises:
        ValueError: when a tensor of more than 16 dimensions is gathered across ranks.
    """
    torch_shape = "gather_list" in kwargs or (
        args and (args[0] is None or isinstance(args[0], list)))
    if not torch_shape:
        return _gather(data, *args, **kwargs)
    names = ("gather_list", "dst", "group", "async_op")
    params = {"gather_list": None, "dst": 0, "group": None, "async_op": False}
    params.update(zip(names, args, strict=False))  # args may be fewer
    params.update(kwargs)
    gathered = _gather(data, params["dst"], params["group"])
    for target, value in zip(params["gather_list"] or [], gathered, strict=False):
        target.copy_(value)
    return Handle() if params["async_op"] else None


def gather_rows(row: Tensor, dst: int = 0, group: ProcessGroup | None = None,
                async_op: bool = False) -> Tensor | Handle | None:
    """Stack every rank's ``row`` in rank order on ``dst``, in one gather.

    One gather and no exchange of shapes (``gather`` takes tensors of any shape at the cost of
    a second collective), so every rank must pass a row of the same length and dtype.

    Args:
        row: this rank's 1-d tensor, of the same length and dtype on every rank.
        dst: the rank in ``group`` that receives the rows.
        group: the process group; None for the default group.
        async_op: return a ``Handle`` at once instead of waiting for the result.

    Returns:
        On ``dst``, a (world_size, length) tensor on ``row``'s device; None on the other
        ranks; a (1, length) tensor when not distributed. With ``async_op``, a ``Handle``
        whose ``result()`` is that.
    """
    world_size = get_world_size(group)
    if world_size == 1:
        rows = row.reshape(1, -1)
        return Handle(finish=lambda: rows) if async_op else rows
    group = _group(group)
    buffer = _for_comm(row, group)
    target = _global_rank(group, dst)
    if get_rank(group) != dst:
        return _run("gather", group, async_op, lambda a: torch_dist.gather(
            buffer, None, dst=target, group=group, async_op=a), None)
    rows = torch.empty((world_size, buffer.numel()), dtype=buffer.dtype,
                       device=buffer.device)
    handle = _run("gather", group, True, lambda a: torch_dist.gather(
        buffer, list(rows.unbind(0)), dst=target, group=group, async_op=a),
        lambda: rows.to(row.device))
    return handle if async_op else handle.result()  # type: ignore[union-attr]


def broadcast(data: Tensor, src: int = 0, group: ProcessGroup | None = None,
              async_op: bool = False) -> Handle | None:
    """Send ``src``'s ``data`` to every rank of ``group``, in place.

    Non-contiguous tensors, and tensors on another device than the backend's, work too: the
    backend gets a contiguous copy on its device and the result is copied back. When not
    distributed, nothing happens.

    Args:
        data: the tensor to send on ``src``, and to overwrite on the other ranks.
        src: the rank in ``group`` whose ``data`` is sent.
        group: the process group; None for the default group.
        async_op: return a ``Handle`` at once instead of waiting for the result.

    Returns:
        With ``async_op``, a ``Handle`` whose ``wait()`` finishes the work, the copy back
        included; else None.
    """
    if get_world_size(group) == 1:
        return Handle() if async_op else None
    group = _group(group)
    buffer = _for_comm(data, group)

    def finish() -> None:
        if buffer is not data:
            data.copy_(buffer)

    return _run("broadcast", group, async_op, lambda a: torch_dist.broadcast(
        buffer, _global_rank(group, src), group, async_op=a), finish)


def reduce(data: Tensor, dst: int = 0, op: str = "sum", group: ProcessGroup | None = None,
           async_op: bool = False) -> Handle | None:
    """Reduce ``data`` across the ranks of ``group`` into ``dst``'s ``data``.

    The ops, the moves between devices and what 'mean' does with integer tensors are those of
    ``all_reduce``; only ``dst`` receives the result. When not distributed, ``data`` stays as
    it is.

    Args:
        data: this rank's tensor; on ``dst`` it holds the result afterwards.
        dst: the rank in ``group`` that receives the result.
        op: 'sum', 'mean', 'product', 'min', 'max', 'band', 'bor' or 'bxor', in any case.
        group: the process group; None for the default group.
        async_op: return a ``Handle`` at once instead of waiting for the result.

    Returns:
        With ``async_op``, a ``Handle`` whose ``wait()`` finishes the work (on ``dst``, the
        division of 'mean' and the copy back included); else None.

    Raises:
        ValueError: when ``op`` is none of the above; the message names the allowed ones.
    """
    op = reduce_op_name(op)
    if get_world_size(group) == 1:
        return Handle() if async_op else None
    group = _group(group)
    buffer = _for_comm(data, group)
    world_size = get_world_size(group)
    on_dst = get_rank(group) == dst

    def finish() -> None:
        if not on_dst:
            return
        result = torch.true_divide(buffer, world_size) if op == "mean" else buffer
        if result is not data:
            data.copy_(result)

    return _run(f"reduce({op})", group, async_op, lambda a: torch_dist.reduce(
        buffer, _global_rank(group, dst), _TORCH_OPS[op], group, async_op=a), finish)


def sync_random_seed(seed: int | None = None, group: ProcessGroup | None = None) -> int:
    """Agree on one random seed: rank 0's, on every rank of ``group``.

    Args:
        seed: this rank's seed; None draws a fresh one below 2**31 (from numpy's global
            generator, on every rank; rank 0's wins).
        group: the process group; None for the default group.

    Returns:
        Rank 0's ``seed`` (or its fresh one), the same on every rank; this process's own
        when not distributed.
    """
    if seed is None:
        seed = int(np.random.randint(2**31))
    if get_world_size(group) == 1:
        return seed
    value = torch.tensor(seed, dtype=torch.int64)
    broadcast(value, 0, group)
    return int(value.item())


def _dict_value(value: Tensor | float | int) -> Tensor:
    """A dict value as a tensor: a Python float as float64, an int (or bool) as int64."""
    if isinstance(value, Tensor):
        return value
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def all_reduce_dict(data: Mapping[str, Tensor | float | int], op: str = "sum",
                    group: ProcessGroup | None = None) -> dict:
    """Reduce every value of a dict across ranks, in place, and return it.

    One flat collective per dtype reduces all the values. The dict is reduced in place (as
    MMEngine's is: code written for it logs ``data`` afterwards) and also returned. Keys may
    come in any order on each rank. Tensor values come back as tensors of their shape, numbers
    as numbers, and every value keeps its dtype: an int64 tensor comes back int64, a Python
    int (or bool) as an int. So 'mean' of an integer value is, as in MMEngine, the sum divided
    by the world size and truncated towards zero to fit the dtype; a caller that wants an
    exact mean passes floats (``float(count)``, ``tensor.double()``).

    Args:
        data: a dict of tensors or Python numbers, with the same keys on every rank. A
            mapping that cannot be changed is left as it is; the reduced copy is returned.
        op: one of ``all_reduce``'s ops ('sum', 'mean', 'product', 'min', 'max', 'band',
            'bor', 'bxor').
        group: the process group; None for the default group.

    Returns:
        ``data`` itself, every value reduced; for a mapping that cannot be changed, a new
        ordered dict of the reduced values in ``data``'s key order.

    Raises:
        TypeError: when ``data`` is not a dict (or other mapping); the message names the type
            it got. It is also the AssertionError MMEngine raises (``WrongArgument``).
        ValueError: when ``op`` is not one of the reduce ops; the message names them.
    """
    if not isinstance(data, Mapping):
        raise WrongArgument(f"all_reduce_dict expected a dict of tensors or numbers; got "
                           f"{type(data).__name__}")
    op = reduce_op_name(op)
    keys = sorted(data)
    tensors = {k: _dict_value(data[k]) for k in keys}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in keys:
        by_dtype.setdefault(tensors[key].dtype, []).append(key)
    reduced: dict[str, Tensor] = {}
    for names in by_dtype.values():
        flat = _flatten_dense_tensors([tensors[k].contiguous() for k in names])
        all_reduce(flat, op, group)
        values = _unflatten_dense_tensors(flat, [tensors[k] for k in names])
        for key, value in zip(names, values, strict=True):
            reduced[key] = value
    result = OrderedDict(
        (k, reduced[k] if isinstance(data[k], Tensor) else reduced[k].item()) for k in data
    )
    if not isinstance(data, MutableMapping):
        return result
    data.update(result)
    return data


def all_reduce_params(params: Iterable[Tensor], coalesce: bool = True, bucket_size_mb: int = -1,
                      op: str = "sum", group: ProcessGroup | None = None) -> None:
    """Reduce parameters or buffers across ranks, in place.

    Args:
        params: the tensors to reduce: parameters (their ``.data`` is reduced) or buffers,
            e.g. ``model.parameters()`` or ``model.buffers()``.
        coalesce: flatten the tensors into buckets by dtype, device and size, one collective
            per bucket; False: one collective per tensor.
        bucket_size_mb: the most MiB one bucket holds (a larger tensor gets a bucket of its
            own); 0 or less: no limit, one bucket per dtype and device.
        op: one of ``all_reduce``'s ops ('sum', 'mean', 'product', 'min', 'max', 'band',
            'bor', 'bxor').
        group: the process group; None for the default group.

    Raises:
        ValueError: when ``op`` is not one of the reduce ops; the message names them.
    """
    op = reduce_op_name(op)
    tensors = [p.data if isinstance(p, torch.nn.Parameter) else p for p in params]
    if get_world_size(group) == 1 or not tensors:
        return
    if not coalesce:
        for tensor in tensors:
            all_reduce(tensor, op, group)
        return
    for bucket in _buckets(tensors, bucket_size_mb):
        flat = _flatten_dense_tensors(bucket)
        all_reduce(flat, op, group)
        for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            tensor.copy_(value)


def _buckets(tensors: list[Tensor], bucket_size_mb: int) -> list[list[Tensor]]:
    """Group tensors by dtype and device, then cut each group at ``bucket_size_mb``."""
    limit = bucket_size_mb * 1024 * 1024 if bucket_size_mb > 0 else None
    groups: dict[tuple, list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    buckets = []
    for group in groups.values():
        current, size = [], 0
        for tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            if limit is not None and current and size + nbytes > limit:
                buckets.append(current)
                current, size = [], 0
            current.append(tensor)
            size += nbytes
        buckets.append(current)
    return buckets

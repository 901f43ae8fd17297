"""Collectives for any picklable object, and ``collect_results`` for distributed evaluation.

Objects travel as pickled bytes (highest protocol) in uint8 tensors. Only the bytes of other
ranks are unpickled: a rank's own object is handed back as it is. ``gather_object`` and
``collect_results`` send point to point to one rank, which pickles nothing itself, so the others
never hold the whole result list. ``collect_results`` sends results in chunks: pickling a chunk
overlaps with unpickling the one before, and small pickles are faster than one big one. Each
chunk's message ends with the next one's length, so the next receive is posted before a chunk
is unpickled: on a busy machine a rank waiting to be woken may wait a scheduler tick (about
4 ms here), and asking for each chunk's size first cost such a hand-off per message.
"""

from __future__ import annotations

import itertools
import os
import pickle
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import Tensor
from torch.distributed import ProcessGroup

from trainrun.dist.collectives import WrongArgument, _global_rank, _group
from trainrun.dist.device import get_comm_device
from trainrun.dist.info import (
    barrier,
    get_backend,
    get_default_group,
    get_rank,
    get_world_size,
    is_distributed,
)
from trainrun.dist.timeouts import named_operation

_PROTOCOL = pickle.HIGHEST_PROTOCOL
# Results per message when collecting: rank 0 unpickles one chunk while the next is pickled.
_CHUNK_ITEMS = 8192
# Bytes at the end of each chunk's message that give the next message's length.
_TRAILER = 8
# The gloo group `cpu_group` made, with the default group it was made in (both weakly, as
# info.py holds the local group): a new default group gets a new gloo group.
_CPU_GROUP: tuple[weakref.ref, weakref.ref] | None = None


def _dumps(obj: Any, device: torch.device) -> Tensor:
    payload = bytearray(pickle.dumps(obj, protocol=_PROTOCOL))  # writable: no copy to a tensor
    return torch.frombuffer(payload, dtype=torch.uint8).to(device)


def _loads(buffer: Tensor, size: int) -> Any:
    return pickle.loads(buffer[:size].cpu().numpy())


def _sizes(payload: Tensor, group: ProcessGroup) -> list[int]:
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    sizes = [torch.empty_like(mine) for _ in range(get_world_size(group))]
    torch_dist.all_gather(sizes, mine, group)
    return [int(s.item()) for s in sizes]


def _padded(payload: Tensor, length: int) -> Tensor:
    if payload.numel() == length:
        return payload
    out = torch.empty(length, dtype=torch.uint8, device=payload.device)
    out[: payload.numel()] = payload
    return out


def cpu_group() -> ProcessGroup:
    """A group over every rank that communicates on CPU: the default one when its backend is
    gloo or mpi, else a gloo group made once (every rank must call this together the first time).
    """
    global _CPU_GROUP
    if get_backend() in ("gloo", "mpi"):
        return _group(None)
    made = _CPU_GROUP and _CPU_GROUP[1]()
    if made is None or _CPU_GROUP[0]() is not get_default_group():
        made = torch_dist.new_group(backend="gloo")
        _CPU_GROUP = (weakref.ref(get_default_group()), weakref.ref(made))
    return made


def broadcast_object_list(data: list[Any], src: int = 0, group: ProcessGroup | None = None) -> None:
    """Replace the items of ``data`` on every rank with ``src``'s, in place, like torch's.

    Anything but a list is refused, in a single process too (code that passes one would fail
    only once it runs on several). When not distributed, ``data`` stays as it is.

    Args:
        data: a list of picklable objects: sent on ``src``; on the other ranks its items are
            replaced by ``src``'s.
        src: the rank in ``group`` whose items are sent.
        group: the process group; None for the default group.

    Raises:
        TypeError: when ``data`` is not a list; it is also the AssertionError MMEngine raises
            (``WrongArgument``).
    """
    if not isinstance(data, list):
        raise WrongArgument(f"broadcast_object_list fills a list in place; got "
                            f"{type(data).__name__} {data!r:.60}")
    if get_world_size(group) == 1:
        return
    group = _group(group)
    device = get_comm_device(group)
    is_src = get_rank(group) == src
    with named_operation("broadcast_object_list", group):
        payload = _dumps(list(data), device) if is_src else None
        size = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64, device=device)
        torch_dist.broadcast(size, _global_rank(group, src), group)
        if not is_src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        torch_dist.broadcast(payload, _global_rank(group, src), group)
    if not is_src:
        data[:] = _loads(payload, payload.numel())


def _all_gather_object(data: Any, group: ProcessGroup | None = None) -> list[Any]:
    if get_world_size(group) == 1:
        return [data]
    group = _group(group)
    rank = get_rank(group)
    with named_operation("all_gather_object", group):
        payload = _dumps(data, get_comm_device(group))
        sizes = _sizes(payload, group)
        longest = max(sizes)
        out = [torch.empty(longest, dtype=torch.uint8, device=payload.device) for _ in sizes]
        torch_dist.all_gather(out, _padded(payload, longest), group)
    return [data if r == rank else _loads(out[r], sizes[r]) for r in range(len(sizes))]


def all_gather_object(data: Any, *args: Any, **kwargs: Any) -> list[Any] | None:
    """Every rank's ``data``: ``all_gather_object(data, group=None) -> list``.

    Any picklable object. This rank's own entry is ``data`` itself, not a copy. Also accepts
    torch's call shape ``all_gather_object(object_list, obj, group=None)``, which fills
    ``object_list`` (pass ``obj=None`` by keyword to gather None that way).

    Args:
        data: this rank's object; in torch's call shape, the list to fill.
        *args: ``group``, the process group (None: the default group); in torch's call shape
            ``obj`` and ``group``.
        **kwargs: the same arguments by name.

    Returns:
        One object per rank, in rank order (``[data]`` when not distributed); None in torch's
        call shape.
    """
    torch_shape = "obj" in kwargs or (
        args and args[0] is not None and not isinstance(args[0], ProcessGroup)
    )
    if not torch_shape:
        return _all_gather_object(data, *args, **kwargs)
    obj = kwargs.pop("obj") if "obj" in kwargs else args[0]
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    data[:] = _all_gather_object(obj, group)
    return None


def _send_object(data: Any, dst: int, group: ProcessGroup) -> None:
    """Send ``data`` to group rank ``dst``: its size, then its pickled bytes."""
    payload = _dumps(data, get_comm_device(group))
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    torch_dist.send(size, _global_rank(group, dst), group)
    torch_dist.send(payload, _global_rank(group, dst), group)


def _receive_objects(sources: list[int], group: ProcessGroup) -> list[Any]:
    """The objects that group ranks ``sources`` send with ``_send_object``, in that order.

    Every receive is posted before the first is unpickled, so later ranks' bytes arrive while
    earlier ones are being unpickled.
    """
    device = get_comm_device(group)
    senders = [_global_rank(group, src) for src in sources]
    sizes = [torch.empty(1, dtype=torch.int64, device=device) for _ in senders]
    for work in [torch_dist.irecv(sizes[i], src, group) for i, src in enumerate(senders)]:
        work.wait()
    payloads = [torch.empty(int(size.item()), dtype=torch.uint8, device=device) for size in sizes]
    works = [torch_dist.irecv(payloads[i], src, group) for i, src in enumerate(senders)]
    objects = []
    for work, payload in zip(works, payloads, strict=True):
        work.wait()
        objects.append(_loads(payload, payload.numel()))
    return objects


def gather_object(data: Any, dst: int = 0, group: ProcessGroup | None = None) -> list | None:
    """Every rank's ``data`` as a list on ``dst`` (None elsewhere); works on nccl too.

    Any picklable object. The other ranks send to ``dst`` point to point; ``dst`` neither
    pickles its own ``data`` (its entry is ``data`` itself) nor sends anything.

    Args:
        data: this rank's object.
        dst: the rank in ``group`` that receives.
        group: the process group; None for the default group.

    Returns:
        On ``dst``, one object per rank in rank order; None on the other ranks. ``[data]``
        when not distributed.
    """
    if get_world_size(group) == 1:
        return [data]
    group = _group(group)
    rank = get_rank(group)
    with named_operation("gather_object", group):
        if rank != dst:
            _send_object(data, dst, group)
            return None
        others = [r for r in range(get_world_size(group)) if r != dst]
        received = iter(_receive_objects(others, group))
    return [data if r == dst else next(received) for r in range(len(others) + 1)]


_MISSING = object()


def _interleave(parts: list[list[Any]], size: int) -> list[Any]:
    """Undo a non-shuffling DistributedSampler's dealing: rank 0's first, rank 1's first, ..."""
    total, world_size = sum(len(p) for p in parts), len(parts)
    if all(len(p) == len(range(r, total, world_size)) for r, p in enumerate(parts)):
        ordered = [None] * total
        for r, part in enumerate(parts):
            ordered[r::world_size] = part  # each rank's items into every world_size-th slot
    else:  # parts of uneven lengths that no sampler deals: take them round-robin
        mixed = itertools.chain.from_iterable(itertools.zip_longest(*parts, fillvalue=_MISSING))
        ordered = [item for item in mixed if item is not _MISSING]
    del ordered[size:]
    return ordered


def _next_payload(chunks: Iterator[list], device: torch.device) -> Tensor | None:
    """The next chunk pickled, or None when there is none left."""
    chunk = next(chunks, None)
    return None if chunk is None else _dumps(chunk, device)


def _with_trailer(payload: Tensor, next_size: int) -> Tensor:
    """``payload`` followed by 8 bytes saying how long the message after it is (0: none)."""
    trailer = torch.frombuffer(bytearray(next_size.to_bytes(_TRAILER, "little")), dtype=torch.uint8)
    return torch.cat([payload, trailer.to(payload.device)])


def _send_list(items: list, dst: int, group: ProcessGroup) -> None:
    """Send ``items`` to group rank ``dst`` in pickled chunks.

    The first message is the first chunk's size; every chunk then ends with the next one's
    size (0 after the last). So the receiver knows the next message's length as soon as the
    current one arrives and posts its receive before it unpickles: the hand-off that gloo
    needs per message (it sends only once the receive is posted; on a loaded machine the
    sender may wait a scheduler tick to hear of it) overlaps with unpickling instead of
    adding to it. Sends are asynchronous, so the next chunk is pickled while this one travels.
    """
    device = get_comm_device(group)
    peer = _global_rank(group, dst)
    chunks = (items[i:i + _CHUNK_ITEMS] for i in range(0, len(items), _CHUNK_ITEMS))
    payload = _next_payload(chunks, device)
    first = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64,
                         device=device)
    sent = [first]  # every tensor stays alive until its send is done
    works = [torch_dist.isend(first, peer, group)]
    while payload is not None:
        following = _next_payload(chunks, device)
        message = _with_trailer(payload, 0 if following is None else following.numel())
        sent.append(message)
        works.append(torch_dist.isend(message, peer, group))
        payload = following
    for work in works:
        work.wait()


def _receive_list(src: int, group: ProcessGroup) -> list:
    """The list that group rank ``src`` sends with ``_send_list``. The next chunk's receive is
    posted before this one is unpickled, so it arrives meanwhile."""
    device = get_comm_device(group)
    peer = _global_rank(group, src)
    first = torch.empty(1, dtype=torch.int64, device=device)
    torch_dist.recv(first, peer, group)
    size = int(first.item())
    pending = _post_receive(size, peer, group, device)
    items: list = []
    while pending is not None:
        message, work = pending
        work.wait()
        body = message.numel() - _TRAILER
        next_size = int.from_bytes(message[body:].cpu().numpy().tobytes(), "little")
        pending = _post_receive(next_size, peer, group, device)
        items.extend(_loads(message, body))
    return items


def _post_receive(size: int, peer: int, group: ProcessGroup,
                  device: torch.device) -> tuple[Tensor, torch_dist.Work] | None:
    """Start receiving a chunk of ``size`` pickled bytes and its trailer (None for size 0)."""
    if size == 0:
        return None
    message = torch.empty(size + _TRAILER, dtype=torch.uint8, device=device)
    return message, torch_dist.irecv(message, peer, group)


def _collect_through_group(result_part: list, size: int, group: ProcessGroup) -> list | None:
    """Every rank sends its part to rank 0 point to point; rank 0 pickles nothing."""
    with named_operation("collect_results", group):
        if get_rank(group) != 0:
            _send_list(list(result_part), 0, group)
            return None
        others = [_receive_list(src, group) for src in range(1, get_world_size(group))]
    return _interleave([list(result_part), *others], size)


def collect_results_gpu(result_part: list, size: int) -> list | None:
    """Gather every rank's results to rank 0 through the communication backend.

    The half of ``collect_results`` for ``device='gpu'``: each rank sends its part to rank 0
    point to point, on the device the backend communicates on (a GPU under nccl).

    Args:
        result_part: this rank's results.
        size: how many results to keep (the data set's length: the sampler pads).

    Returns:
        On rank 0, every rank's results in the order a non-shuffling ``DistributedSampler``
        dealt them out, cut to ``size``; None on the other ranks. When not distributed, the
        first ``size`` items of ``result_part``.
    """
    if not is_distributed():
        return list(result_part)[:size]
    return _collect_through_group(result_part, size, _group(None))


def _collect_through_dir(result_part: list, size: int, tmpdir: str) -> list | None:
    rank, world_size = get_rank(), get_world_size()
    holder = [None]
    if rank == 0:
        os.makedirs(tmpdir, exist_ok=True)
        holder[0] = tempfile.mkdtemp(prefix="collect_", dir=tmpdir)  # mode 0700
    broadcast_object_list(holder, src=0, group=cpu_group())
    directory = holder[0]
    try:
        if rank != 0:
            path = os.path.join(directory, f"part_{rank}.pkl")
            with open(path + ".tmp", "wb") as f:
                pickle.dump(list(result_part), f, protocol=_PROTOCOL)
            os.replace(path + ".tmp", path)
        barrier(cpu_group())
        if rank != 0:
            return None
        parts = [list(result_part)]
        for other in range(1, world_size):
            with open(os.path.join(directory, f"part_{other}.pkl"), "rb") as f:
                parts.append(pickle.load(f))
        return _interleave(parts, size)
    finally:
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


def collect_results_cpu(result_part: list, size: int, tmpdir: str | None = None) -> list | None:
    """Gather every rank's results to rank 0 on the CPU.

    The half of ``collect_results`` for ``device='cpu'``. Without ``tmpdir`` the results go
    through a gloo group (no shared disk needed); with it, through a private directory created
    inside ``tmpdir`` (which every rank must see) and removed after.

    Args:
        result_part: this rank's results.
        size: how many results to keep (the data set's length: the sampler pads).
        tmpdir: a directory every rank sees, to pass the results through; None: through a
            gloo group instead.

    Returns:
        On rank 0, every rank's results in the order a non-shuffling ``DistributedSampler``
        dealt them out, cut to ``size``; None on the other ranks. When not distributed, the
        first ``size`` items of ``result_part``.
    """
    if not is_distributed():
        return list(result_part)[:size]
    if tmpdir is not None:
        return _collect_through_dir(result_part, size, tmpdir)
    return _collect_through_group(result_part, size, cpu_group())


def collect_results(results: list, size: int, device: str = "cpu",
                    tmpdir: str | None = None) -> list | None:
    """Rank 0 gets every rank's ``results`` in dataset order, cut to ``size``; others get None.

    The order is the one a non-shuffling ``DistributedSampler`` dealt (rank 0's first item,
    rank 1's first, ..., then the second ones); its padding is cut off; results that are
    themselves None are kept. The other ranks never hold the whole list.

    Args:
        results: this rank's results, in the order it made them.
        size: how many results to keep (the data set's length: the sampler pads).
        device: 'cpu' (``collect_results_cpu``: through a gloo group, or through ``tmpdir``)
            or 'gpu' (``collect_results_gpu``: through the communication backend).
        tmpdir: for 'cpu', a directory every rank sees: the results go through a private
            directory created inside it and removed after. None: no disk is used. Not used
            for 'gpu'.

    Returns:
        On rank 0, the full list in dataset order, cut to ``size``; None on the other ranks.
        When not distributed, the first ``size`` items of ``results``.

    Raises:
        ValueError: when ``device`` is neither 'cpu' nor 'gpu'.
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu'; got {device!r}")
    if device == "gpu":
        return collect_results_gpu(results, size)
    return collect_results_cpu(results, size, tmpdir)

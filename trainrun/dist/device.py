"""Which device computation and communication happen on, and moving nested data there."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from trainrun.dist.info import get_backend

# Communication backend -> the device type its collectives run on.
_BACKEND_DEVICE = {"nccl": "cuda", "hccl": "npu", "cncl": "mlu", "mccl": "musa"}


# The dtypes by the names configs and command lines give them (precision, export's --dtype,
# fsdp's mixed_precision), and the longer names also accepted for them.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast computes in for ``precision``; None for fp32 (no autocast)."""
    return None if precision == "fp32" else DTYPES[precision]


def get_device() -> str:
    """The type of device this process computes on: the first accelerator available, else cpu.

    Returns:
        'cuda', 'npu', 'mlu', 'musa' or 'mps' (checked in that order) when such a device is
        available, else 'cpu'.
    """
    if torch.cuda.is_available():
        return "cuda"
    for name in ("npu", "mlu", "musa"):
        module = getattr(torch, name, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return name
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def get_comm_device(group: ProcessGroup | None = None) -> torch.device:
    """The device ``group``'s backend communicates on: cuda for nccl, cpu for gloo and mpi.

    Args:
        group: the process group; None for the default group.

    Returns:
        The current device of the backend's accelerator type (cuda for nccl, npu for hccl,
        mlu for cncl, musa for mccl); cpu for gloo, mpi and any other backend, and when not
        distributed.
    """
    kind = _BACKEND_DEVICE.get(get_backend(group) or "", "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def _not_data(data: Any) -> str:
    """What is wrong with ``data`` that holds no tensors: MMEngine's words (which code written
    for it may match), then which value it was."""
    return (f"data should be a Tensor, sequence of tensor or dict; got "
            f"{type(data).__name__}: {data!r:.60}")


def get_data_device(data: Any) -> torch.device:
    """The one device of a tensor or of a (nested) list/tuple/dict of tensors.

    Args:
        data: a tensor, or a list, tuple or dict (nested to any depth) of tensors.

    Returns:
        The device all of ``data``'s tensors are on.

    Raises:
        ValueError: when the tensors sit on different devices, or there are none.
        TypeError: when ``data`` (or an item in it) is neither a tensor nor a container.
    """
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, Mapping):
        items: Iterable[Any] = data.values()
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes)):
        items = data
    else:
        raise TypeError(_not_data(data))
    device = None
    for item in items:
        current = get_data_device(item)
        if device is None:
            device = current
        elif current != device:
            raise ValueError(f"data holds tensors on different devices: {device} and {current}")
    if device is None:
        raise ValueError("data holds no tensors, so it has no device")
    return device


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``data`` with ``fn`` applied to each of its tensors: in mappings (their type kept),
    lists, tuples and namedtuples, nested to any depth; anything else as it is.

    Args:
        data: a tensor, or a (nested) container of tensors and other values.
        fn: what becomes of a tensor, e.g. ``lambda t: t.to(device)``.

    Returns:
        ``data`` with each tensor replaced by ``fn(tensor)``, in containers of the same types.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({key: map_tensors(value, fn) for key, value in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(map_tensors(item, fn) for item in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(item, fn) for item in data)
    return data


def cast_data_device(data: Any, device: torch.device | str, out: Any = None) -> Any:
    """Move a tensor or (nested) list/tuple/dict of tensors to ``device``.

    With ``out`` (the same nesting), copies into its tensors instead and returns ``out``.

    Args:
        data: a tensor, or a list, tuple or dict (nested to any depth) of tensors.
        device: the device to move to, e.g. 'cuda' or ``torch.device('cpu')``.
        out: None, or data of the same type and nesting, on ``device``, to copy into.

    Returns:
        ``data`` on ``device``, in containers of the same types; ``out`` when given.

    Raises:
        TypeError: when ``out``'s type is not ``data``'s, or ``data`` holds anything but
            tensors and containers.
        ValueError: when ``out`` is on another device type, or its keys or lengths differ from
            ``data``'s.
    """
    if out is not None and type(out) is not type(data) and not (
        isinstance(out, torch.Tensor) and isinstance(data, torch.Tensor)
    ):
        raise TypeError(f"out ({type(out)}) must have the same type as data ({type(data)})")
    if isinstance(data, torch.Tensor):
        if out is None:
            return data.to(device)
        if out.device != torch.device(device) and out.device.type != torch.device(device).type:
            raise ValueError(f"out is on {out.device}, not on the requested {device}")
        out.copy_(data)
        return out
    if isinstance(data, Mapping):
        if out is None:
            return type(data)({k: cast_data_device(v, device) for k, v in data.items()})
        if set(out.keys()) != set(data.keys()):
            raise ValueError("out and data must have the same keys")
        for key, value in data.items():
            cast_data_device(value, device, out[key])
        return out
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes)):
        if out is None:
            return type(data)(cast_data_device(item, device) for item in data)
        if len(out) != len(data):
            raise ValueError(f"out has {len(out)} items, data {len(data)}")
        for item, target in zip(data, out, strict=True):
            cast_data_device(item, device, target)
        return out
    raise TypeError(_not_data(data))

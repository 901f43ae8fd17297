"""The checkpoint format 'dcp': a directory written with ``torch.distributed.checkpoint``.

What strategy 'fsdp' writes: every rank's shard of model and optimiser (``__<rank>_<n>.distcp``
files and DCP's ``.metadata``, a pickle recording every entry's shape, dtype and place in the
shards), plus rank 0's train state in ``train_state.pt``. It is read here in one process with
no group: the metadata through an unpickler that refuses everything but DCP's own records, and
the model's tensors without the optimiser's. ``torch.distributed.checkpoint`` is imported where
it is used: it costs start-up time that runs under other strategies would pay.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainrun.checkpoint.format import CheckpointFormat
from trainrun.checkpoint.optimizer_state import GroupRecord, Groups
from trainrun.checkpoint.safe_load import load_torch_file
from trainrun.checkpoint.train_state import TRAIN_STATE

_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                 "torch.distributed.checkpoint.filesystem",
                 "torch.distributed.checkpoint._extension")
_SAFE_GLOBALS = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
                 ("builtins", "frozenset"), ("builtins", "slice"), ("torch", "strided"),
                 ("torch", "contiguous_format"), ("torch", "preserve_format"),
                 ("torch", "channels_last"), ("pathlib", "PosixPath"), ("pathlib", "Path"),
                 ("torch._utils", "_rebuild_tensor_v2"),
                 ("torch.serialization", "_get_layout")}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` (a pickle) refusing every global but DCP's own records,
    dtypes and plain containers: what ``weights_only=True`` is to a torch file."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES or (module, name) in _SAFE_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, "
                                     "which a checkpoint never needs; refusing to load it")


def check_metadata(path: str | os.PathLike) -> Any:
    """Refuse a checkpoint directory whose metadata would run code when unpickled, or whose
    metadata or shard files were cut short (nothing but their sizes is read); returns the
    metadata (DCP's record of every saved entry's shape, dtype and place in the shards)."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (EOFError, pickle.UnpicklingError) as error:
        if isinstance(error, EOFError) or "truncated" in str(error):
            raise ValueError(f"{file} is truncated: its pickle ends early (its write did not "
                             "finish, or the copy was cut short)") from None
        raise pickle.UnpicklingError(f"{file}: {error}") from None
    except (AttributeError, IndexError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: not readable checkpoint metadata (written by something "
                         f"else, or damaged; {type(error).__name__})") from None
    _check_shard_sizes(Path(path), metadata)
    return metadata


def flat_optimizer_state(metadata: Any) -> bool:
    """Whether a DCP checkpoint's optimiser options are recorded per parameter name
    (``optimizer.param_groups.<name>.<option>``, as pipeline stages write them) instead of
    per group number (``optimizer.param_groups.<i>.<option>``).

    Args:
        metadata: the checkpoint's metadata (`check_metadata`'s).
    """
    prefix = "optimizer.param_groups."
    return any(not key[len(prefix):].partition(".")[0].isdigit()
               for key in metadata.state_dict_metadata if key.startswith(prefix))


def _check_shard_sizes(path: Path, metadata: Any) -> None:
    """Refuse shard files shorter than the bytes the metadata records in them."""
    ends: dict[str, int] = {}
    for place in (getattr(metadata, "storage_data", None) or {}).values():
        ends[place.relative_path] = max(ends.get(place.relative_path, 0),
                                        place.offset + place.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file} is missing: the checkpoint's metadata records "
                             f"{end} bytes in it")
        if file.stat().st_size < end:
            raise ValueError(f"{file} is truncated: {file.stat().st_size} bytes, the "
                             f"checkpoint's metadata records {end}")


def _read_small_entries(path: Path, keys: list[str]) -> dict[str, Any]:
    """The pickled (non-tensor) entries ``keys`` of the checkpoint directory ``path``, each
    read with weights_only (DCP's own loading of them would not), in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    found: dict[str, Any] = dict.fromkeys(keys)

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            found[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    with quiet_single_process():
        dcp.load(dict.fromkeys(keys), checkpoint_id=str(path), no_dist=True,
                 planner=SafePlanner(flatten_state_dict=False))
    return found


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every save and load without a group; in a one-process run that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class DCPDirectory(CheckpointFormat):
    """A ``torch.distributed.checkpoint`` directory (strategy 'fsdp'): every rank's shards,
    DCP's metadata, and the runner's train state in ``train_state.pt``."""

    name = "dcp"

    @classmethod
    def owns(cls, path: Path) -> bool:
        return (path / ".metadata").is_file()

    @classmethod
    def look_inside(cls, path: Path) -> None:
        check_metadata(path)

    @classmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        """The directory as one plain state (full tensors; the runner's train state merged
        in), read in this process alone: for ``load_from`` under any strategy."""
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        check_metadata(path)
        with tempfile.TemporaryDirectory() as tmp:
            target = os.path.join(tmp, "full.pt")
            dcp_to_torch_save(str(path), target)
            state = torch.load(target, map_location="cpu", weights_only=True)
        train_state = Path(path) / TRAIN_STATE
        if train_state.is_file():
            state = {**load_torch_file(train_state), **state}
        return state

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, Tensor]:
        """The whole model's tensors, plain keys, read in this process alone without the
        optimiser's state (a third of the memory of reading it all)."""
        import torch.distributed.checkpoint as dcp

        metadata = check_metadata(path)
        model = {}
        for key, entry in metadata.state_dict_metadata.items():
            if key.startswith("model.") and hasattr(entry, "size"):  # tensors, not pickled bytes
                model[key.removeprefix("model.")] = torch.empty(entry.size,
                                                                dtype=entry.properties.dtype)
        with quiet_single_process():
            dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
        return model

    @classmethod
    def read_train_state(cls, path: Path) -> dict[str, Any]:
        return load_torch_file(path / TRAIN_STATE)

    @classmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        """Read from the metadata alone."""
        metadata = check_metadata(path)
        return {key.removeprefix("model."): tuple(entry.size)
                for key, entry in metadata.state_dict_metadata.items()
                if key.startswith("model.") and hasattr(entry, "size")}

    @classmethod
    def param_groups(cls, path: Path) -> Groups | None:
        """Counted from the metadata (DCP records each group's options as
        ``optimizer.param_groups.<i>.<option>``), each group's name and parameters read from
        the shards (a few small entries); where those cannot be read, the count alone."""
        metadata = check_metadata(path)
        if flat_optimizer_state(metadata):  # (options per parameter: no groups to count)
            return None
        prefix = "optimizer.param_groups."
        entries = [key for key in metadata.state_dict_metadata if key.startswith(prefix)]
        count = len({key[len(prefix):].partition(".")[0] for key in entries})
        if not count:
            return None
        wanted = [key for key in entries if key.rpartition(".")[2] in ("name", "params")]
        try:
            found = _read_small_entries(path, wanted)
        except Exception:  # the names are a courtesy: the count is what a resume checks
            found = {}
        groups = []
        for index in range(count):
            params = found.get(f"{prefix}{index}.params")
            groups.append(GroupRecord(found.get(f"{prefix}{index}.name"),
                                      len(params) if isinstance(params, list) else None))
        return {"": groups}

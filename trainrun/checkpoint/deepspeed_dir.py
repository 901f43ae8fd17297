"""The checkpoint format 'deepspeed': DeepSpeed's own checkpoint directory.

What strategy 'deepspeed' writes: DeepSpeed's files under the tag ``state`` (every rank's ZeRO
partitions, rank 0's model states) plus rank 0's train state in ``train_state.pt``. DeepSpeed
reads its files with weights_only=False; every read here forces weights_only, with DeepSpeed's
own record types allowed (`weights_only_loads`). A checkpoint written by another number of
processes is converted to DeepSpeed's universal checkpoint to resume (`universal_copy`).
DeepSpeed is imported only inside the functions that need it, never on importing this.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainrun.checkpoint.format import CheckpointFormat
from trainrun.checkpoint.optimizer_state import GroupRecord, Groups, saved_groups
from trainrun.checkpoint.safe_load import (
    load_mapped,
    load_torch_file,
    refuse_truncated,
    refusing_unsafe,
)
from trainrun.checkpoint.train_state import TRAIN_STATE
from trainrun.dist import barrier, broadcast_object_list, get_world_size, is_main_process

TAG = "state"  # DeepSpeed's tag: the sub-directory holding its files

_OPTIM_PARTITION = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
# '.tmp-': the runner removes such entries of the checkpoint directory before its next save,
# so a universal copy left by a crash while resuming does not stay
UNIVERSAL_PREFIX = ".tmp-universal-"


def saved_world_size(path: str | os.PathLike) -> int | None:
    """How many processes wrote the DeepSpeed checkpoint at ``path`` (one ZeRO optimiser
    partition each); None where its optimiser state is not partitioned (ZeRO-0)."""
    ranks = {int(found.group(1)) for file in (Path(path) / TAG).iterdir()
             if (found := _OPTIM_PARTITION.search(file.name))}
    return len(ranks) or None


def to_universal(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Write DeepSpeed's universal checkpoint of the checkpoint at ``path`` into ``output``:
    every parameter's weights and optimiser state whole, which an engine on any number of
    processes loads. DeepSpeed's own converter, run in this process with its reads forced to
    weights_only and its progress output dropped. Our models declare no tensor or pipeline
    parallel layout, which ZeRO-1/2's conversion asks for: it is injected as 'none'."""
    from deepspeed.checkpoint.ds_to_universal import main as convert

    args = argparse.Namespace(input_folder=str(Path(path) / TAG),
                              output_folder=str(Path(output) / TAG), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    dropped = io.StringIO()
    with weights_only_loads(path), contextlib.redirect_stdout(dropped), \
            contextlib.redirect_stderr(dropped):
        convert(args)


@contextlib.contextmanager
def universal_copy(path: str | os.PathLike, saved: int) -> Iterator[Path]:
    """The universal form of the checkpoint at ``path`` (written by ``saved`` processes), made
    by rank 0 in a temporary directory beside it (where every rank can read, as it reads the
    checkpoint) and removed on leaving. The checkpoint itself is left as it is. Every rank
    must enter; a failed conversion raises on every rank."""
    made: list[Any] = [None, None]  # the directory, and the error converting into it
    if is_main_process():
        try:
            made[0] = tempfile.mkdtemp(prefix=f"{UNIVERSAL_PREFIX}{Path(path).name}-",
                                       dir=Path(path).parent)
            to_universal(path, made[0])
        except Exception as error:
            made[1] = f"{type(error).__name__}: {error}"
    broadcast_object_list(made)
    try:
        if made[1] is not None:
            raise RuntimeError(
                f"resume: {path} was written by {saved} processes and this job has "
                f"{get_world_size()}; converting it to DeepSpeed's universal checkpoint failed "
                f"({made[1]}); resume on {saved} processes, or start from its weights only "
                f"with load_from")
        yield Path(made[0])
        barrier()  # every rank has read it
    finally:
        if is_main_process() and made[0] is not None:
            shutil.rmtree(made[0], ignore_errors=True)


# What DeepSpeed's checkpoint files hold besides tensors and plain containers (0.16 to 0.19):
# the only globals `weights_only_loads` lets through.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def weights_only_loads(path: str | os.PathLike) -> Any:
    """Every ``torch.load`` inside the block reads with weights_only, DeepSpeed's own record
    types (`DEEPSPEED_GLOBALS`) allowed: DeepSpeed reads its files with weights_only=False,
    which runs whatever a crafted checkpoint holds. torch honours the environment variable
    even over an explicit weights_only=False."""
    import importlib

    allowed = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError):
            allowed.append(getattr(importlib.import_module(module), attr))
    before = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with refusing_unsafe(path), torch.serialization.safe_globals(allowed):
            yield
    finally:
        if before is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = before


class DeepSpeedDirectory(CheckpointFormat):
    """DeepSpeed's checkpoint directory (strategy 'deepspeed'): its files under the tag
    ``state``, and the runner's train state in ``train_state.pt``."""

    name = "deepspeed"

    @classmethod
    def owns(cls, path: Path) -> bool:
        return any((path / TAG).glob("*mp_rank_00_model_states.pt"))

    @classmethod
    def look_inside(cls, path: Path) -> None:
        """The runner's train state and rank 0's model states, memory-mapped."""
        with weights_only_loads(path):
            for file in [path / TRAIN_STATE, *sorted((path / TAG).glob(
                    "*mp_rank_00_model_states.pt"))]:
                load_mapped(file)

    @classmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        raise ValueError(f"{path} is a DeepSpeed checkpoint: strategy 'deepspeed' resumes it; "
                         f"load_from reads its weights into any strategy")

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, Tensor]:
        """The whole model's fp32 weights, plain keys, from a ZeRO 1-3 checkpoint directory
        (no process group needed): what ``load_from`` reads into any strategy."""
        for file in sorted((path / TAG).glob("*.pt")):
            refuse_truncated(file)  # where DeepSpeed's reading would say "[Errno 22] ..."
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_loads(path):
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=TAG))

    @classmethod
    def read_train_state(cls, path: Path) -> dict[str, Any]:
        return load_torch_file(path / TRAIN_STATE)

    @classmethod
    def param_groups(cls, path: Path) -> Groups | None:
        """From rank 0's model-states file (memory-mapped): under ZeRO 1-3 DeepSpeed records
        the shapes of each group's trainable parameters (``param_shapes``, one entry per
        group: the count is compared, not the tensors, frozen ones being left out); without
        ZeRO the optimiser's own state is there. Names are not recorded."""
        state = _model_states(path)
        if isinstance(state.get("param_shapes"), list):
            return {"": [GroupRecord(None, None) for _ in state["param_shapes"]]}
        optimizer = state.get("optimizer")
        found = saved_groups(optimizer)
        return None if found is None else {
            name: [GroupRecord(None, None) for _ in groups] for name, groups in found.items()}

    @classmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        """Every parameter's and buffer's, read from rank 0's model-states file
        (memory-mapped: its tensors are not read). ZeRO-3 keeps empty placeholders in
        ``module``; the shapes DeepSpeed records are the whole ones."""
        state = _model_states(path)
        shapes: dict[str, tuple[int, ...]] = {}
        for group in [*(state.get("param_shapes") or []),
                      state.get("frozen_param_shapes") or {}]:
            shapes.update((name, tuple(size)) for name, size in group.items())
        for name, source in (state.get("shared_params") or {}).items():
            if source in shapes:
                shapes[name] = shapes[source]
        module = state.get("module") or {}
        shapes.update((name, tuple(module[name].shape))
                      for name in state.get("buffer_names") or [] if name in module)
        return shapes


def _model_states(path: Path) -> dict[str, Any]:
    """Rank 0's model-states file of the DeepSpeed checkpoint ``path``, memory-mapped."""
    files = sorted((path / TAG).glob("*mp_rank_00_model_states.pt"))
    with weights_only_loads(path):
        return load_mapped(files[0])

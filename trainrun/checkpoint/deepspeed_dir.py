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


def saved_zero_stage(path: str | os.PathLike) -> int:
    """The ZeRO stage the DeepSpeed checkpoint at ``path`` was written under (0 without
    ZeRO), from the config rank 0's model-states file records."""
    config = _model_states(Path(path)).get("ds_config") or {}
    return int((config.get("zero_optimization") or {}).get("stage", 0))


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
        """The whole checkpoint as one plain state, read in this process alone: the fp32
        weights, the optimiser's state with its parameters by name (`named_optimizer_state`,
        through DeepSpeed's universal checkpoint, made in a temporary directory and removed)
        and the runner's train state. What another strategy resumes. ZeRO stages 1 to 3 only:
        without ZeRO, DeepSpeed keeps its optimiser's state in a form of its own."""
        if saved_world_size(path) is None:
            raise ValueError(f"{path} is a DeepSpeed checkpoint without ZeRO (stage 0): only "
                             f"strategy 'deepspeed' resumes it; load_from reads its weights "
                             f"into any strategy")
        state = {**cls.read_train_state(path), "model": cls.read_weights(path)}
        with tempfile.TemporaryDirectory(prefix="trainrun-universal-") as made:
            to_universal(path, made)
            state["optimizer"] = _named_optimizer_state(Path(made) / TAG, _model_states(path))
        return state

    @classmethod
    def whole_refusal(cls, path: Path, precision: str, accumulate: int) -> str | None:
        """Without ZeRO, DeepSpeed's optimiser state is in a form of its own; under fp16 its
        loss scale is its own scaler's; between the micro-steps of an accumulation group its
        gradients were not saved. Each is refused (`deepspeed_change_refusal`)."""
        if saved_world_size(path) is None:
            return ("it is a DeepSpeed checkpoint without ZeRO (zero_stage 0), whose optimiser "
                    "state only strategy 'deepspeed' reads: resume it under that strategy, or "
                    "start a new run from its weights alone (load_from)")
        return deepspeed_change_refusal(cls.read_train_state(path), precision, accumulate)

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, Tensor]:
        """The whole model's fp32 weights, plain keys, from a ZeRO 1-3 checkpoint directory
        (no process group needed): what ``load_from`` reads into any strategy."""
        for file in sorted((path / TAG).glob("*.pt")):
            refuse_truncated(file)  # where DeepSpeed's reading would say "[Errno 22] ..."
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        dropped = io.StringIO()  # its progress output: lines and bars in a run's log
        with weights_only_loads(path), contextlib.redirect_stdout(dropped), \
                contextlib.redirect_stderr(dropped):
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


def _named_optimizer_state(universal: Path, model_states: dict[str, Any]) -> dict[str, Any]:
    """The optimiser's state in DeepSpeed's universal checkpoint ``universal`` (its tag's
    directory), each parameter by name, in torch's form: every group's settings, and each
    parameter's moments (in its shape) and step count (ZeRO-3 records one step for all).
    The groups' parameters are those ``model_states`` records for each group (``param_shapes``)."""
    zero = universal / "zero"
    with weights_only_loads(universal):
        meta = torch.load(zero / "optimizer_state.pt", map_location="cpu")
    first = next(iter((meta.get("optimizer_state_dict") or {}).get("state", {}).values()), {})
    groups, state = [], {}
    for shapes, group in zip(model_states["param_shapes"], meta["param_groups"], strict=True):
        groups.append({**{key: value for key, value in group.items() if key != "params"},
                       "params": list(shapes)})
        for name in shapes:
            # each its own step tensor: torch's optimisers count their steps in place
            entry = {"step": first["step"].clone()} if "step" in first else {}
            for file in sorted((zero / name).glob("*.pt")):
                value = load_torch_file(file)
                if file.stem == "step":
                    entry["step"] = value
                elif file.stem != "fp32":  # ZeRO-3's files hold the flat tensor itself
                    value = value["param"] if isinstance(value, dict) else value
                    entry[file.stem] = value.reshape(shapes[name])
            state[name] = entry
    return {"state": state, "param_groups": groups}


def write_universal(folder: str | os.PathLike, weights: dict[str, Tensor],
                    optimizer: dict[str, Any], records: dict[str, Any]) -> None:
    """Write a model's parameters and their optimiser state in the form of DeepSpeed's
    universal checkpoint (its ``zero`` directory), which a ZeRO optimiser on any number of
    processes loads: how a checkpoint another strategy wrote reaches a DeepSpeed engine.

    Args:
        folder: an empty directory (the tag's, as the optimiser's loader is given it).
        weights: the whole model's tensors by name (each parameter's fp32 master copy is
            made from it).
        optimizer: the optimiser's state by parameter name (`named_optimizer_state`).
        records: what DeepSpeed's loader reads beside the tensors: the engine's loss scaler
            (``loss_scaler``, ``dynamic_loss_scale``), ``clip_grad`` and ``ds_version``.
    """
    zero = Path(folder) / "zero"
    for group in optimizer["param_groups"]:
        for name in group["params"]:
            place = zero / name
            place.mkdir(parents=True)
            torch.save({"param": weights[name].float(), "cat_dim": 0}, place / "fp32.pt")
            for key, value in optimizer["state"].get(name, {}).items():
                torch.save(value if key == "step" else {"param": value, "cat_dim": 0},
                           place / f"{key}.pt")
    steps = [entry["step"] for entry in optimizer["state"].values() if "step" in entry]
    groups = optimizer["param_groups"]
    torch.save({**records, "overflow": False, "param_groups": groups,
                # ZeRO-3 reads one step count for all, and its groups' settings, here
                "optimizer_state_dict": {"state": {0: {"step": steps[0]}} if steps else {},
                                         "param_groups": groups}},
               zero / "optimizer_state.pt")


def deepspeed_change_refusal(train_state: dict[str, Any], precision: str,
                             accumulate: int) -> str | None:
    """Why a resume between strategy 'deepspeed' and another cannot be exact, from the
    checkpoint's train state, or None: under fp16 the loss scale lives in DeepSpeed's own
    scaler on one side and torch's on the other; between the micro-steps of an accumulation
    group the gradients accumulated so far do not carry (DeepSpeed saves none).

    Args:
        train_state: the checkpoint's runner state (its ``meta`` says the strategy and step).
        precision: the resuming run's precision.
        accumulate: the resuming run's micro-steps per optimiser step.

    Returns:
        The reason and what to do, in words, or None.
    """
    meta = train_state.get("meta") or {}
    written = meta.get("strategy", "another strategy")
    if precision == "fp16":
        return (f"it was written under strategy {written!r}, and under fp16 the loss scale "
                f"does not carry between DeepSpeed's scaler and torch's: resume it under "
                f"strategy {written!r}, or in bf16 or fp32")
    step = meta.get("iter", 0)
    if accumulate > 1 and step % accumulate:
        return (f"it was written under strategy {written!r} at step {step}, inside an "
                f"accumulation group of {accumulate} micro-steps whose gradients do not carry "
                f"to or from DeepSpeed: resume it under strategy {written!r}, or from a "
                f"checkpoint at a multiple of optim.accumulate")
    return None

"""The checkpoint format 'mmengine': one torch file that MMEngine's ``CheckpointHook`` wrote.

MMEngine (0.10) saves ``{'meta', 'state_dict', 'message_hub', 'optimizer',
'param_schedulers'}``: ``meta`` holds the epochs and iterations done, the seed and
``mmengine_version``; ``state_dict`` the unwrapped model's weights; ``optimizer`` the torch
optimiser's state (an ``AmpOptimWrapper``'s adds ``loss_scaler``). Its ``message_hub`` pickles
MMEngine's log buffers and numpy values, which ``weights_only`` refuses: they are read as inert
`MMEngineObject` placeholders (nothing of MMEngine or numpy is imported or run, and every other
global is refused as for any checkpoint), and trainrun uses none of them.

The train state this format gives is what a resume from it needs: the position from ``meta``
(an MMEngine checkpoint is written at the end of what it counts, so the sampler starts the next
epoch from its beginning, as MMEngine's own resume does), the optimiser's state, the loss
scaler's, and no RNG states, schedulers' states, sampler or hook states (MMEngine saves none
that trainrun can use): random streams go on from the run's seeding, as in MMEngine, and the
run's schedules are put at the checkpoint's iteration.
"""

from __future__ import annotations

import pickletools
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainrun.checkpoint.format import CheckpointFormat
from trainrun.checkpoint.optimizer_state import Groups, saved_groups
from trainrun.checkpoint.safe_load import load_torch_file

# Strings an MMEngine checkpoint's pickle holds: its top-level keys and meta's version field.
MARKERS = frozenset({"meta", "state_dict", "mmengine_version"})
# Globals read as placeholders: MMEngine's and numpy's objects (the message hub's log
# buffers, arrays and scalars), and the getattr that fetches a log buffer's methods.
PLACEHOLDER_MODULES = ("mmengine.", "numpy.")
PLACEHOLDER_NAMES = frozenset({"builtins.getattr"})
# What MMEngine's load_checkpoint strips from the weights' names by default.
WRAPPER_PREFIX = "module."


class MMEngineObject:
    """An object of MMEngine's or numpy's in an MMEngine checkpoint, kept as an inert
    placeholder: it records what it was built from and never runs anything.

    Args:
        args: what the pickle called it with (kept, not interpreted).
    """

    args: tuple[Any, ...] = ()
    state: Any = None

    def __new__(cls, *args: Any) -> MMEngineObject:
        return super().__new__(cls)

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return "MMEngineObject()"


def pickle_strings(path: Path, wanted: frozenset[str]) -> set[str]:
    """Which of ``wanted`` appear as strings in the pickle of the torch file ``path`` (its
    opcodes are walked, nothing is unpickled); empty for a file that is no torch zip file."""
    found: set[str] = set()
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            if name is None:
                return found
            data = archive.read(name)
        for _, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and arg in wanted:
                found.add(arg)
                if found == wanted:
                    break
    except Exception:  # unreadable or damaged: not recognisably MMEngine's (the fallback
        return set()  # format, which reads it, says what is wrong)
    return found


def load_mmengine_file(path: Path, mmap: bool = False) -> dict[str, Any]:
    """An MMEngine checkpoint's content, read with ``weights_only``: MMEngine's and numpy's
    objects become `MMEngineObject` placeholders; any other global is refused as
    `load_torch_file` refuses it.

    Args:
        path: the checkpoint.
        mmap: memory-map its tensors (a look inside that does not read them).

    Returns:
        The checkpoint's top-level dict.

    Raises:
        ValueError: not a readable checkpoint, or not MMEngine's layout.
        pickle.UnpicklingError: it holds a global that is neither a tensor's nor MMEngine's.
    """
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"{path}: not a readable checkpoint: {error}") from None
    placeholders = [(MMEngineObject, name) for name in needed
                    if name.startswith(PLACEHOLDER_MODULES) or name in PLACEHOLDER_NAMES]
    with torch.serialization.safe_globals(placeholders):
        state = load_torch_file(path, mmap=mmap)
    if not (isinstance(state, Mapping) and isinstance(state.get("meta"), Mapping)
            and isinstance(state.get("state_dict"), Mapping)):
        raise ValueError(f"{path}: not an MMEngine checkpoint (no 'meta' and 'state_dict')")
    return dict(state)


def model_weights(path: Path, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The weights in an MMEngine checkpoint's ``state_dict``, by the plain model's names
    (a leading ``module.`` stripped, as MMEngine's loading does).

    Raises:
        ValueError: an entry that is not a tensor.
    """
    weights = {}
    for key, value in state["state_dict"].items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: state_dict[{key!r}] is a {type(value).__name__}, "
                             "not a tensor")
        weights[key.removeprefix(WRAPPER_PREFIX)] = value
    return weights


def optimizer_parts(optimizer: Any) -> tuple[Any, Any]:
    """The torch optimiser state(s) in MMEngine's ``optimizer`` entry, and the matching
    optimiser-wrapper state(s) of trainrun (nothing accumulated; the loss scaler's state
    where an ``AmpOptimWrapper`` saved one). One state, or a dict of them by name for an
    ``OptimWrapperDict``."""
    if optimizer is None:
        return None, None

    def one(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        state = dict(state)
        scaler = state.pop("loss_scaler", None)
        return state, {"micro_steps": 0, "scaler": scaler, "grads": None}

    if "param_groups" in optimizer:
        return one(optimizer)
    pairs = {name: one(state) for name, state in optimizer.items()}
    return ({name: pair[0] for name, pair in pairs.items()},
            {name: pair[1] for name, pair in pairs.items()})


class MMEngineFile(CheckpointFormat):
    """A torch file MMEngine's ``CheckpointHook`` (or ``Runner.save_checkpoint``) wrote,
    read as trainrun's checkpoints are: the weights for ``load_from``, and what a resume
    needs for ``resume`` (see the module's description)."""

    name = "mmengine"

    @classmethod
    def owns(cls, path: Path) -> bool:
        return path.is_file() and pickle_strings(path, MARKERS) == MARKERS

    @classmethod
    def look_inside(cls, path: Path) -> None:
        model_weights(path, load_mmengine_file(path, mmap=True))

    @classmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        state = load_mmengine_file(path)
        meta = state["meta"]
        missing = [key for key in ("epoch", "iter", "seed") if key not in meta]
        if missing:
            raise ValueError(f"{path}: its meta has no {', '.join(missing)}")
        optimizer, optim_wrapper = optimizer_parts(state.get("optimizer"))
        return {"model": model_weights(path, state), "optimizer": optimizer,
                "meta": {"epoch": meta["epoch"], "iter": meta["iter"], "seed": meta["seed"],
                         "mmengine_version": meta.get("mmengine_version")},
                "sampler": None, "optim_wrapper": optim_wrapper, "schedulers": None,
                "rng": None, "hooks": {}}

    @classmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        weights = model_weights(path, load_mmengine_file(path, mmap=True))
        return {key: tuple(value.shape) for key, value in weights.items()}

    @classmethod
    def param_groups(cls, path: Path) -> Groups | None:
        return saved_groups(optimizer_parts(load_mmengine_file(path, mmap=True)
                                            .get("optimizer"))[0])

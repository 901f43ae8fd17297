"""The checkpoint format 'torch_file': one file written with torch.save.

What the strategies whose every rank holds the whole model write (none, ddp, separate_ddp):
rank 0 saves ``{'model': ..., 'optimizer': ..., **train state}``. It is also the fallback
format: any file that no other registered format owns is read as one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainrun.checkpoint.format import CheckpointFormat
from trainrun.checkpoint.optimizer_state import Groups, saved_groups
from trainrun.checkpoint.safe_load import load_mapped, load_torch_file


class TorchFile(CheckpointFormat):
    """One torch file holding model, optimiser and the runner's state, read with
    weights_only (`load_torch_file`)."""

    name = "torch_file"

    @classmethod
    def owns(cls, path: Path) -> bool:
        return path.is_file()

    @classmethod
    def look_inside(cls, path: Path) -> None:
        load_mapped(path)

    @classmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        return load_torch_file(path)

    @classmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        state = load_mapped(path)
        model = state.get("model", state)
        return {key: tuple(value.shape) for key, value in model.items()
                if isinstance(value, torch.Tensor)}

    @classmethod
    def param_groups(cls, path: Path) -> Groups | None:
        if not path.is_file():  # a subclass's own layout (a directory): checked when loaded
            return None
        return saved_groups(load_mapped(path).get("optimizer"))

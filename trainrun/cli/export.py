"""``tools/export.py``: a checkpoint of any strategy as one plain state-dict file for inference.

    python tools/export.py CHECKPOINT OUT [--format safetensors|torch] [--dtype bf16] [--ema]
                           [--force]

CHECKPOINT is a checkpoint file, a sharded (fsdp) or DeepSpeed directory, or a work_dir (its
newest checkpoint). The output holds the model's tensors only, under the plain model's names,
so ``model.load_state_dict(...)`` takes it with no trainrun installed; with ``--ema``, the
EMA hook's average of the weights in place of the trained ones (buffers stay the model's).
The checkpoint is verified against its manifest of hashes first. OUT is written under a
temporary name and renamed, so a failed export never leaves a half-written OUT; it gets the
permissions of any file the user creates (0o666 less the umask). OUT is never part of a
training run's record (its config.yaml, metrics.jsonl, train.log or checkpoints/).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from trainrun.checkpoint.files import replacing
from trainrun.checkpoint.manager import resolve_checkpoint
from trainrun.checkpoint.manifest import verify_checkpoint
from trainrun.checkpoint.read import read_train_state, read_weights
from trainrun.cli import HelpFormatter, epilog, import_from_working_directory, prog
from trainrun.dist.device import DTYPES
from trainrun.exits import EXIT_OK, EXIT_USAGE
from trainrun.runner.hooks.ema import EMAHook
from trainrun.runner.run_dir import run_owning

FORMATS = ("safetensors", "torch")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class ExportError(ValueError):
    """Input that cannot be exported; the message is one line naming what is wrong."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog("export", "export.py"),
        description="Consolidate a checkpoint of any strategy into one plain state-dict file.",
        formatter_class=HelpFormatter,
        epilog=epilog("trainrun export work_dirs/digits_fsdp model.safetensors",
                      "trainrun export work_dirs/digits_ddp/checkpoints/epoch_20.pth model.pt",
                      docs="checkpoints"))
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint, or a run directory (its newest)")
    p.add_argument("out", metavar="OUT", help="the file to write")
    p.add_argument("--format", choices=FORMATS,
                   help="default: torch for .pt .pth .bin, else safetensors")
    p.add_argument("--dtype", choices=tuple(DTYPES),
                   help="cast floating-point tensors (default: as saved)")
    p.add_argument("--ema", action="store_true",
                   help="the EMA hook's average instead of the weights")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return p


def output_format(out: str | os.PathLike, given: str | None) -> str:
    if given is not None:
        return given
    return "torch" if Path(out).suffix in _TORCH_SUFFIXES else "safetensors"


def plain_tensors(state: dict[str, object], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """``state`` as contiguous CPU tensors that own their memory (safetensors refuses shared
    storage, e.g. tied embeddings), floating ones cast to ``dtype`` when given."""
    out: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, value in state.items():
        if not isinstance(value, Tensor):
            raise ExportError(f"entry {name!r} of the model state is a "
                              f"{type(value).__name__}, not a tensor; only tensors export")
        tensor = value.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        storage = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if storage in seen or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()
        seen.add(storage)
        out[name] = tensor
    return out


def ema_weights(source: Path, model: dict[str, Tensor]) -> dict[str, Tensor]:
    """``model`` with its parameters replaced by the average the checkpoint's EMA hook kept."""
    state = (read_train_state(source).get("hooks") or {}).get(EMAHook.__name__) or {}
    average = state.get("weights") if isinstance(state, dict) else None
    if not average:
        raise ExportError(f"--ema: {source} holds no EMA weights (the run that wrote it had "
                          f"no EMA hook)")
    unknown = sorted(set(average) - set(model))
    if unknown:
        raise ExportError(f"--ema: the EMA weight {unknown[0]!r} is not in the model's state")
    return {**model, **average}


def umask() -> int:
    """This process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def write(tensors: dict[str, Tensor], out: Path, fmt: str, metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``out`` durably, never leaving half a file under its name. The
    file gets the permissions of any file the user creates, 0o666 less the umask (safetensors
    creates its files 0o600)."""
    with replacing(out) as tmp:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(tensors, str(tmp), metadata=metadata)
        else:
            torch.save(tensors, tmp)
        os.chmod(tmp, 0o666 & ~umask())


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, fmt: str | None = None,
           dtype: str | None = None, force: bool = False, ema: bool = False) -> dict[str, int]:
    """Write the model state of ``checkpoint`` to ``out``; returns counts for the summary."""
    out = Path(out)
    owner = run_owning(out)
    if owner is not None:
        raise ExportError(f"OUT {out} is part of the record of the training run in "
                          f"{owner.path}, which export never writes; choose another OUT")
    if out.exists() and not force:
        raise ExportError(f"OUT {out} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise ExportError(f"OUT {out}: directory {out.parent} does not exist")
    source = resolve_checkpoint(checkpoint)
    fmt = output_format(out, fmt)
    verify_checkpoint(source, alone=True)  # a damaged one: DamagedCheckpoint, a ValueError
    weights = read_weights(source)
    if ema:
        weights = ema_weights(source, weights)
    tensors = plain_tensors(weights, DTYPES[dtype] if dtype else None)
    if not tensors:
        raise ExportError(f"{source} holds no model tensors")
    write(tensors, out, fmt, {"format": "pt", "source": str(source)})
    return {"tensors": len(tensors),
            "elements": sum(t.numel() for t in tensors.values()),
            "bytes": out.stat().st_size}


def main(argv: Sequence[str] | None = None) -> int:
    """``tools/export.py``: returns the exit code (2: bad input, one line on stderr)."""
    import_from_working_directory()
    command = parser()
    try:
        args = command.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        counts = export(args.checkpoint, args.out, args.format, args.dtype, args.force,
                        args.ema)
    except (ValueError, OSError, pickle.UnpicklingError) as error:
        print(f"{command.prog}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.out} ({output_format(args.out, args.format)}): {counts['tensors']} "
          f"tensors, {counts['elements']:,} values, {counts['bytes'] / 2**20:.1f} MiB")
    return EXIT_OK

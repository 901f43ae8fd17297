"""Reading torch files safely: tensors and plain containers only, never code.

A checkpoint may come from anywhere (a shared directory, a download), and ``torch.load``
without ``weights_only`` runs whatever its pickle asks for. Every read of a checkpoint goes
through `load_torch_file` (or, for a look inside without reading the tensors, `load_mapped`),
which refuses anything else in one line, and names a file whose end is missing as truncated.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainrun.messages import first_line


def load_mapped(file: Path) -> Any:
    """A torch file's contents with its tensors memory-mapped (their data is not read): a cheap
    look inside, with `load_torch_file`'s refusals."""
    return load_torch_file(file, mmap=True)


def load_torch_file(file: str | os.PathLike, mmap: bool = False) -> Any:
    """A torch file's contents on the CPU, refusing anything but tensors and plain containers
    (`refusing_unsafe`); a file whose end is missing is a ValueError naming it as truncated
    (torch says "[Errno 22] Invalid argument", or a page about zip archives)."""
    with refusing_unsafe(file):
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as error:  # torch's failures on a cut file vary
            refuse_truncated(Path(file))
            if not (mmap and isinstance(error, RuntimeError) and "mmap" in str(error)):
                raise
        return torch.load(file, map_location="cpu", weights_only=True)  # an older, non-zip file


def refuse_truncated(file: Path) -> None:
    """A ValueError naming ``file`` as truncated if it begins as a zip archive (what torch
    writes), or as the first bytes of one, but has no end (an empty file included); only its
    first bytes and its end are read."""
    if not file.is_file():
        return
    with open(file, "rb") as f:
        begins = f.read(4)
    if b"PK\x03\x04".startswith(begins) and not zipfile.is_zipfile(file):
        raise ValueError(f"{file} is truncated: a torch file whose end is missing (its write "
                         f"did not finish, or the copy was cut short)")


@contextlib.contextmanager
def refusing_unsafe(path: str | os.PathLike) -> Iterator[None]:
    """Turn torch's page-long weights_only refusal inside the block into one line naming the
    refused global, and a file torch cannot read into a ValueError (bytes that are no pickle
    make torch's unpickler fail in many ways: an IndexError or KeyError from its stack and memo
    as often as an UnpicklingError)."""
    try:
        yield
    except pickle.UnpicklingError as error:
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", str(error))
        if not found:  # not a refusal: bytes that are no pickle at all
            raise ValueError(f"{path}: not a readable checkpoint (torch cannot read it: "
                             "written by something else, or damaged)") from None
        raise pickle.UnpicklingError(f"{path}: refused to load: it holds {found.group(1)}, "
                                     "which a checkpoint never needs (read with weights_only)"
                                     ) from None
    except RuntimeError as error:  # not a torch file, or a truncated one
        raise ValueError(f"{path}: not a readable checkpoint: "
                         f"{first_line(error)}") from None
    except (EOFError, IndexError, KeyError, UnicodeDecodeError, struct.error) as error:
        raise ValueError(f"{path}: not a readable checkpoint (torch cannot read it: "
                         f"written by something else, or damaged; {type(error).__name__})"
                         ) from None

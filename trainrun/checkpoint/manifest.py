"""Content hashes of checkpoints: the manifest written with each one, and checking against it.

A manifest is in ``sha256sum`` format, so ``sha256sum -c`` checks it by hand: inside a
checkpoint directory it is ``SHA256SUMS`` (every other file, by its path in the directory);
beside a one-file checkpoint it is a sidecar, ``epoch_2.pth.sha256``. Its last line, a
comment that ``sha256sum`` skips, holds the hash of the lines above it, so damage to the
manifest itself is told apart from damage to a file it lists.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from trainrun.checkpoint.files import sha256_of, write_atomically, written_sha256
from trainrun.dist import all_gather_object, broadcast_object_list, get_dist_info

MANIFEST = "SHA256SUMS"  # inside a checkpoint directory
SIDECAR = ".sha256"  # beside a one-file checkpoint: its name plus this
_SELF = "# sha256 of the lines above: "
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
_BROKEN = "the manifest itself is damaged"


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match its manifest: ``file`` and how."""

    def __init__(self, checkpoint: Path, file: str, why: str):
        super().__init__(f"{checkpoint} is damaged: {file}: {why}")
        self.checkpoint, self.file, self.why = checkpoint, file, why


def manifest_of(checkpoint: Path) -> Path:
    """Where the manifest of ``checkpoint`` (a directory, or one file) is."""
    return checkpoint / MANIFEST if checkpoint.is_dir() else sidecar(checkpoint)


def sidecar(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + SIDECAR)


def is_sidecar(name: str) -> bool:
    return name.endswith(SIDECAR)


def hash_files(files: Iterable[Path], written: Path, final: Path) -> dict[str, str]:
    """The sha256 of each of ``files`` of the checkpoint written at ``written`` (to be renamed
    ``final``), by the name its manifest lists it under; those this process made durable
    with `fsync_and_hash` were hashed then."""
    return {listed_name(file, written, final): written_sha256(file) for file in files}


def listed_name(file: Path, written: Path, final: Path) -> str:
    """A file's name in the manifest: its path inside a checkpoint directory; the final name
    of a one-file checkpoint."""
    return final.name if file == written else file.relative_to(written).as_posix()


def write_manifest(written: Path, final: Path, hashes: dict[str, str]) -> None:
    """Write the manifest of the checkpoint at ``written`` durably: inside it (a directory,
    published with it by its rename) or beside ``final`` (one file; before its rename)."""
    lines = "".join(f"{hashes[name]}  {name}\n" for name in sorted(hashes))
    text = lines + _SELF + hashlib.sha256(lines.encode()).hexdigest() + "\n"
    write_atomically(written / MANIFEST if written.is_dir() else sidecar(final), text)


def read_manifest(checkpoint: Path) -> dict[str, str] | None:
    """The hashes the manifest of ``checkpoint`` records, by file name, in its order; None
    without a manifest. Raises DamagedCheckpoint naming the manifest if it is damaged."""
    manifest = manifest_of(checkpoint)
    try:
        text = manifest.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None
    except OSError as error:
        raise DamagedCheckpoint(checkpoint, manifest.name, _unreadable(error)) from None
    except UnicodeDecodeError:
        raise DamagedCheckpoint(checkpoint, manifest.name, f"{_BROKEN} (not text)") from None
    lines, _, last = text.rstrip("\n").rpartition("\n")
    lines = lines + "\n" if lines else ""
    if not last.startswith(_SELF) or last[len(_SELF):] != hashlib.sha256(
            lines.encode()).hexdigest():
        raise DamagedCheckpoint(checkpoint, manifest.name, f"{_BROKEN} (its last line, the "
                                "checksum of the lines above it, does not match them)")
    hashes = {}
    for number, line in enumerate(lines.splitlines(), 1):
        found = _LINE.match(line)
        if not found:
            raise DamagedCheckpoint(checkpoint, manifest.name, f"{_BROKEN} (line {number} is "
                                    "not '<sha256>  <file>')")
        hashes[found.group(2)] = found.group(1)
    return hashes


def _unreadable(error: OSError) -> str:
    return f"unreadable ({error.strerror or error})"


def _listed_path(checkpoint: Path, name: str) -> Path:
    return checkpoint / name if checkpoint.is_dir() else checkpoint.with_name(name)


def _first_failure(checkpoint: Path, entries: list[tuple[int, str, str]]
                   ) -> tuple[int, str, str] | None:
    """The first of ``entries`` (index, name, sha256) whose file fails, as (index, name, why)."""
    for index, name, expected in entries:
        try:
            actual = sha256_of(_listed_path(checkpoint, name))
        except FileNotFoundError:
            return index, name, "missing"
        except OSError as error:
            return index, name, _unreadable(error)
        if actual != expected:
            return index, name, f"sha256 mismatch (against {manifest_of(checkpoint).name})"
    return None


def _shares(checkpoint: Path, hashes: dict[str, str], ranks: int
            ) -> list[list[tuple[int, str, str]]] | tuple[int, str, str]:
    """The listed files dealt out to ``ranks`` ranks by size (largest first, each to the rank
    with the fewest bytes so far); or the first listed file that is missing."""
    sized = []
    for index, (name, expected) in enumerate(hashes.items()):
        try:
            size = os.stat(_listed_path(checkpoint, name)).st_size
        except FileNotFoundError:
            return index, name, "missing"
        except OSError as error:
            return index, name, _unreadable(error)
        sized.append((size, index, name, expected))
    shares: list[list[tuple[int, str, str]]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for size, index, name, expected in sorted(sized, key=lambda s: (-s[0], s[1])):
        rank = load.index(min(load))
        shares[rank].append((index, name, expected))
        load[rank] += size
    return shares


def verify_checkpoint(checkpoint: str | os.PathLike, alone: bool = False) -> bool:
    """Check every file the manifest of ``checkpoint`` lists: present, and its sha256 the one
    recorded. True: intact; False: it has no manifest (written before checkpoints were
    hashed), so it cannot be verified. Raises DamagedCheckpoint naming the first file that
    fails. In a process group every rank must call this: each hashes a share of the files and
    all get the same answer; ``alone``: this process hashes them all, with no collective."""
    checkpoint = Path(checkpoint)
    rank, ranks = (0, 1) if alone else get_dist_info()
    plan: list = [None]
    if rank == 0:
        try:
            hashes = read_manifest(checkpoint)
            plan[0] = None if hashes is None else _shares(checkpoint, hashes, ranks)
        except DamagedCheckpoint as error:
            plan[0] = (-1, error.file, error.why)
    if not alone:
        broadcast_object_list(plan)
    if plan[0] is None:
        return False
    if isinstance(plan[0], tuple):
        raise DamagedCheckpoint(checkpoint, plan[0][1], plan[0][2])
    failure = _first_failure(checkpoint, plan[0][rank])
    failures = [failure] if alone else all_gather_object(failure)
    failures = [f for f in failures if f is not None]
    if failures:
        _, name, why = min(failures)
        raise DamagedCheckpoint(checkpoint, name, why)
    return True

"""Config inheritance: a file names the files it builds on with ``_base_``.

``_base_: path`` or ``_base_: [path, ...]`` at the top level of a file (each path relative to
the file that names it; a base may have bases of its own). The files are merged with
OmegaConf in depth-first order, every file after its own bases and a list's bases in the
order given, the later file's keys winning: mappings merge key by key, anything else
replaces. A base that two files share is merged once, where it is first reached (so one
base's value cannot come back over the file that changed it). A mapping that carries
``_delete_: true`` replaces what the files before it gave under its key instead of merging
into it (MMEngine's convention); a list over a mapping, or a mapping over a list, replaces
it too. Neither key is left in the result, and interpolations stay unresolved here: they
resolve across the merged config.

Errors are `ConfigError`, one line: a base that is missing, is no mapping, holds bad YAML or
closes a cycle names the chain of files that led to it (``_base_: a.yaml -> b.yaml -> a.yaml``);
a bad ``_base_`` or ``_delete_`` value names the file and the key.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainrun.runner.schema import ConfigError, bad_value, join

BASE = "_base_"
DELETE = "_delete_"
MARKERS = (BASE, DELETE)

# Reads one file: (path, the name its errors go under) -> its mapping, or ConfigError.
Reader = Callable[[Path, str], DictConfig]


def read_with_bases(path: str | os.PathLike[str], read: Reader) -> DictConfig:
    """The config at ``path`` merged over its bases (and theirs), unresolved."""
    merged: dict[Any, Any] = {}
    for shown, content in _in_merge_order(Path(path), read):
        merged = _merge(merged, content, shown)
    return OmegaConf.create(merged)


def _in_merge_order(path: Path, read: Reader) -> list[tuple[str, dict[Any, Any]]]:
    """(name, plain content without ``_base_``) of every file, each after its bases."""
    order: list[tuple[str, dict[Any, Any]]] = []
    done: set[Path] = set()

    def visit(file: Path, chain: list[tuple[Path, str]]) -> None:
        shown = chain[-1][1]
        names = " -> ".join(name for _, name in chain)
        if len(chain) == 1:
            cfg = read(file, shown)
        elif not file.is_file():
            raise ConfigError(f"{BASE}: {names}: base config not found")
        else:
            cfg = read(file, f"{BASE}: {names}")
        content: dict[Any, Any] = OmegaConf.to_container(cfg, resolve=False)  # type: ignore
        for base in _base_paths(content.pop(BASE, []), shown):
            base_file = file.parent / Path(base).expanduser()
            key = base_file.resolve()
            base_shown = os.path.normpath(os.path.join(os.path.dirname(shown), base))
            if any(key == seen for seen, _ in chain):
                raise ConfigError(f"{BASE}: cycle: {names} -> {base_shown}")
            if key not in done:
                visit(base_file, [*chain, (key, base_shown)])
        done.add(chain[-1][0])
        order.append((shown, content))

    visit(path, [(path.resolve(), str(path))])
    return order


def _base_paths(value: Any, shown: str) -> list[str]:
    """``_base_``'s paths: a non-empty string, or a list of them."""
    paths = value if isinstance(value, list) else [value]
    for index, path in enumerate(paths):
        if not isinstance(path, str) or not path.strip():
            key = f"{BASE}[{index}]" if isinstance(value, list) else BASE
            raise bad_value(f"{shown}: {key}", path,
                            "a path (relative to this file) or a list of paths")
    return paths


def _merge(merged: dict[Any, Any], content: dict[Any, Any], shown: str) -> dict[Any, Any]:
    """``content`` (the file ``shown``) merged over ``merged`` (the files before it)."""
    if DELETE in content:
        raise ConfigError(f"{shown}: {DELETE} at the top level: it goes inside a section, "
                          f"whose inherited value it replaces")
    _replaced(merged, content, shown, "")
    try:
        out = OmegaConf.merge(merged, content)
    except (OmegaConfBaseException, TypeError, ValueError) as error:
        raise ConfigError(f"{shown}: cannot be merged over its bases: {error}") from None
    return OmegaConf.to_container(out, resolve=False)  # type: ignore[return-value]


def _replaced(earlier: Any, later: Any, shown: str, key: str) -> bool:
    """Whether ``later`` replaces ``earlier`` rather than merging into it. Strips (and checks)
    ``later``'s ``_delete_`` markers, at any depth, and removes from ``earlier`` what they
    replace."""
    if isinstance(later, list):
        for index, item in enumerate(later):
            _replaced(None, item, shown, f"{key}[{index}]")
        return isinstance(earlier, dict)
    if not isinstance(later, dict):
        return False  # OmegaConf's merge replaces it
    if key and BASE in later:
        raise ConfigError(f"{shown}: {join(key, BASE)}: {BASE} is read only at the top "
                          f"level of a file")
    replace = later.pop(DELETE, False)
    if not isinstance(replace, bool):
        raise bad_value(f"{shown}: {join(key, DELETE)}", replace, "true or false")
    replace = replace or isinstance(earlier, list)
    below = earlier if isinstance(earlier, dict) and not replace else {}
    for name, value in later.items():
        if _replaced(below.get(name), value, shown, join(key, name)) and name in below:
            del below[name]
    return replace

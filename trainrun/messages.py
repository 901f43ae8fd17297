"""Small helpers for one-line messages, shared by the layers above ``dist/`` (the config
checks, the reports of the command lines, the checkpoint readers): type tests and message
parts. A leaf module: it imports nothing of trainrun."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any


def is_int(value: Any) -> bool:
    """An int that is not a bool (YAML's true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def show(value: Any) -> str:
    """A value as a message shows it, in YAML's words for null and booleans."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def closest(word: str, known: Iterable[str], aliases: Mapping[str, str] | None = None,
            cutoff: float = 0.6) -> str | None:
    """The known name closest to ``word`` ignoring case (at least ``cutoff`` alike), else the
    one a close alias names: what a "did you mean" offers."""
    known = [k for k in known if isinstance(k, str)]
    lowered = {k.lower(): k for k in known}
    found = difflib.get_close_matches(str(word).lower(), list(lowered), n=1, cutoff=cutoff)
    if found:
        return lowered[found[0]]
    aliases = aliases or {}
    alias = difflib.get_close_matches(str(word).lower(), list(aliases), n=1, cutoff=0.75)
    return aliases[alias[0]] if alias and aliases[alias[0]] in known else None


def first_line(error: object) -> str:
    """An error's message (or any text), its first line only: what a one-line report shows."""
    return (str(error).strip().splitlines() or [""])[0]


def error_line(error: object) -> str:
    """A refusal as the command lines print it: ``error:`` and the message, its lines joined
    into one."""
    return "error: " + " ".join(str(error).split("\n"))


def human(nbytes: float) -> str:
    """Bytes in binary units: '512 B', '3.0 KiB', '1.6 GiB'."""
    for unit, power in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(nbytes) >= 2 ** power:
            return f"{nbytes / 2 ** power:.1f} {unit}"
    return f"{int(nbytes)} B"

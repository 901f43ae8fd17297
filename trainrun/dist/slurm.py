"""Reading SLURM's compressed host and task lists without calling ``scontrol``."""

from __future__ import annotations

import re


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM host list {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM host list {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(spec: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'], keeping zero padding."""
    out = []
    for item in spec.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {item!r} in SLURM host list")
            width = len(lo)
            out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
        elif item.isdigit():
            out.append(item)
        else:
            raise ValueError(f"bad range item {item!r} in SLURM host list")
    return out


def _expand_host(pattern: str) -> list[str]:
    """Expand every bracket of one host pattern: 'a[1-2]-ib' -> ['a1-ib', 'a2-ib']."""
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [head + n + rest for n in _expand_range(match.group(1)) for rest in _expand_host(tail)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list, as ``srun`` gives it, into host names.

    ``'gpu[01-02,07],cpu3'`` becomes ``['gpu01', 'gpu02', 'gpu07', 'cpu3']``: zero padding
    is kept, and every bracket of a host name is expanded. No ``scontrol`` is needed.

    Args:
        nodelist: a node list as SLURM writes it (e.g. ``SLURM_NODELIST``).

    Returns:
        The host names, in the list's order.

    Raises:
        ValueError: when the list is empty, its brackets are unbalanced, or a range is not
            numbers or runs backwards.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("SLURM node list is empty")
    return [host for part in _split_top_level(nodelist) for host in _expand_host(part)]


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(f"cannot read SLURM tasks per node {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts

"""Walking a process tree through /proc (Linux): the tools that stop jobs, and the tests that
kill them by pid, find a launcher's workers this way, because torchrun starts each worker in a
session of its own, so a process group would miss them."""

from __future__ import annotations

from pathlib import Path


def parent_pids() -> dict[int, int]:
    """Every process's parent, read from /proc (Linux)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            after_name = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(after_name[1])
    return parents


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process below it. torchrun starts its workers in sessions of their
    own, so the tree is followed through parent pids, not through a process group."""
    parents = parent_pids()
    tree = {pid}
    while True:
        below = {child for child, parent in parents.items() if parent in tree} - tree
        if not below:
            return tree
        tree |= below


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    return process_tree(pid) - {pid}

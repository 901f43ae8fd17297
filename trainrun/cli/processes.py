"""Walking a process tree: the tools that stop jobs, and the tests that kill them by pid, find a
launcher's workers this way. torchrun starts each worker in a session of its own, so a process
group would miss them; the tree is followed through parent pids (psutil reads them)."""

from __future__ import annotations

import psutil


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process below it (just ``pid`` once it has ended)."""
    try:
        return {pid} | {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {pid}


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    return process_tree(pid) - {pid}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a process that ended, reaped or not (a zombie), does not."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False

"""Fixtures shared by every test: running a body on the ranks of a real gloo group, a local
SLURM, an environment without any launcher's variables, and (from tests/runs.py) the runs the
tests train once and share."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests import slurm_cluster
from tests.cli import env, is_launcher_variable, use_env
from tests.procs import DistPool

pytest_plugins = ["tests.runs"]  # the shared runs' fixtures, and the hook that groups them

WORLD_SIZES = (1, 2, 3)  # 1: a plain process that never joined a group


def pytest_configure(config: pytest.Config) -> None:
    """Write the caches that packages write on their first import, once, before the xdist
    workers start. yapf (imported by MMEngine's config) writes its grammar under ~/.cache
    without a lock: on a fresh machine a worker read it half-written from the other one and
    could not collect tests/compat (EOFError, CI of 2026-11-28)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller has done it
        return
    try:
        import yapf  # noqa: F401
    except ImportError:  # MMEngine's tests skip themselves without it
        pass


@pytest.fixture(scope="session")
def dist_pools() -> Iterator[dict[int, DistPool]]:
    pools = {n: DistPool(n) for n in WORLD_SIZES if n > 1}
    yield pools
    for pool in pools.values():
        pool.close()


RunOnRanks = Callable[..., list[Any]]


@pytest.fixture(scope="session")
def run_on(dist_pools: dict[int, DistPool]) -> Callable[[int], RunOnRanks]:
    """``run_on(n)(body, *args)``: run ``body`` on n ranks (n=1: here, with no group)."""

    def runner(world_size: int) -> RunOnRanks:
        if world_size == 1:
            return lambda body, *args, **_: [body(*args)]
        return dist_pools.setdefault(world_size, DistPool(world_size)).run

    return runner


@pytest.fixture(params=WORLD_SIZES, ids=lambda n: "nodist" if n == 1 else f"{n}ranks")
def world_size(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def on_ranks(run_on: Callable[[int], RunOnRanks], world_size: int) -> RunOnRanks:
    """Run a body in a plain process, then on 2 and on 3 gloo ranks (one test each)."""
    return run_on(world_size)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.SlurmCluster]:
    """A real one-node SLURM, started once per session (skips, saying why, where it cannot)."""
    yield from slurm_cluster.session_cluster(tmp_path_factory)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher's variables in this process (a tool run in process must not think a
    launcher started it), whatever started pytest."""
    for name in list(os.environ):
        if is_launcher_variable(name):
            monkeypatch.delenv(name)


@pytest.fixture
def child_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool run in process, its runs started with the command-line tests' environment
    (``tests.cli.env``: the test models importable, one thread a process); saves the tool's
    own start-up."""
    use_env(monkeypatch, env())


"""``trainrun test`` (``tools/test.py``): test a checkpoint on the config's test data."""

from __future__ import annotations

from collections.abc import Sequence

from trainrun.cli.train import command, prepare_test


def main(argv: Sequence[str] | None = None) -> int:
    """``trainrun test``: returns the exit code."""
    return command(prepare_test, argv, "test")

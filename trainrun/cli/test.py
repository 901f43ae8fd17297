"""``trainrun test`` (``tools/test.py``): test a checkpoint on the config's test data.

The test is a job of its own with a directory of its own, ``WORK_DIR/test/<checkpoint name>``
(or ``--out DIR``): its resolved ``config.yaml``, its ``test.log`` and ``scores.json`` (the
checkpoint, the data section, each metric's value and the time). The training run's record
(its ``config.yaml``, ``metrics.jsonl``, ``train.log`` and checkpoints) is never written.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainrun.cli.train import command, prepare_test


def main(argv: Sequence[str] | None = None) -> int:
    """``trainrun test``: returns the exit code."""
    return command(prepare_test, argv, "test")

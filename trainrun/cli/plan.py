"""``trainrun plan CONFIG ...``: ``trainrun train CONFIG ... --dry-run``, the plan of the run
(``trainrun.runner.plan``) without running it; nothing is initialised and nothing is written.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from trainrun.cli import train


def main(argv: Sequence[str] | None = None) -> int:
    """``trainrun plan``: the plan of ``trainrun train`` with the same arguments; returns the
    exit code (2 for a config the run would refuse)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return train.main(args if "--dry-run" in args else [*args, "--dry-run"], command_name="plan")

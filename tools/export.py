"""Consolidate a checkpoint of any strategy into one plain state-dict file: ``trainrun
export`` (``--help``; docs/checkpoints.md).

    python tools/export.py CHECKPOINT OUT [--format safetensors|torch] [--dtype bf16] [--ema]
                           [--force]
"""

import sys

from trainrun.cli.export import main

if __name__ == "__main__":
    sys.exit(main())

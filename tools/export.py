"""Consolidate a checkpoint of any strategy into one plain state-dict file (see
`trainrun.cli.export` and the README).

    python tools/export.py CHECKPOINT OUT [--format safetensors|torch] [--dtype bf16] [--force]
"""

import sys

from trainrun.cli.export import main

if __name__ == "__main__":
    sys.exit(main())

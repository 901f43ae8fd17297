"""Test a checkpoint on the config's test data (``trainrun test``; docs/cli.md).

    python tools/test.py CONFIG CHECKPOINT [--launcher ...] [--cfg-options ...] [--work-dir DIR]
"""

import sys

from trainrun.cli.test import main

if __name__ == "__main__":
    sys.exit(main())

"""Test a checkpoint on the config's test data (see `trainrun.runner.cli` and the README).

    python tools/test.py CONFIG CHECKPOINT [--launcher ...] [--cfg-options ...] [--work-dir DIR]
"""

import sys

from trainrun.runner.cli import test_main

if __name__ == "__main__":
    sys.exit(test_main())

"""Train from a YAML config (see `trainrun.cli.train` and the README).

    python tools/train.py CONFIG [--launcher {none,pytorch,slurm,mpi}] [--work-dir DIR]
                          [--resume [CKPT]] [--cfg-options key=value ...] [--amp] [--dry-run]
"""

import sys

from trainrun.cli.train import main

if __name__ == "__main__":
    sys.exit(main())

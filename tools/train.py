"""Train from a YAML config: ``trainrun train`` (``--help``; docs/cli.md).

    python tools/train.py CONFIG [--launcher {none,pytorch,slurm,mpi}] [--work-dir DIR]
                          [--resume [CKPT]] [--force] [--cfg-options key=value ...] [--amp]
                          [--nproc N] [--dry-run [--world-size N]]
"""

import sys

from trainrun.cli.train import main

if __name__ == "__main__":
    sys.exit(main())

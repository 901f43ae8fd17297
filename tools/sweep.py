"""Train every point of a hyper-parameter grid and summarise them (``trainrun
sweep``; docs/sweeps.md).

    python tools/sweep.py CONFIG --grid optim.lr=1e-3,3e-3 model.hidden=64,128
                          [--cfg-options key=value ...] [--work-dir DIR] [--nproc N]
                          [--launcher {local,slurm}] [--sbatch-args '...'] [--wait]
                          [--summary-only] [--dry-run]
"""

import sys

from trainrun.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())

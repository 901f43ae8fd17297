"""``python -m trainrun.cli.sweep SWEEP_DIR INDEX``: a task of the sweep's SLURM job array
(`trainrun.cli.sweep.slurm.task_main`); the sweep itself is ``trainrun sweep``."""

import sys

from trainrun.cli.sweep.slurm import task_main

if __name__ == "__main__":
    sys.exit(task_main(sys.argv[1:]))

"""Check that a config resumes bit for bit: S steps straight against S/2 + SIGKILL + --resume
to S (``trainrun verify-resume``; docs/checkpoints.md).

    python tools/verify_resume.py CONFIG [--nproc N] [--steps S] [--cfg-options KEY=VALUE ...]
                                  [--work-dir DIR] [--keep]
"""

import sys

from trainrun.cli.verify_resume import main

if __name__ == "__main__":
    sys.exit(main())

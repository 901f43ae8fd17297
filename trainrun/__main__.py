"""``python -m trainrun SUBCOMMAND ...``: the same as the ``trainrun`` console script."""

import sys

from trainrun.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Where a run's messages go when train.log cannot be written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainrun.runner.logging import setup_logging


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full (not Linux)")
def test_a_full_disk_is_one_line_and_the_console_keeps_every_record(capfd):
    logger = setup_logging(log_file=Path("/dev/full"))  # every write: ENOSPC, as a full disk
    try:
        for step in range(3):
            logger.info("step %d", step)
    finally:
        setup_logging()  # let go of /dev/full
    err = capfd.readouterr().err
    assert "--- Logging error ---" not in err and "Traceback" not in err, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: cannot write /dev/full: [Errno 28] No space left on device; "
                        "its records go to the console only from now on"], err
    assert [line.split(" INFO ")[1] for line in err.splitlines() if " INFO " in line] == \
        ["step 0", "step 1", "step 2"]

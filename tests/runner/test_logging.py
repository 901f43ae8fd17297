"""Where a run's messages go when train.log cannot be written."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from trainrun.runner.logging import LogFile, setup_logging


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


class FullDisk:
    """A stream on a full disk: every write and flush raises ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    flush = write

    def close(self):
        pass


def test_a_log_file_whose_stream_raises_enospc_says_one_line(tmp_path, capsys):
    handler = LogFile(tmp_path / "train.log", encoding="utf-8")
    handler.stream.close()
    handler.stream = FullDisk()
    logger = logging.getLogger("tests.full_disk")
    logger.addHandler(handler)
    try:
        for step in range(3):
            logger.warning("step %d", step)
    finally:
        logger.removeHandler(handler)
        handler.close()
    err = capsys.readouterr().err
    assert err.splitlines() == [f"warning: cannot write {tmp_path / 'train.log'}: [Errno 28] "
                                f"No space left on device; its records go to the console only "
                                f"from now on"], err

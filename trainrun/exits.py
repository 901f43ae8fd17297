"""The exit codes of trainrun's processes: the command lines, sweep and verify_resume read
and return them. A leaf module, so that every layer above ``dist/`` can import it (``dist/``
imports nothing else of trainrun; its heartbeat writes EXIT_FAILED out as RANK_LOST_EXIT)."""

EXIT_OK = 0
EXIT_FAILED = 1  # a failure while running (also a rank stopped because its job was lost)
EXIT_USAGE = 2  # a bad config or command line, said in one line; nothing was written
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped on request after a checkpoint; resume
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

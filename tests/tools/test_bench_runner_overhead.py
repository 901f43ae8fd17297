"""bench/runner_overhead.py, briefly, on 2 real gloo ranks: its loss check and the breakdown
of what the runner adds a step still run (the timed figures themselves are not judged here:
they are the bench's to print, not a unit test's to assert)."""

from __future__ import annotations

import re
import sys

from tests.cli import REPO, run
from trainrun.dist.launch import free_port

BENCH = REPO / "bench" / "runner_overhead.py"


def test_the_bench_checks_losses_and_breaks_the_overhead_down():
    done = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), str(BENCH), "--no-mmengine", "--rounds", "1",
                "--epochs", "2", "--check-epochs", "1", "--hidden", "32", "--layers", "1",
                "--batch-size", "32"], timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "bit-for-bit equal to the raw loop's (every step logged): yes" in out
    assert "timed runs: runner's logged losses equal the raw loop's at every logged step: yes" \
        in out
    assert re.search(r"runner overhead in microseconds a step: -?\d+\.\d", out)
    interval = re.search(r"runner overhead vs raw PyTorch DDP: (\d\.\d+) \(95% bootstrap "
                         r"interval over rounds (\d\.\d+) to (\d\.\d+)\)", out)
    assert interval, out
    low, ratio, high = (float(interval.group(i)) for i in (2, 1, 3))
    assert low <= ratio <= high, out  # one round: all three are that round's ratio
    # each rank's training-thread CPU a step, and the runner's over the raw loop's
    cpu = re.search(r"^  runner +(\d+\.\d) +(\d+\.\d) +\( *([+-]\d+\.\d) +([+-]\d+\.\d)\)$",
                    out, re.MULTILINE)
    assert cpu and float(cpu.group(1)) > 0 and float(cpu.group(2)) > 0, out
    rows = dict(re.findall(r"^  (\S.*?)\s+(-?\d+\.\d)  ", out, re.MULTILINE))
    for piece in ("hook IterTimerHook", "logger: the logged numbers sent to rank 0",
                  "preemption check", "less the raw loop's logged steps (all_reduce, lines)",
                  "timed in all, net"):
        assert piece in rows, out
    records = re.search(r"phase tracking \((\d+) records\)", out)
    # a step records its number, data loading, hooks, the train step, forward, backward and
    # the optimiser step, and its number again once trained; the logged steps and the
    # preemption checks add a few
    assert records and 8 <= int(records.group(1)) <= 10, out

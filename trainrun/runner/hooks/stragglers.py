"""Naming the rank every other rank waits for.

In synchronous data parallelism each step lasts as long as its slowest rank's work: the others
wait for it in the gradient collectives. So the rank that waits least is the one the others
wait for, and a straggler shows twice: its own phase (data loading or compute) is longer than
the other ranks', and the other ranks' wait in communication is longer than its own by about
as much. The logger hands `StragglerWatch` every rank's phase times of each logged interval
(`trainrun.runner.hooks.timer.PHASES`, each rank's means since the last logged line); rank 0
logs a warning once the same rank stood out in the same phase on `LINES` lines in a row,
over `STEPS` steps at least (a one-off pause, the first step's set-up, is not a straggler).

A rank stands out in a phase when its time there is at least `RATIO` times the median of the
other ranks' and longer by at least `SHARE` of the iteration and by at least `FLOOR` seconds
(``logging.straggler_floor``): what the straggler costs every step, so that the differences
of a healthy small run (a few milliseconds, which are many times each other on a CPU) never
count. Data
loading and compute are looked at first (the rank the others wait for); communication only
where no rank's own work stands out, and where the rank's long wait is not made up by own
work shorter than the others' (a rank that waits for a straggler is not one).

A slow link to one node slows the collectives of every rank alike (measured: a
rate-limited link between two nodes of two ranks each, every rank's wait grew the same), so
it shows in every rank's ``comm_time``, not in one rank's. What tells that node's ranks apart
is the heartbeat's round trip to the job's store (`trainrun.dist.heartbeat.store_round_trip`):
where no rank's phase stands out, a rank whose round trip is at least `RATIO` times the
other ranks' median and longer by `LINK_FLOOR` at least is named in communication, as on a
slow link (to the store's host: with two nodes, the link between them).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from trainrun.runner.hooks.timer import PHASES

RATIO = 1.5  # a straggler's phase time, at least, against the median of the other ranks'
SHARE = 0.1  # and longer by at least this share of the iteration's time
FLOOR = 0.01  # and by at least this many seconds an iteration (logging.straggler_floor)
LINES = 2  # the same straggler on this many logged lines in a row, at least
STEPS = 10  # and over this many steps, at least, before it is named
LINK_FLOOR = 0.02  # seconds a slow link's store round trip is longer than the others', at least
LINK = len(PHASES)  # the phase index `standout` gives a slow link (named in communication)
TRIP = len(PHASES) + 1  # where an `Interval` holds the store's round trip
# the phases as a log line names them
PHASE_NAMES = {"data": "data loading", "compute": "compute", "comm": "communication"}

# one rank's phase times of one logged interval: the mean seconds an iteration of each of
# PHASES, then the iterations, then its heartbeat's round trip to the store (seconds)
Interval = Sequence[float]


def standout(ranks: Sequence[Interval], floor: float = FLOOR
             ) -> tuple[int, int, float, float] | None:
    """The rank that stands out in one interval, if one does.

    Args:
        ranks: every rank's `Interval`, in rank order.
        floor: the seconds an iteration a rank's phase must be longer than the other ranks'
            median, at least, to stand out (besides `SHARE` of the iteration).

    Returns:
        ``(rank, phase, seconds, median)``: the rank, the index of its phase in ``PHASES``,
        its mean seconds an iteration there, and the median of the other ranks'; or None.
        For a slow link, the phase is `LINK` and the seconds are the store's round trips.
    """
    if len(ranks) < 2:
        return None
    least = max(SHARE * statistics.median(sum(rank[:len(PHASES)]) for rank in ranks), floor)
    found = None
    for phase in (0, 1):  # data, compute: the rank the others wait for
        candidate = _above_others(ranks, phase, least)
        if candidate is not None and (found is None or
                                      candidate[2] - candidate[3] > found[2] - found[3]):
            found = candidate
    if found is not None:
        return found
    candidate = _above_others(ranks, 2, least)
    if candidate is not None:
        rank, _, seconds, median = candidate
        own = [interval[0] + interval[1] for interval in ranks]
        shorter = statistics.median(own[:rank] + own[rank + 1:]) - own[rank]
        return None if shorter > (seconds - median) / 2 else candidate
    return _slow_link(ranks)


def _slow_link(ranks: Sequence[Interval]) -> tuple[int, int, float, float] | None:
    if any(len(interval) <= TRIP for interval in ranks):
        return None
    found = _slowest([interval[TRIP] for interval in ranks], LINK_FLOOR)
    return None if found is None else (found[0], LINK, *found[1:])


def _above_others(ranks: Sequence[Interval], phase: int, least: float
                  ) -> tuple[int, int, float, float] | None:
    found = _slowest([interval[phase] for interval in ranks], least)
    return None if found is None else (found[0], phase, *found[1:])


def _slowest(values: Sequence[float], floor: float) -> tuple[int, float, float] | None:
    """The rank with the largest of ``values`` where it is at least `RATIO` times the median
    of the other ranks' and longer by ``floor`` at least: ``(rank, value, median)``; else
    None."""
    rank = max(range(len(values)), key=values.__getitem__)
    median = statistics.median([*values[:rank], *values[rank + 1:]])
    if values[rank] >= RATIO * median and values[rank] - median >= floor:
        return rank, values[rank], median
    return None


class StragglerWatch:
    """Rank 0's view of the stragglers, line after line; see the module's docstring.

    Args:
        hosts: each rank's host name, in rank order.
        floor: the seconds an iteration a straggler costs, at least (`standout`'s ``floor``).
    """

    def __init__(self, hosts: Sequence[str], floor: float = FLOOR):
        self.hosts = list(hosts)
        self.floor = floor
        self.named: tuple[int, int] | None = None  # (rank, phase) of the last warning
        self._streak: tuple[int, int] | None = None  # (rank, phase) standing out lately
        self._lines = self._steps = 0  # on how many lines in a row, over how many steps
        self._clear_lines = self._clear_steps = 0  # lines without the named one, in a row

    def update(self, ranks: Sequence[Interval]) -> list[tuple[str, str]]:
        """Take one logged line's intervals; what to log about them.

        Args:
            ranks: every rank's `Interval` since the previous logged line, in rank order.

        Returns:
            ``(level, message)`` pairs (``'warning'`` or ``'info'``): a straggler named, or
            the one named before gone; usually none.
        """
        if len(ranks) != len(self.hosts):
            return []
        steps = int(min(rank[len(PHASES)] for rank in ranks))
        if not steps:
            return []
        found = standout(ranks, self.floor)
        key = None if found is None else found[:2]
        if key is not None and key == self._streak:
            self._lines, self._steps = self._lines + 1, self._steps + steps
        else:
            self._streak, self._lines, self._steps = key, 1, steps
        out: list[tuple[str, str]] = []
        if self.named is not None:
            if key == self.named:
                self._clear_lines = self._clear_steps = 0
            else:
                self._clear_lines, self._clear_steps = (self._clear_lines + 1,
                                                        self._clear_steps + steps)
                if self._clear_lines >= LINES and self._clear_steps >= STEPS:
                    rank, phase = self.named
                    name = PHASE_NAMES[PHASES[min(phase, LINK - 1)]]
                    out.append(("info", f"rank {rank} (host {self.hosts[rank]}) no longer "
                                        f"holds the others up in {name}"))
                    self.named = None
        if found is not None and key != self.named and self._lines >= LINES \
                and self._steps >= STEPS:
            self.named = key
            self._clear_lines = self._clear_steps = 0
            out.append(("warning", self.message(found)))
        return out

    def message(self, found: tuple[int, int, float, float]) -> str:
        """The warning line naming a straggler (`standout`'s answer)."""
        rank, phase, seconds, median = found
        times = f"{seconds / median:.1f} times" if median > 0 else "far above"
        if phase == LINK:
            return (f"straggler: rank {rank} (host {self.hosts[rank]}) is the slowest in "
                    f"communication for the last {self._steps} steps: its round trip to the "
                    f"job's store takes {times} the median of the other ranks' ({seconds:.4f} "
                    f"s against {median:.4f} s), as on a slow link to its node, which every "
                    f"rank's collectives wait on (comm_time in metrics.jsonl)")
        name = PHASES[phase]
        effect = "its collectives take longer than theirs" if name == "comm" \
            else "the other ranks wait for it"
        return (f"straggler: rank {rank} (host {self.hosts[rank]}) is the slowest in "
                f"{PHASE_NAMES[name]} for the last {self._steps} steps: {times} the median of "
                f"the other ranks ({seconds:.4f} s against {median:.4f} s an iteration); "
                f"{effect} ({name}_time_max_rank in metrics.jsonl)")

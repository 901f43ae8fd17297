"""Which ranks are alive, and where each one is: a heartbeat through the rendezvous store.

While ``watch_ranks`` is active, a thread in every rank writes the rank's place (its step and
phase: forward, backward, a collective's name, checkpoint save, ...) to the job's store about
once a second, and watches the rank before it in the ring, so the store serves three small
requests per rank per second whatever the job's size. When that rank has been silent for
the collective timeout, or when some rank posts a failure, the thread ends its own process
with one message naming who stopped and where every rank was. No rank then waits in a
collective that cannot finish, whatever the backend does with its own timeout.

A second thread, which never touches the store (a store call can block for good when the
store's host froze or the network to it is cut), ends the rank when it has lost the job: its
launcher died (torchrun, srun or mpirun; a worker of a dead launcher would otherwise train
on and write into a run directory a requeued job may be using), the store refuses or resets
connections (its host died), or the store has not answered for the collective timeout (its
host froze, or this node is cut off). Each rank then says in one line, on stderr only, what
was lost since the newest checkpoint. A store that does not answer blocks torchrun's agent
too (for minutes, in a rendezvous store call, with its exited workers unreaped), so a rank
that stops for that ends the agent that started it as well (``end_agent``).

The main thread only records its place (``at_step``, ``phase``, ``at_checkpoint``:
attribute writes, no I/O).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as torch_dist

log = logging.getLogger("trainrun")

# The exit code of a rank this module stops because its job is lost: trainrun.exits'
# EXIT_FAILED, written out because dist/ imports nothing else of trainrun.
RANK_LOST_EXIT = 1


# torch's message for an error it raises again from another process (a DataLoader worker's):
# "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback ...", the error's own
# line last
_RAISED_AGAIN = re.compile(r"^Caught \w+ (in [^\n]*?)\.?\nOriginal Traceback")


def one_line(error: object) -> str:
    """An error's message, its first line only: what a one-line report shows. For an error
    torch raised again from a DataLoader worker, the worker's own message, and where."""
    text = str(error).strip()
    lines = text.splitlines() or [""]
    again = _RAISED_AGAIN.match(text)
    if again and ": " in lines[-1]:
        return f"{lines[-1].split(': ', 1)[1]} ({again.group(1)})"
    return lines[0]

# ---------------------------------------------------------------- this rank's place

class _Place:
    """Where the main thread is; written by it, read by the heartbeat threads."""

    step: int | None = None
    done: int | None = None  # steps finished (the step's hooks run after it is)
    phase: str = "setup"
    checkpoint: tuple[str, int] | None = None  # the newest checkpoint's name and step
    # the seconds the heartbeat's last writes to the store took (see `store_round_trip`)
    round_trips: deque[float] = deque(maxlen=3)


_place = _Place()


def store_round_trip() -> float:
    """The seconds this rank's heartbeat takes to write its beat to the job's store (one
    request and its answer): the median of its last three beats (about one a second), so
    that one slow write counts for nothing; 0.0 before its second beat.

    A node whose link to the store's host is slow answers slowly here, while its ranks'
    collectives, which wait on that link too, look no slower than every other rank's.

    Returns:
        Seconds.
    """
    trips = sorted(_place.round_trips)
    return trips[(len(trips) - 1) // 2] if len(trips) > 1 else 0.0


def at_step(step: int | None, done: int | None = None) -> None:
    """Record the training step this rank is in, and how many steps it has finished.

    An attribute write, no I/O: the heartbeat reports it, and a rank that stops says what it
    loses from it.

    Args:
        step: the step this rank is in; None: not in a step.
        done: how many steps it has finished; None: ``step - 1`` (pass ``step`` itself once
            its training step is over and its hooks run).
    """
    _place.step = step
    _place.done = done if done is not None or step is None else step - 1


def at_checkpoint(name: str | None, step: int = 0) -> None:
    """Record the checkpoint a restart of this run would continue from.

    Args:
        name: the checkpoint's name; None: there is none yet.
        step: how many steps had been trained when it was written.
    """
    _place.checkpoint = None if name is None else (name, step)


def set_phase(name: str) -> None:
    """Record ``name`` as this rank's phase until the next call.

    Args:
        name: where the rank is (e.g. 'forward', 'backward', a collective's name), as the
            heartbeat reports it.
    """
    _place.phase = name


class phase:  # noqa: N801 - used as a context manager, like a function
    """Record ``name`` as this rank's phase inside a ``with`` block.

    The outer phase comes back after the block, unless the block raised: the phase then stays
    where the failure happened.

    Args:
        name: where the rank is inside the block (e.g. 'forward', a collective's name), as the
            heartbeat reports it.
    """

    __slots__ = ("name", "outer")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.outer, _place.phase = _place.phase, self.name

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        if exc_type is None:
            _place.phase = self.outer


def is_comm_error(error: BaseException) -> bool:
    """Whether ``error`` came from communication rather than from this rank's own work.

    Communication errors are a peer that died, froze or left, or a timeout. torch raises
    DistError subclasses for some; gloo raises plain RuntimeErrors whose text names the
    transport.

    Args:
        error: the exception to tell.

    Returns:
        True for torch's DistError and its subclasses, and for a RuntimeError whose message
        names a closed or reset connection, a broken pipe, a timeout or gloo's transport.
    """
    if isinstance(error, torch_dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(mark in text for mark in (
        "Connection closed by peer", "Connection reset by peer", "pair closure",
        "Timed out waiting", "timed out after", "gloo/transport", "Broken pipe"))


def is_connection_lost(error: BaseException) -> bool:
    """Whether a store call failed because the store's end of the connection is gone (its
    process died: the connection was refused, reset or closed), rather than slow."""
    text = str(error)
    return any(mark in text for mark in ("Connection reset by peer", "Broken pipe",
                                         "Connection refused", "Connection closed by peer"))


def lost_work() -> str:
    """What a rank stopping now loses, and where ``--resume`` goes on: the steps since the
    newest checkpoint."""
    done = _place.done
    if _place.checkpoint is None:
        lost = f"the {done} steps trained are lost" if done else "nothing trained is lost"
        return f"{lost} (no checkpoint yet); --resume starts again from the beginning"
    name, step = _place.checkpoint
    if done is None or done <= step:
        return f"nothing since checkpoint {name} is lost; --resume continues from it"
    span = f"step {done} is" if done == step + 1 else f"steps {step + 1}-{done} are"
    return f"{span} lost since checkpoint {name} (step {step}); --resume continues from it"


# ---------------------------------------------------------------- what the ranks report

@dataclass
class Beat:
    """One rank's last report: a counter, the writer's clock, its step and phase."""

    seq: int
    time: float
    step: int | None
    phase: str

    def encode(self) -> str:
        return json.dumps([self.seq, round(self.time, 3), self.step, self.phase])

    @staticmethod
    def decode(raw: bytes) -> Beat:
        seq, when, step, where = json.loads(raw)
        return Beat(seq, when, step, where)

    def where(self) -> str:
        return f"at step {self.step} in {self.phase}" if self.step else f"in {self.phase}"


def rank_list(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0-2, 5': runs of consecutive ranks shortened."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def describe(beats: dict[int, Beat | None], now: float, silent_after: float,
             started: float = 0.0) -> tuple[str, list[int]]:
    """A one-line account of every rank, and the ranks that are silent: no beat for
    ``silent_after`` seconds, or none at all ``silent_after`` seconds after ``started``
    (before that, a rank without a beat is still starting). Ranks in one place are grouped."""
    if now - started < silent_after:
        beats = {r: b if b is not None else Beat(0, now, None, "starting")
                 for r, b in beats.items()}
    silent = [r for r, b in beats.items() if b is None or (b.phase != "finished"
                                                          and now - b.time >= silent_after)]
    parts = []
    for rank in silent:
        beat = beats[rank]
        parts.append(f"rank {rank} never reported" if beat is None else
                     f"rank {rank} silent for {now - beat.time:.0f} s, last seen {beat.where()}")
    places: dict[str, list[int]] = {}
    for rank, beat in beats.items():
        if rank not in silent:
            where = beat.phase if beat.phase in ("finished", "starting") else \
                ("waiting " if silent else "") + beat.where()
            places.setdefault(where, []).append(rank)
    parts += [f"{rank_list(ranks)} {where}" for where, ranks in places.items()]
    if not silent:
        parts.insert(0, "no rank is silent")
    return "; ".join(parts), silent


# ---------------------------------------------------------------- the heartbeat

def error_sentence(error: BaseException) -> str:
    """An error's first sentence, without the source location backends put first
    ('[.../pair.cc:537] Read error ...: Connection timed out. This is typically ...')."""
    line = re.sub(r"^\[[^\]]*:\d+\]\s*", "", one_line(error))
    return line.split(". ", 1)[0]


def _flush_logs() -> None:
    """Flush the log and stderr; one whose reader is gone (a dead launcher held the pipe)
    must not keep this process from ending."""
    for stream in [*log.handlers, sys.stderr]:
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _say_error(message: str) -> None:
    """``message`` as one ERROR line on stderr only; a stderr whose reader is gone (a dead
    launcher held the pipe) is passed over."""
    try:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR {message}", file=sys.stderr,
              flush=True)
    except (OSError, ValueError):  # nobody can be told
        pass


def exit_saying(message: str) -> NoReturn:
    """End this process now with ``message`` as one ERROR line on stderr only: it stopped
    because the job was lost to it, and the run directory may be another job's by now. A
    stderr whose reader is gone (a dead launcher held the pipe) does not keep it alive."""
    _say_error(message)
    os._exit(RANK_LOST_EXIT)


LAST_WORDS_SECONDS = 10.0  # the most the last words may take before the process ends
_last_words: list[Callable[[str], None]] = []


def before_process_end(callback: Callable[[str], None]) -> Callable[[], None]:
    """Have ``callback(message)`` run when the heartbeat ends this process because another
    rank failed or went silent (``message`` says which, as a `PeerFailure` would): the main
    thread, stuck in a collective, never gets an exception, so what must close (a tracker's
    run) closes here, in the heartbeat's thread. No collectives, no waiting on other ranks:
    all of them together get `LAST_WORDS_SECONDS`, then the process ends anyway.

    Args:
        callback: what to run, with the heartbeat's one-line reason.

    Returns:
        A function that takes ``callback`` off again (call it once it has nothing to close).
    """
    _last_words.append(callback)

    def remove() -> None:
        if callback in _last_words:
            _last_words.remove(callback)
    return remove


def _say_last_words(message: str) -> None:
    """Run every `before_process_end` callback (in a thread of its own, so that one that
    hangs costs no more than `LAST_WORDS_SECONDS` in all); one that fails is logged."""
    def run(callback: Callable[[str], None]) -> None:
        try:
            callback(message)
        except Exception:
            log.exception("%r failed as this rank stopped", callback)

    deadline = time.monotonic() + LAST_WORDS_SECONDS
    for callback in list(_last_words):
        thread = threading.Thread(target=run, args=(callback,), daemon=True,
                                  name="trainrun-last-words")
        thread.start()
        thread.join(max(deadline - time.monotonic(), 0.0))


def _end_process(message: str) -> None:
    """End this process now, from the heartbeat thread: the main thread may be stuck in a
    collective that never returns, so no exception could reach it. The `before_process_end`
    callbacks run first, with ``message``."""
    _say_last_words(message)
    _flush_logs()
    os._exit(RANK_LOST_EXIT)


class _LockedStore:
    """A store whose calls take turns: the heartbeat thread and the main thread share one."""

    def __init__(self, store: torch_dist.Store):
        self._store, self._lock = store, threading.Lock()

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)

        def locked(*args: Any) -> Any:
            with self._lock:
                return call(*args)
        return locked


class Heartbeat:
    """This rank's heartbeat threads and what they know; see the module's docstring."""

    GRACE = 2.0  # seconds the main thread gets to report a failure itself
    GONE_AFTER = 3.0  # seconds of refused or reset store connections that mean a dead store

    def __init__(self, store: torch_dist.Store, rank: int, world_size: int,
                 silent_after: float, prefix: str, launcher: str | None = None,
                 training: bool = False):
        self.store, self.rank, self.world_size = _LockedStore(store), rank, world_size
        self.address = _address(store)
        self.silent_after = silent_after
        self.interval = min(1.0, silent_after / 10)
        self.prefix = prefix
        self.launcher = launcher  # the program that started this process, watched; or None
        self.training = training  # a stop loses the steps since the newest checkpoint
        self.failing = False  # set once this rank's main thread handles a failure itself
        self._concluding, self._concluded = threading.Lock(), False
        self._agent_ended_at_exit = False
        self._seq = 0
        self._reported: set[int] = set()  # ranks whose beat key this rank has seen
        self._due = 0.0  # when this rank's next beat is due (monotonic clock)
        self._started = 0.0  # when this rank's heartbeat started (its clock)
        self._answered = time.monotonic()  # when the store last answered
        self._refused: tuple[float, BaseException] | None = None  # since when, and how
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainrun-heartbeat",
                                        daemon=True)
        self._guard = threading.Thread(target=self._watch_job, name="trainrun-job-guard",
                                       daemon=True)

    def key(self, name: str | int) -> str:
        return f"{self.prefix}/{name}"

    # -------------------------------------------------------- the threads

    def start(self) -> None:
        self._started = time.time()
        _place.round_trips.clear()  # a heartbeat before this one's (a test's process) is gone
        self.store.set(self.key(f"host/{self.rank}"), socket.gethostname())  # for messages
        self._beat()
        self._answered = time.monotonic()
        self._thread.start()
        self._guard.start()

    def stop(self) -> None:
        """End the threads; the rank's last beat says 'finished', so nobody waits on it."""
        self._stop.set()
        self._guard.join()
        self._thread.join(timeout=self.interval + 10)
        if self._thread.is_alive():  # stuck in a store call: the store cannot be told
            log.warning("heartbeat: could not report this rank finished: the job's store at "
                        "%s does not answer", self.address)
        elif not self.failing:
            try:
                self._beat("finished")
            except Exception as error:  # the run itself is done; say why, do not fail it
                log.warning("heartbeat: could not report this rank finished: %s", error)

    def _beat(self, phase: str | None = None) -> None:
        self._seq += 1
        beat = Beat(self._seq, time.time(), _place.step, phase or _place.phase)
        started = time.perf_counter()
        self.store.set(self.key(self.rank), beat.encode())
        _place.round_trips.append(time.perf_counter() - started)

    def _run(self) -> None:
        """Report this rank, and watch the one before it and the posted stop (store calls).
        The ranks' beats are spread over the interval (rank r's at r / world_size of it),
        so the store serves them evenly instead of every rank's at once (which, at 4096
        ranks, kept requests waiting in its queue for up to a few hundred ms each second)."""
        watched = (self.rank - 1) % self.world_size
        last_seq, changed = -1, time.monotonic()
        self._due = time.monotonic() + self.interval * self.rank / self.world_size
        while not self._stop.wait(self._until_next_beat()):
            try:
                self._beat()
                if self.store.check([self.key("stop")]):
                    self._stop_for_posted()
                    return
                beat = self._read(watched)  # None: not started (silent since this one started)
            except Exception as error:  # the store is slow, or gone: `_watch_job` decides
                if self._stop.is_set():
                    return
                if is_connection_lost(error) and self._refused is None:
                    self._refused = (time.monotonic(), error)
                continue
            self._answered, self._refused = time.monotonic(), None
            if beat is not None and (beat.seq != last_seq or beat.phase == "finished"):
                last_seq, changed = beat.seq, time.monotonic()
            elif time.monotonic() - changed >= self.silent_after and not self.failing:
                self._exit(*self._post(*self.account()))

    def _until_next_beat(self) -> float:
        """Seconds until this rank's next beat: the first time still ahead on its grid (every
        interval, from its offset), so a beat that ran late (a slow store) is not followed by
        one at once."""
        now = time.monotonic()
        if self._due <= now:
            self._due += ((now - self._due) // self.interval + 1) * self.interval
        return self._due - now

    def _watch_job(self) -> None:
        """End this rank when the job is lost to it (never touching the store, whose calls may
        block for good): its launcher died, the store is gone, or it stopped answering."""
        parent = _PARENT if self.launcher else None
        while not self._stop.wait(self.interval):
            if parent is not None and os.getppid() != parent:
                self._exit_lost(f"its launcher ({self.launcher}, pid {parent}) is gone")
            refused = self._refused  # (a failing rank's main thread says its own error first)
            if refused is not None and time.monotonic() - refused[0] >= self.GONE_AFTER \
                    and not self.failing:
                self._exit_lost(f"the job's store at {self.address} is gone "
                                f"({one_line(refused[1])}): its host or the launcher "
                                "hosting it died")
            unanswered = time.monotonic() - self._answered
            if unanswered >= self.silent_after:
                self._exit_lost(f"no answer from the job's store at {self.address} for "
                                f"{unanswered:.0f} s: its host froze, or the network between "
                                "this node and it is down, so the other ranks cannot be "
                                "reached either", unanswered=True)

    def lost_contact(self, reason: str) -> str:
        """One line: this rank stops because of ``reason``, and what that loses."""
        line = f"rank {self.rank}: stopping: {reason}"
        return f"{line}; {lost_work()}" if self.training else line

    def _exit_lost(self, reason: str, unanswered: bool = False) -> None:
        """Say why this rank stops, on stderr only (a job that lost its launcher writes
        nothing more into the run directory, which a requeued job may use), and end it.
        ``unanswered``: the store did not answer, so torchrun's agent is ended too
        (``end_agent``)."""
        if self._stop.is_set():
            return
        _say_error(self.lost_contact(reason))
        if unanswered:
            end_agent(self.rank)
        os._exit(RANK_LOST_EXIT)

    def end_agent_at_exit(self) -> None:
        """Have this process end torchrun's agent as it exits (``end_agent``), after it has
        said why it stops: the store did not answer this rank's main thread, so the agent's
        calls to it block as well. For a rank that stops by raising, not from this thread."""
        if not self._agent_ended_at_exit:
            self._agent_ended_at_exit = True
            atexit.register(end_agent, self.rank)

    def _stop_for_posted(self) -> None:
        """Another rank posted why the job stops: say so (once for the job), then give this
        rank's main thread ``GRACE`` seconds to fail by itself, as it does when it waits on a
        failed rank that then exits; if it does not, it is stuck: end this process. A rank
        whose main thread handles a failure itself (it posted it, or explains it) is not
        counted as told: the failing rank waits on the others' count."""
        if self.failing:
            return
        message, culprits = self.posted()
        self.conclude(message, culprits)
        deadline = time.monotonic() + self.GRACE
        while time.monotonic() < deadline and not self.failing:
            time.sleep(0.05)
        if not self.failing:
            _end_process(message)

    def _exit(self, message: str, culprits: list[int]) -> None:
        self.conclude(message, culprits)
        _end_process(message)

    def conclude(self, message: str, culprits: list[int]) -> None:
        """Say why the job stops (on one rank: the lowest that is not a culprit), then count
        this rank as told, which lets a failing rank exit (see ``post_failure``). Once."""
        with self._concluding:
            if self._concluded:
                return
            self._concluded = True
        if self.reports(culprits):
            log.error("stopping every rank: %s", message)
            _flush_logs()
        self.store.add(self.key("told"), 1)

    # -------------------------------------------------------- the store

    def _read(self, rank: int) -> Beat | None:
        """``rank``'s last beat, None before its first. Once its key is there it stays (for
        this generation), so a beat then costs this rank three store requests, not four."""
        key = self.key(rank)
        if rank not in self._reported:
            if not self.store.check([key]):
                return None
            self._reported.add(rank)
        return Beat.decode(self.store.get(key))

    def beats(self) -> dict[int, Beat | None]:
        """Every rank's last beat (None: none yet): two store requests when every rank has
        reported (one ``check`` of all keys, one ``multi_get``), not one per rank."""
        keys = [self.key(r) for r in range(self.world_size)]
        present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
        values = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
        return {r: Beat.decode(values[k]) if k in values else None
                for r, k in enumerate(keys)}

    def account(self) -> tuple[str, list[int]]:
        """Every rank's state as one line, and the silent ranks: those that missed three
        beats (a live rank beats every ``interval`` seconds, whatever its main thread does)."""
        return describe(self.beats(), time.time(), 3 * self.interval, self._started)

    def _post(self, message: str, ranks: list[int]) -> tuple[str, list[int]]:
        """Post why the job stops, unless some rank did first; returns what stands."""
        mine = json.dumps({"message": message, "ranks": ranks})
        standing = self.store.compare_set(self.key("stop"), "", mine)
        posted = json.loads(standing)
        return posted["message"], posted["ranks"]

    def posted(self) -> tuple[str, list[int]]:
        posted = json.loads(self.store.get(self.key("stop")))
        return posted["message"], posted["ranks"]

    def reports(self, culprits: list[int]) -> bool:
        """Whether this rank prints the job's stop: the lowest rank not among the culprits."""
        others = [r for r in range(self.world_size) if r not in culprits]
        return bool(others) and self.rank == others[0]

    # -------------------------------------------------------- the main thread's failures

    def post_failure(self, error: BaseException) -> None:
        """This rank failed by itself (not for lack of a peer): tell the others why, and give
        them a few seconds to say so before this rank exits (a launcher such as torchrun
        kills the other ranks as soon as one exits)."""
        self.failing = True
        where = Beat(0, 0.0, _place.step, _place.phase).where()
        try:
            self._post(f"rank {self.rank} failed {where}: {type(error).__name__}: "
                       f"{one_line(error)}",
                       [self.rank])
            deadline = time.monotonic() + self.GRACE + 3
            while self.store.add(self.key("told"), 0) < self.world_size - 1 \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception as store_error:  # the store went away: the launcher ends the others
            log.debug("could not post the failure: %s", store_error)

    def explain(self, wait: float = 5.0) -> str:
        """Why a collective of this rank failed: a failure another rank posted, or else the
        ranks that went silent (waiting up to ``wait`` seconds for one of the two to show, as a
        peer that just died still has a fresh beat). Posted for the others, said once for the
        job (``conclude``), and returned."""
        self.failing = True
        self._beat()  # this rank's own place, as of now
        deadline = time.monotonic() + wait
        while not self.store.check([self.key("stop")]):
            message, silent = self.account()
            if silent or time.monotonic() >= deadline:
                self._post(message, silent)
                break
            time.sleep(self.interval / 2)
        message, culprits = self.posted()
        self.conclude(message, culprits)
        return message


# ---------------------------------------------------------------- torchrun's agent

# Set by ``trainrun train --nproc`` for its workers: the pid of the process that runs
# torchrun's agent in-process (its command line is trainrun's, not torchrun's).
AGENT_PID = "TRAINRUN_AGENT_PID"
AGENT_GRACE = 5.0  # seconds torchrun's agent gets to end after a SIGTERM, before a SIGKILL


def torchrun_agent() -> int | None:
    """The pid of the torchrun agent that started this process, while it runs; else None.

    The agent is a worker's parent process. It counts only under torchrun
    (``TORCHELASTIC_RUN_ID`` set) when that parent is still the process that started this
    one and runs torch's elastic launcher: its command line is ``torchrun ...`` or
    ``python -m torch.distributed.run ...`` (or the older ``torch.distributed.launch``), or it
    is ``trainrun train --nproc``, which names its own pid in ``TRAINRUN_AGENT_PID``. Any
    other parent (a shell script between torchrun and this process, say) is never taken for
    it.
    """
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" not in os.environ or parent != _PARENT or parent <= 1:
        return None
    if os.environ.get(AGENT_PID) == str(parent):
        return parent
    try:
        argv = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # gone, or no /proc here
        return None
    programs = [os.path.basename(arg) for arg in argv[:2]]
    modules = ("torch.distributed.run", "torch.distributed.launch")  # (-m; launch runs run's)
    if "torchrun" in programs or any(module in argv for module in modules) or \
            any(arg.endswith(os.path.join("torch", "distributed", "run.py")) for arg in argv[:2]):
        return parent
    return None


def end_agent(rank: int, grace: float = AGENT_GRACE) -> None:
    """End the torchrun agent that started this process (``torchrun_agent``), if any.

    For a rank that stops because the job's store does not answer: the agent's own calls to
    that store (its rendezvous keep-alive, ``num_nodes_waiting``) then block too, for
    minutes when the link to the store's host went down, and it reaps none of its exited
    workers, so a cluster job would hold its nodes until its time limit. The agent gets a
    SIGTERM (it then stops its workers and exits non-zero) and ``grace`` seconds; one still
    blocked in a store call does not act on it, and gets a SIGKILL, said in one line.

    Args:
        rank: this process's rank, for the line.
        grace: seconds between the SIGTERM and the SIGKILL.
    """
    agent = torchrun_agent()
    if agent is None:
        return
    # every rank of the node gets here at about the same time: the lowest local rank kills
    # the agent first, and the others find it gone, so the node says so once
    grace += 0.2 * int(os.environ.get("LOCAL_RANK") or 0)
    try:
        os.kill(agent, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while os.getppid() == agent and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.getppid() == agent:  # (a parent that ended hands this process on at once)
            os.kill(agent, signal.SIGKILL)
            _say_error(f"rank {rank}: torchrun's agent (pid {agent}) cannot reach the job's "
                       f"store either and did not end within {grace:g} s of a SIGTERM: "
                       "killed it (SIGKILL), so that the job ends on this node")
    except ProcessLookupError:  # it ended meanwhile
        pass


# ---------------------------------------------------------------- starting and stopping

_generation = 0  # heartbeats started in this process: keys of an earlier one are never read
_active: list[Heartbeat] = []  # the heartbeat ``watch_ranks`` runs, while it runs


def report_place() -> None:
    """Report this rank's place to the job's store now, not at the heartbeat's next beat.

    For a place a job may end in (its last hooks): a run shorter than a beat would otherwise
    leave the rank's first report ('setup') as the last the others saw. One store request
    from the calling thread; a no-op without a heartbeat. A store that fails it is left to
    the heartbeat's own threads to find.
    """
    for heartbeat in _active:
        try:
            heartbeat._beat()
        except Exception as error:  # slow or gone: the heartbeat's threads decide
            log.debug("heartbeat: could not report this rank's place: %s", error)


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed or went silent; the message says which.

    Args:
        message: which rank failed or went silent, and where.
        said: whether the heartbeat has already said it (once for the whole job); kept as the
            attribute ``said``.
    """

    def __init__(self, message: str, said: bool = True):
        super().__init__(message)
        self.said = said


_PARENT = os.getppid()  # the process that started this one (a launcher's, if any)


def _address(store: torch_dist.Store) -> str:
    """Where ``store`` is served ('host:port'), or a description when it is not a TCPStore."""
    while not hasattr(store, "host") and hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None else type(store).__name__


def _store(silent_after: float) -> torch_dist.Store | None:
    """A client of the default group's store for the heartbeat alone (None: the group has no
    store, as under the MPI backend), whose calls give up after a few beats where torch honours
    the timeout (a store whose host froze can still block a call for good: see
    ``Heartbeat._watch_job``). torch has no public accessor for that
    store; one without ``clone`` (torch < 2.5) is shared, timeout and all."""
    try:
        store = torch_dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    if not hasattr(store, "clone"):
        return store
    own = store.clone()
    own.set_timeout(client_timeout(silent_after))
    return own


def client_timeout(silent_after: float) -> datetime.timedelta:
    """How long one heartbeat store call may take before it gives up: a few beats, so a slow
    call fails (and is retried at the next beat) well before the rank counts as silent."""
    return datetime.timedelta(seconds=max(5.0, min(30.0, silent_after / 4)))


def _prefix() -> str:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(
        "SLURM_RESTART_COUNT") or "0"
    return f"trainrun/heartbeat/{restart}/{_generation}"


@contextmanager
def watch_ranks(silent_after: float, training: bool = False) -> Iterator[Heartbeat | None]:
    """Run this rank's heartbeat for the duration of the ``with`` block.

    Every rank of the default group must enter together. Meanwhile a thread in each rank
    reports the rank's step and phase to the job's store about once a second and watches the
    rank before it: when that rank has been silent for ``silent_after`` seconds, or some rank
    posts a failure, it ends its own process with one message naming who stopped and where
    every rank was. A second thread ends the rank when its launcher died or the store is gone
    or has not answered for ``silent_after`` seconds.

    Args:
        silent_after: seconds after which a rank that has not reported counts as silent (the
            collective timeout).
        training: a rank that stops also says which steps since the newest checkpoint it loses.

    Yields:
        This rank's ``Heartbeat``; None where there is nothing to watch (one process, or a
        default group without a store, as under the MPI backend).
    """
    from trainrun.dist.launch import STARTERS, infer_launcher  # launch imports this module

    global _generation
    if not (torch_dist.is_available() and torch_dist.is_initialized()) \
            or torch_dist.get_world_size() == 1:
        yield None
        return
    store = _store(silent_after)
    if store is None:
        log.debug("no heartbeat: the default group has no store")
        yield None
        return
    _generation += 1
    heartbeat = Heartbeat(store, torch_dist.get_rank(), torch_dist.get_world_size(),
                          silent_after, _prefix(), STARTERS.get(infer_launcher()), training)
    heartbeat.start()
    _active.append(heartbeat)
    try:
        yield heartbeat
    finally:
        _active.remove(heartbeat)
        heartbeat.stop()

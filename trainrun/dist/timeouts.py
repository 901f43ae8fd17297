"""The collective timeout, and errors that name the operation that timed out."""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed import ProcessGroup

from trainrun.dist.heartbeat import one_line, phase

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# The timeout `init_dist` applied, for error messages.
_timeout: datetime.timedelta = DEFAULT_TIMEOUT


class DistTimeoutError(RuntimeError):
    """A collective did not finish within the process group's timeout.

    Raised in place of the backend's own timeout error (chained to it), with a message that
    names the operation, the timeout and this rank, says that another rank did not take part,
    and quotes the backend's words. A RuntimeError.
    """


def to_timedelta(timeout: float | int | datetime.timedelta | None) -> datetime.timedelta:
    """Seconds or a timedelta (None: the 30 minute default) as a positive timedelta."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        try:
            value = datetime.timedelta(seconds=timeout)
        except (OverflowError, ValueError):  # inf, nan, or beyond timedelta's range
            raise ValueError(f"timeout must be a finite number of seconds, got {timeout}") from None
    else:
        raise ValueError(f"timeout must be seconds or a timedelta, got {timeout!r}")
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value.total_seconds()} s")
    return value


def set_timeout(timeout: datetime.timedelta) -> None:
    global _timeout
    _timeout = timeout


def get_timeout() -> datetime.timedelta:
    """The timeout every collective of the default group runs under."""
    return _timeout


# What the backends say when a collective runs out of time (torch has no timeout error type):
# gloo (torch 2.13) "[...unbound_buffer.cc:129] Timed out waiting 3000ms for send operation to
# complete" (or "recv"), then "Application timeout caused pair closure" for every later
# collective of that group; NCCL's watchdog "Watchdog caught collective operation timeout:
# WorkNCCL(...) ran for 600000 milliseconds before timing out". A peer that exited gives
# "Connection closed by peer", which is not a timeout; nor is any other text with "timeout".
_TIMEOUT_TEXTS = re.compile(r"timed out waiting \d+ ?ms for \w+ operation|application "
                            r"timeout caused pair closure|collective operation timeout|"
                            r"milliseconds before timing out", re.IGNORECASE)


def _looks_like_timeout(exc: BaseException) -> bool:
    """Whether a backend error says that its collective timed out."""
    return _TIMEOUT_TEXTS.search(str(exc)) is not None


@contextmanager
def named_operation(name: str, group: ProcessGroup | None = None) -> Iterator[None]:
    """Turn a backend's timeout error inside the block into one naming ``name`` and the timeout;
    the heartbeat reports this rank as in ``name`` meanwhile."""
    try:
        with phase(name):
            yield
    except RuntimeError as exc:
        if isinstance(exc, DistTimeoutError) or not _looks_like_timeout(exc):
            raise
        from trainrun.dist.info import get_dist_info

        try:
            rank, world_size = get_dist_info(group)
            where = f"rank {rank} of {world_size}"
        except Exception:  # the group may be unusable after a timeout
            where = "this rank"
        seconds = _timeout.total_seconds()
        raise DistTimeoutError(
            f"{name} timed out after {seconds:g} s on {where}: another rank did not take part "
            f"(it may have crashed, hung, or be waiting in a different collective). "
            f"Backend said: {one_line(exc)}"
        ) from exc

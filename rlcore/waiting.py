"""Cancellation and deadlines: the two things every wait in rlcore observes.

A :class:`CancelToken` is set once by whoever decides the run is over (the
executor, on the first failure). A :class:`Deadline` is a point in monotonic
time. :func:`wait_until` polls a condition until it holds, the token is set or
the deadline passes, so no wait in rlcore can block forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from rlcore.errors import Cancelled, DeadlineExceeded

T = TypeVar("T")


class CancelToken:
    """A one-shot, thread-safe cancellation flag with the reason it was set."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason: str | None = None
        self._lock = threading.Lock()

    def cancel(self, reason: str) -> None:
        """Set the token. The first reason given is kept."""
        with self._lock:
            if self._reason is None:
                self._reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def raise_if_cancelled(self, what: str = "wait") -> None:
        """Raise :class:`Cancelled` naming ``what`` if the token is set."""
        if self._event.is_set():
            raise Cancelled(f"{what} cancelled: {self._reason}")

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return True early if cancelled meanwhile."""
        return self._event.wait(max(0.0, seconds))


class Deadline:
    """A point in monotonic time by which something must be done."""

    def __init__(self, seconds: float | None, what: str = "operation") -> None:
        self.what = what
        self.seconds = seconds
        self._at = None if seconds is None else time.monotonic() + seconds

    @classmethod
    def never(cls, what: str = "operation") -> Deadline:
        return cls(None, what)

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` for no deadline."""
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    @property
    def expired(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at

    def raise_if_expired(self, detail: str = "") -> None:
        if self.expired:
            extra = f": {detail}" if detail else ""
            raise DeadlineExceeded(f"{self.what} exceeded its deadline of {self.seconds:g}s{extra}")

    def sooner(self, seconds: float | None, what: str | None = None) -> Deadline:
        """The earlier of this deadline and ``seconds`` from now."""
        other = Deadline(seconds, what or self.what)
        if other._at is None or (self._at is not None and self._at <= other._at):
            return self
        return other


def wait_until(
    condition: Callable[[], T | None],
    *,
    what: str,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
    poll_s: float = 0.05,
    max_poll_s: float = 0.5,
) -> T:
    """Poll ``condition`` until it returns something other than None/False.

    Raises :class:`Cancelled` when ``cancel`` is set and
    :class:`DeadlineExceeded` when ``deadline`` passes, each naming ``what``.
    The poll interval grows from ``poll_s`` to ``max_poll_s``.
    """
    deadline = deadline or Deadline.never(what)
    interval = poll_s
    while True:
        if cancel is not None:
            cancel.raise_if_cancelled(what)
        result = condition()
        if result is not None and result is not False:
            return result
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(
                f"gave up waiting for {what} after {deadline.seconds:g}s "
                f"(deadline of {deadline.what})"
            )
        step = interval if remaining is None else min(interval, remaining)
        if cancel is not None:
            if cancel.sleep(step):
                cancel.raise_if_cancelled(what)
        else:
            time.sleep(step)
        interval = min(max_poll_s, interval * 1.5)

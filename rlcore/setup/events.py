"""An in-process board of setup events (``generation.endpoint`` and friends).

The executor posts an event once, with a value; any task may wait for it with a
deadline and the run's cancellation token. Waiting never blocks forever.
"""

from __future__ import annotations

import threading
from typing import Any

from rlcore.errors import Cancelled, CancelToken, Deadline, DeadlineExceeded


class EventBoard:
    """Named one-shot events with values, waitable with deadline and cancellation."""

    def __init__(self, cancel: CancelToken) -> None:
        self._cancel = cancel
        self._values: dict[str, Any] = {}
        self._cond = threading.Condition()

    def post(self, name: str, value: Any = None) -> None:
        """Post ``name`` with ``value``. Posting twice keeps the first value."""
        with self._cond:
            self._values.setdefault(name, value)
            self._cond.notify_all()

    def posted(self, name: str) -> bool:
        with self._cond:
            return name in self._values

    def wait(self, name: str, deadline: Deadline, *, waiter: str = "task") -> Any:
        """Block until ``name`` is posted; return its value.

        Raises :class:`Cancelled` if the run is cancelled first and
        :class:`DeadlineExceeded` (naming the event and the waiter) if the
        deadline passes first.
        """
        with self._cond:
            while name not in self._values:
                if self._cancel.cancelled:
                    raise Cancelled(f"{waiter} stopped waiting for event '{name}': {self._cancel.reason}")
                remaining = deadline.remaining()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(
                        f"{waiter} waited {deadline.seconds:g}s for event '{name}', which never came "
                        f"(deadline of {deadline.what})"
                    )
                # Wake at least every 0.1 s to observe cancellation set without notify.
                self._cond.wait(0.1 if remaining is None else min(0.1, remaining))
            return self._values[name]

    def wake_all(self) -> None:
        """Wake every waiter so it re-checks cancellation now."""
        with self._cond:
            self._cond.notify_all()

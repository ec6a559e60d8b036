"""Who may call Ray now: the process's one gate, closed while the run's cluster shuts down.

Kept apart from :mod:`rlcore.runtime.worker_group` so that everything that calls Ray for the
core (worker groups, the liveness monitor, the cluster) enters the same gate without
importing each other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from rlcore.errors import Cancelled


class RayGate:
    """Who may call Ray now: closed while (and after) the run's cluster shuts down.

    Every Ray call the core makes for a worker group (``ray_get``'s polling slices,
    starting actors, calling them, killing them) enters the gate. :meth:`close` refuses
    new calls (they raise :class:`Cancelled` naming the reason) and waits, bounded, for
    the calls in flight to leave, so ``ray.shutdown()`` never runs under a thread that is
    still inside Ray (an abandoned init thread), and no such thread calls Ray afterwards.
    :meth:`open` lets calls in again (a new cluster started).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed: str | None = None

    @property
    def closed(self) -> str | None:
        """Why the gate is closed, or ``None`` while Ray calls are allowed."""
        return self._closed

    @contextlib.contextmanager
    def call(self, what: str) -> Iterator[None]:
        """Around one Ray call (or one short slice of calls); raises Cancelled when closed."""
        with self._cond:
            if self._closed is not None:
                raise Cancelled(f"{what}: no Ray calls any more ({self._closed})")
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    def close(self, reason: str, wait_s: float = 2.0) -> bool:
        """Refuse new calls; wait up to ``wait_s`` for those in flight. True if none is left."""
        with self._cond:
            if self._closed is None:
                self._closed = reason
            return self._cond.wait_for(lambda: self._inside == 0, timeout=wait_s)

    def open(self) -> None:
        with self._cond:
            self._closed = None


#: The process's gate (one Ray connection per process): closed by
#: :meth:`rlcore.runtime.cluster.Cluster.shutdown`, opened by :meth:`rlcore.runtime.cluster.Cluster.start`.
RAY_GATE = RayGate()

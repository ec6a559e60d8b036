"""The lifecycle every handle over a :class:`rlcore.runtime.worker_group.WorkerGroup` shares.

A handle is open until ``shutdown()``; every call checks that first, so a call on a
handle the core (or a failure path) already shut down names the backend instead of
reaching dead actors. ``shutdown()`` is idempotent and safe from several threads: the
core may call it from a failure path while the loop is still calling it.
"""

from __future__ import annotations

import threading
from typing import Any

from rlcore.errors import RlcoreError, WorkerError


class GroupHandle:
    """Open/closed state, the ranks' process ids and an idempotent shutdown.

    Subclasses call ``GroupHandle.__init__(self, group, backend=..., role=...)`` and put
    what they start beside the workers (an HTTP front, a server) into :meth:`_release`.
    """

    group: Any
    backend: str
    role: str

    def __init__(self, group: Any, *, backend: str, role: str) -> None:
        self.group = group
        self.backend = backend
        self.role = role
        self._closed = False
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return int(self.group.world_size)

    def _check_open(self) -> None:
        if self._closed:
            raise RlcoreError(f"{self.group.name}: the {self.backend} {self.role} handle was shut down")

    def pids(self) -> list[int]:
        """Process ids of the ranks (for leak checks)."""
        self._check_open()
        return list(self.group.pids())

    def _release(self) -> None:
        """Stop what the handle started besides its workers; runs once, before the workers go."""

    def shutdown(self) -> None:
        """Release what the handle holds, then every actor (graceful teardown, then kill).
        Idempotent and thread-safe. Raises :class:`~rlcore.errors.WorkerError` naming a rank
        that hung during the shutdown (once everything is down: the error is a report)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._release()
        finally:
            problems = self.group.shutdown()
        if problems:
            raise WorkerError("; ".join(problems))

"""Watching the cluster's head: a run whose GCS is gone ends within ``cluster.hang_timeout_s``.

The driver calls its actors directly, not through the head, so a run whose head lost its
GCS (the process killed, the head's machine down) trains on blind: Ray's core worker gives
the GCS ``gcs_rpc_server_reconnect_timeout_s`` (60 s) to come back, then ends the process
with a line of its own, and the workers outlive the driver until their raylets give up too.

The process's :data:`HEAD_WATCH`, one daemon thread started by
:meth:`rlcore.runtime.cluster.Cluster.start` (unless ``cluster.hang_timeout_s`` is null),
opens a TCP connection to the GCS's port every :attr:`HeadWatch.interval_s` seconds, with a
short timeout: nothing of Ray's, so it never waits behind Ray's own retries. A GCS that has
accepted no connection for :attr:`HeadWatch.lost_after_s` (half the timeout: the other half
is the teardown's) is declared lost, and then:

- Ray calls of the core are refused (:data:`rlcore.runtime.gate.RAY_GATE` is closed with the
  cause), so the worker groups' shutdown kills their processes on this host by pid instead
  of asking the dead GCS to;
- every wait of the core (:func:`rlcore.runtime.waits.ray_get`) raises :class:`rlcore.errors.ClusterLost`
  at its next polling slice, and the run's end reports it in place of whatever error the
  loss caused (:meth:`HeadWatch.error`). A run that fails first (the workers on the head's
  node may die with it within seconds) asks the GCS once more at its end, and a GCS that
  accepts no connection then is the cause it reports;
- ``ray.shutdown()``, which waits about 15 s on a dead GCS, is given
  :data:`rlcore.runtime.cluster.LOST_HEAD_SHUTDOWN_S`, and ``rlcore run`` leaves without
  the interpreter's finalization (where Ray's exit hook would wait again).

Measured on a 2-core host (``tests/e2e/test_head_lost.py``, ``hang_timeout_s=10``): the
head's GCS SIGKILLed mid-step, ``rlcore run`` exits 5.2 s later with one ``error:`` line;
before, a worker's death ended it 19 s later in a line that did not name the head.

A GCS that stops answering without closing its port (a frozen head) is not detected here:
its workers' liveness probes (:mod:`rlcore.runtime.liveness`) go on answering, and the run
goes on as long as the workers can. With GCS fault tolerance (a GCS that restarts), give
``cluster.hang_timeout_s`` more than twice the GCS's restart time.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from rlcore.errors import ClusterLost
from rlcore.runtime.gate import RAY_GATE

log = logging.getLogger(__name__)


def gcs_reachable(address: str, timeout_s: float) -> bool:
    """Whether something accepts a TCP connection at ``address`` (``host:port``) within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class HeadWatch:
    """Connects to the GCS from one daemon thread and says when it is gone (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.address: str | None = None
        self.timeout_s = 30.0
        #: (monotonic time it was declared lost, seconds it had been silent then).
        self._lost: tuple[float, float] | None = None
        self._answered_at = time.monotonic()  # the GCS's last accepted connection

    @property
    def interval_s(self) -> float:
        """Seconds between two connects."""
        return max(0.1, min(2.0, self.timeout_s / 15))

    @property
    def lost_after_s(self) -> float:
        """Seconds without an accepted connection after which the GCS is lost."""
        return self.timeout_s / 2

    @property
    def watching(self) -> bool:
        """Whether the watch's thread runs."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def lost(self) -> bool:
        """Whether the GCS has been declared lost (until the next :meth:`start`)."""
        return self._lost is not None

    def start(self, address: str, timeout_s: float) -> None:
        """Watch the GCS at ``address`` (``host:port``); declared lost after ``timeout_s / 2``."""
        self.stop()
        with self._lock:
            self.address, self.timeout_s, self._lost = address, float(timeout_s), None
            self._answered_at = time.monotonic()
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(address, self._stop), name="rlcore-head-watch", daemon=True
            )
            self._thread.start()
        log.debug("watching the GCS at %s (lost after %gs)", address, self.lost_after_s)

    def stop(self) -> None:
        """Stop watching (the cluster is shut down on purpose); what was found is kept."""
        with self._lock:
            self._stop.set()
            self._thread = None

    def clear(self) -> None:
        """Stop watching and forget a loss (a new cluster is about to start)."""
        self.stop()
        self._lost = None

    def error(self, during: str | None = None, *, check: bool = False) -> ClusterLost | None:
        """The loss as the run's error (``during``: what the run was doing), or ``None``.

        ``check``: a GCS still watched and not yet declared lost is asked once more, now
        (one connect, 1 s at most): a run that failed (its workers died with their head's node)
        is told the cause even before :attr:`lost_after_s` has passed.
        """
        address = self.address
        if check and self._lost is None and address is not None and self.watching:
            if not gcs_reachable(address, 1.0):
                self._declare(address)
        lost = self._lost
        if lost is None or address is None:
            return None
        when = f" during {during}" if during else ""
        return ClusterLost(
            f"the Ray cluster's head is gone: its GCS at {address} accepts no connection (none "
            f"for {lost[1]:.1f}s){when} (cluster.hang_timeout_s={self.timeout_s:g}); the run was "
            "stopped and its workers on this host killed. Restart the head and its nodes, then run "
            "again (--resume continues from the run's last checkpoint, if it wrote one)",
            address=address,
            silent_s=lost[1],
        )

    def raise_if_lost(self, what: str) -> None:
        """Raise :class:`ClusterLost` (naming ``what`` as what the run was doing) once the GCS is lost."""
        err = self.error(what)
        if err is not None:
            raise err

    def _run(self, address: str, stop: threading.Event) -> None:
        self._answered_at = time.monotonic()
        while not stop.wait(self.interval_s):
            if gcs_reachable(address, min(2.0, max(0.2, self.interval_s))):
                self._answered_at = time.monotonic()
                continue
            if time.monotonic() - self._answered_at < self.lost_after_s or stop.is_set():
                continue
            self._declare(address)
            return

    def _declare(self, address: str) -> None:
        """The GCS at ``address`` is lost: say so, and refuse the run's Ray calls from now on."""
        with self._lock:
            if self._lost is not None:
                return
            silent = time.monotonic() - self._answered_at
            self._lost = (time.monotonic(), silent)
        reason = f"the Ray cluster's head is gone: its GCS at {address} accepts no connection (none for {silent:.1f}s)"
        log.error("%s", reason)
        # Nothing more is asked of the dead GCS: the teardown kills this host's workers itself.
        RAY_GATE.close(reason, wait_s=0.0)


#: The process's watch: started by :meth:`rlcore.runtime.cluster.Cluster.start`, stopped by
#: :meth:`~rlcore.runtime.cluster.Cluster.shutdown`, asked by every ``ray_get``.
HEAD_WATCH = HeadWatch()

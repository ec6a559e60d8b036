"""Hang detection: every worker answers a liveness probe that does not wait behind its call.

A worker whose process freezes (SIGSTOP, a wedged driver, a machine in trouble) never
fails its call: Ray notices only through its keepalive, minutes later, and then calls it
"died" without saying what it was doing; a call's own timeout cannot tell a big model's
slow generate from a frozen process.

:class:`rlcore.runtime.worker_group.WorkerGroup` gives each actor a concurrency group of its
own (:data:`PROBE_GROUP`, one thread), so ``rlcore_liveness()`` runs beside whatever
call is busy; it also reports the worker's child processes that are stopped (an engine's
server). The process's :data:`LIVENESS` monitor, one driver thread, probes every watched
rank every :attr:`LivenessMonitor.interval_s` seconds. A rank that has not answered
healthy for :attr:`LivenessMonitor.silence_s` is declared hung; the clock starts at its
first answer (a rank still starting is bounded by its init deadline). Every wait of the
core (:func:`rlcore.runtime.waits.ray_get`) asks the monitor at each polling slice and
raises :class:`WorkerHung`, naming group, role, rank, node, pid and what it waited for,
so the run ends (or replaces a generation engine) within ``cluster.hang_timeout_s`` of
the freeze. A long call whose process keeps running answers every probe: not a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import Cancelled, WorkerLost
from rlcore.runtime.gate import RAY_GATE

log = logging.getLogger(__name__)

#: The concurrency group (one thread) every probed actor has besides its default one.
PROBE_GROUP = "rlcore_liveness"
#: The method a probed worker class provides (:class:`rlcore.runtime.worker_group.DistributedWorker` does).
PROBE_METHOD = "rlcore_liveness"
#: ``cluster.hang_timeout_s``'s default: a frozen worker is declared hung within this.
DEFAULT_HANG_TIMEOUT_S = 30.0

_STOPPED = ("stopped", "tracing-stop")


def is_stopped(proc: Any) -> bool:
    """Whether ``proc`` (a ``psutil.Process``) is stopped (SIGSTOP, a tracer); False once gone."""
    import psutil

    try:
        return proc.status() in _STOPPED
    except psutil.Error:
        return False


def describe_worker(group: str, role: str | None, rank: int, node: str, pid: int | None) -> str:
    """``<group> rank <r> (role <role>, node <address>, pid <pid>)``: how errors name a worker."""
    who = f"role {role}, " if role else ""
    return f"{group} rank {rank} ({who}node {node}, pid {pid})"


def liveness_answer() -> dict[str, Any]:
    """What a worker answers a probe (runs in the worker, on the probe's thread): its pid,
    its node's address and its child processes that are stopped (a frozen server)."""
    import psutil

    stopped = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if is_stopped(child):
                    stopped.append({"pid": child.pid, "name": child.name()})
    node_ip = "?"
    with contextlib.suppress(Exception):
        import ray

        node_ip = str(ray.util.get_node_ip_address())
    return {"pid": os.getpid(), "node_ip": node_ip, "stopped": stopped}


class WorkerHung(WorkerLost):
    """A worker stopped answering its liveness probe (see the module doc); its process
    is killed with its group. A :class:`WorkerLost` whose :attr:`role` is known, so a
    generation under ``on_worker_loss: replace`` is replaced like a dead one.

    Attributes (besides WorkerLost's): ``group``, ``rank``, ``node`` (address), ``pid``,
    ``phase`` (what the core was waiting for when it found the hang).
    """

    def __init__(self, hang: Hang, phase: str, timeout_s: float) -> None:
        super().__init__(
            f"{hang.describe()} hung during {phase}: {hang.cause} "
            f"(cluster.hang_timeout_s={timeout_s:g}); its group is killed",
            worker=f"{hang.group} rank {hang.rank}",
            index=hang.rank,
            rank=hang.rank,
        )
        self.group, self.node, self.pid, self.phase = hang.group, hang.node_ip, hang.pid, phase
        if hang.role is not None:
            self.tag(hang.role)


@dataclass(frozen=True)
class Hang:
    """One rank declared hung."""

    group: str
    role: str | None
    rank: int
    node_ip: str
    pid: int | None
    silent_s: float
    cause: str

    def describe(self) -> str:
        return describe_worker(self.group, self.role, self.rank, self.node_ip, self.pid)


@dataclass
class _Rank:
    actor: Any
    pid: int | None
    node_id: str | None
    node_ip: str = "?"
    answered_at: float | None = None  # last healthy answer (monotonic)
    in_flight: Any = None
    stopped: list[dict[str, Any]] = field(default_factory=list)
    dead: bool = False
    hang: Hang | None = None


@dataclass
class _Group:
    name: str
    role: str | None
    ranks: dict[int, _Rank]


class LivenessMonitor:
    """Probes the watched worker groups from one daemon thread (see the module doc).

    Args:
        timeout_s: a frozen worker is declared hung within this many seconds.
    """

    def __init__(self, timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        self._lock = threading.Lock()
        self._groups: dict[int, _Group] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.timeout_s = timeout_s
        #: Whether groups started now get the probe (``cluster.hang_timeout_s: null``: no).
        self.enabled = True

    # ------------------------------------------------------------- settings

    def configure(self, timeout_s: float | None) -> None:
        """Set ``cluster.hang_timeout_s`` (takes effect at the next probe); ``None`` turns
        probing off for the groups started from now on (:attr:`enabled`)."""
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"hang timeout must be positive, got {timeout_s}")
        self.enabled = timeout_s is not None
        if timeout_s is not None:
            self.timeout_s = float(timeout_s)

    @property
    def interval_s(self) -> float:
        """Seconds between two probes of a rank."""
        return max(0.1, min(2.0, self.timeout_s / 15))

    @property
    def silence_s(self) -> float:
        """Seconds without a healthy answer after which a rank is hung: the timeout less
        the time a probe and the wait that notices it can take."""
        return max(self.timeout_s - 2 * self.interval_s - 0.5, self.timeout_s / 2)

    # ------------------------------------------------------------- watching

    def watch(
        self,
        key: int,
        *,
        name: str,
        role: str | None,
        actors: list[Any],
        processes: list[tuple[str, int]],
        addresses: dict[str, str] | None = None,
    ) -> None:
        """Probe the ranks of a started group (``processes``: (Ray node id, pid) per rank;
        ``addresses``: Ray node id -> address, to name a rank's node before it answers)."""
        addresses = addresses or {}
        ranks = {
            r: _Rank(actor=a, node_id=node, pid=pid, node_ip=addresses.get(node, "?"))
            for r, (a, (node, pid)) in enumerate(zip(actors, processes, strict=True))
        }
        with self._lock:
            self._groups[key] = _Group(name, role, ranks)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rlcore-liveness", daemon=True)
                self._thread.start()
        self._wake.set()

    def replace(self, key: int, rank: int, actor: Any, process: tuple[str, int], address: str = "?") -> None:
        """Rank ``rank`` of a watched group runs in a new actor now (an engine started again)."""
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                group.ranks[rank] = _Rank(actor=actor, node_id=process[0], pid=process[1], node_ip=address)

    def drop(self, key: int, rank: int) -> None:
        """Stop probing one rank (it is being killed and started again)."""
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                group.ranks.pop(rank, None)

    def unwatch(self, key: int) -> None:
        """Stop probing a group (it is being shut down)."""
        with self._lock:
            self._groups.pop(key, None)

    def where(self, key: int, rank: int) -> str:
        """The node address rank ``rank`` of group ``key`` last answered from (``?`` unknown)."""
        with self._lock:
            group = self._groups.get(key)
            found = group.ranks.get(rank) if group is not None else None
            return found.node_ip if found is not None else "?"

    def clear(self) -> None:
        """Forget every group (the cluster is going away)."""
        with self._lock:
            self._groups.clear()

    def hung(self, key: int | None = None) -> list[Hang]:
        """The ranks declared hung, of group ``key`` or of every watched group."""
        with self._lock:
            groups = list(self._groups.values()) if key is None else [g for k, g in self._groups.items() if k == key]
            return [r.hang for g in groups for r in g.ranks.values() if r.hang is not None]

    def raise_if_hung(self, what: str) -> None:
        """Raise :class:`WorkerHung` for the first hung rank, naming ``what`` as the phase."""
        hangs = self.hung()
        if hangs:
            raise WorkerHung(hangs[0], what, self.timeout_s)

    # -------------------------------------------------------------- probing

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._groups:
                    self._thread = None
                    return
            try:
                with RAY_GATE.call("liveness probes"):
                    self._tick(time.monotonic())
            except Cancelled:
                pass  # the cluster is shutting down; its groups go with it
            except Exception as err:  # the monitor must outlive a failed probe round
                log.debug("liveness probe round failed: %s", err)
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _tick(self, now: float) -> None:
        import ray

        here = ray.get_runtime_context().get_node_id()
        with self._lock:
            watched = [(g, r, rank) for g in self._groups.values() for r, rank in g.ranks.items()]
        flying = [rank.in_flight for _, _, rank in watched if rank.in_flight is not None]
        ready = set(ray.wait(flying, num_returns=len(flying), timeout=0)[0]) if flying else set()
        for group, r, rank in watched:
            if rank.dead or rank.hang is not None:
                continue
            if rank.in_flight is not None and rank.in_flight in ready:
                self._answered(rank, rank.in_flight, now)
            if rank.in_flight is None and not rank.dead:
                rank.in_flight = getattr(rank.actor, PROBE_METHOD).options(concurrency_group=PROBE_GROUP).remote()
            if rank.answered_at is not None and now - rank.answered_at > self.silence_s:
                rank.hang = Hang(group.name, group.role, r, rank.node_ip, rank.pid, now - rank.answered_at, self._cause(rank, now, local=rank.node_id == here))
                log.error("%s hung: %s", rank.hang.describe(), rank.hang.cause)

    def _answered(self, rank: _Rank, ref: Any, now: float) -> None:
        import ray

        rank.in_flight = None
        try:
            answer = ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            rank.dead = True  # a death is the call's to report (WorkerLost), not a hang
            return
        except Exception as err:  # a probe that raised still shows a live process
            answer = {"pid": rank.pid, "node_ip": rank.node_ip, "stopped": []}
            log.debug("liveness probe raised: %s", err)
        rank.node_ip = answer.get("node_ip", rank.node_ip)
        rank.stopped = list(answer.get("stopped", []))
        if not rank.stopped or rank.answered_at is None:
            rank.answered_at = now

    def _cause(self, rank: _Rank, now: float, *, local: bool) -> str:
        silent = now - (rank.answered_at or now)
        if rank.stopped:
            kids = ", ".join(f"pid {c['pid']} ({c['name']})" for c in rank.stopped)
            return f"its child process {kids} has been stopped for {silent:.0f}s"
        return f"it answered no liveness probe for {silent:.0f}s{_state_of(rank.pid) if local else ''}"


def _state_of(pid: int | None) -> str:
    """``; its process is stopped`` and the like (``pid`` is on this host)."""
    if pid is None:
        return ""
    try:
        import psutil

        status = psutil.Process(pid).status()
    except Exception:  # another host's process, or gone
        return ""
    return f"; its process is {status}" if status != "running" else ""


#: The process's monitor: configured by :meth:`rlcore.runtime.cluster.Cluster.start`,
#: fed by :class:`rlcore.runtime.worker_group.WorkerGroup`, asked by every ``ray_get``.
LIVENESS = LivenessMonitor()

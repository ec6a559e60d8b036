"""Worker groups: N Ray actors of one plain Python class, forming a torch.distributed group.

Backends write their workers as plain classes (:class:`DistributedWorker` subclasses,
unit-testable without Ray); :class:`WorkerGroup` runs them as Ray actors,
wires their process group (gloo on CPU, NCCL on GPU), calls them with deadlines and
cancellation (:func:`rlcore.runtime.waits.ray_get`), restarts a rank alone, and shuts
them down with a report of the ranks that hung.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any, TypedDict, Unpack

from rlcore.config.placement import RolePlacement
from rlcore.errors import Cancelled, CancelToken, Deadline, WorkerError
from rlcore.runtime.gate import RAY_GATE
from rlcore.runtime.liveness import (
    LIVENESS,
    PROBE_GROUP,
    PROBE_METHOD,
    describe_worker,
    is_stopped,
    liveness_answer,
)
from rlcore.runtime.placed import node_addresses, record_placed
from rlcore.runtime.proc import kill_all, processes_of, wait_exited
from rlcore.runtime.rendezvous import listening_address, tcp_store
from rlcore.runtime.resources import actor_runtime_env, check_fits
from rlcore.runtime.waits import ray_get

log = logging.getLogger(__name__)

#: The concurrency group (one thread) of the actors of a class that takes refits while a
#: call is busy (``inflight_refit = True``, see
#: :class:`rlcore.runtime.generation_group.EngineWorker`): the refit-side calls go there.
REFIT_GROUP = "rlcore_refit"


class DistributedWorker:
    """Base for worker classes: rank bookkeeping and torch.distributed setup.

    Subclasses are plain classes; methods run inside Ray actors (or directly in tests).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the group's store meets (:func:`listening_address`)."""
        return listening_address()

    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> None:
        """Join the group's default process group; rank 0 serves the rendezvous store
        (:func:`tcp_store`: only on loopback when ``master_addr`` is loopback)."""
        import datetime

        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        store = tcp_store(master_addr, master_port, self.world_size, self.rank == 0, timeout_s)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def process_ids(self) -> tuple[str, int]:
        """(Ray node id, pid) of this worker's process (what shutdown waits for)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def ping(self) -> int:
        return os.getpid()

    def rlcore_liveness(self) -> dict[str, Any]:
        """The liveness probe (:mod:`rlcore.runtime.liveness`): runs on a thread of its own,
        beside whatever call is busy; do not override it with anything that can block."""
        return liveness_answer()

    def teardown(self) -> None:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as err:  # teardown must not raise
            log.warning("rank %d: destroy_process_group failed: %s", self.rank, err)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """What a worker group is made of: kept whole, so a rank starts again as it started
    (:meth:`WorkerGroup.restart_rank`).

    Attributes:
        cls: the worker class; constructed as ``cls(rank, world_size, *args, **kwargs)``.
        world_size: number of ranks.
        name: group name used in errors and actor names.
        args, kwargs: the worker class's further arguments.
        num_cpus, num_gpus: Ray resources per actor.
        env: environment variables of the actors' processes.
        dist_backend: ``gloo``/``nccl`` to form a torch.distributed group, or None.
        timeout_s: the default deadline of a call, and the process group's timeout.
        placement: the nodes the actors may run on (``ctx.placement`` of the init hook);
            ``None`` or unpinned: wherever Ray finds room.
    """

    cls: type
    world_size: int
    name: str
    args: Sequence[Any] = ()
    kwargs: dict[str, Any] | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    env: dict[str, str] | None = None
    dist_backend: str | None = "gloo"
    timeout_s: float = 300.0
    placement: RolePlacement | None = None

    def __post_init__(self) -> None:
        # Copies: a caller that changes its arguments later does not change a restart.
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs or {}))

    @property
    def role(self) -> str | None:
        """The role the group serves (from its placement), if it has one."""
        return self.placement.role if self.placement is not None else None


class GroupOptions(TypedDict, total=False):
    """:class:`WorkerGroup`'s keywords beyond class, size and name (see :class:`GroupSpec`)."""

    args: Sequence[Any]
    kwargs: dict[str, Any] | None
    num_cpus: float
    num_gpus: float
    env: dict[str, str] | None
    dist_backend: str | None
    timeout_s: float
    placement: RolePlacement | None


def _this_node() -> str | None:
    """This process's Ray node id (known locally, without asking the GCS); ``None`` if unknown."""
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None


class WorkerGroup:
    """N actors of ``cls`` (a :class:`DistributedWorker` subclass), ranks 0..N-1.

    Each actor runs its calls one at a time on a default thread; besides, the liveness
    probe has a thread of its own, and so do the refit-side calls of a class that takes
    refits while a call is busy (:attr:`refit_group`).

    Args:
        cls, world_size, name, and ``options`` (args, kwargs, num_cpus, num_gpus, env,
            dist_backend, timeout_s, placement): the group, as :class:`GroupSpec` documents
            them. :attr:`nodes` says where each rank landed, and
            :func:`rlcore.runtime.placed.placed_groups` lists every group started.
        cancel: ends starting and every call once cancelled.
        deadline: bounds the start (default: none).
    """

    def __init__(
        self,
        cls: type,
        world_size: int,
        *,
        name: str,
        cancel: CancelToken | None = None,
        deadline: Deadline | None = None,
        **options: Unpack[GroupOptions],
    ) -> None:
        self.spec = GroupSpec(cls, world_size, name, **options)
        self.name = name
        self.cancel = cancel
        self.actors: list[Any] = []
        self._processes: list[tuple[str, int]] = []  # (Ray node id, pid) per rank
        self.nodes: list[str] = []  # Ray node id per rank, once started
        self.start_time_s = 0.0
        t0 = time.monotonic()
        self._prepare()
        try:
            self._start_ranks(deadline)
            if self.spec.dist_backend:
                self._form_process_group(deadline)
        except BaseException:
            self.shutdown()
            raise
        self.start_time_s = time.monotonic() - t0

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def placement(self) -> RolePlacement | None:
        return self.spec.placement

    @property
    def timeout_s(self) -> float:
        return self.spec.timeout_s

    @property
    def refit_group(self) -> str | None:
        """:data:`REFIT_GROUP` when the class takes refits while a call is busy (its
        ``inflight_refit`` is true), else None: every call then runs on the one default
        thread, one after the other."""
        return REFIT_GROUP if getattr(self.spec.cls, "inflight_refit", False) else None

    def _prepare(self) -> None:
        """Check the cluster can hold the group and make the actor class and its options."""
        import ray

        spec = self.spec
        with RAY_GATE.call(f"starting {self.name} workers"):
            if self.cancel is not None:
                self.cancel.raise_if_cancelled(f"starting {self.name} workers")
            check_fits(self.name, spec.world_size, spec.num_cpus, spec.num_gpus, spec.placement)
            # The probe's own thread answers while the default group's call is busy.
            self._probed = LIVENESS.enabled and hasattr(spec.cls, PROBE_METHOD)
            groups = {PROBE_GROUP: 1} if self._probed else {}
            if self.refit_group is not None:
                groups[REFIT_GROUP] = 1  # a refit runs beside a busy generate
            self._remote_cls = ray.remote(concurrency_groups=groups)(spec.cls) if groups else ray.remote(spec.cls)
            runtime_env = actor_runtime_env(spec.env)
        self._actor_options: dict[str, Any] = {
            "num_cpus": spec.num_cpus,
            "num_gpus": spec.num_gpus,
            **({"runtime_env": runtime_env} if runtime_env else {}),
            "name": None,
            "max_restarts": 0,
        }

    def _start_ranks(self, deadline: Deadline | None) -> None:
        """Start every rank's actor, learn its process, and have the liveness monitor watch it."""
        for rank in range(self.world_size):
            with RAY_GATE.call(f"starting {self.name} rank {rank}"):
                if self.cancel is not None:
                    self.cancel.raise_if_cancelled(f"starting {self.name} workers")
                self.actors.append(self._new_actor(rank))
        self._processes = ray_get(
            [a.process_ids.remote() for a in self.actors],
            what=f"starting {self.name} workers", cancel=self.cancel, deadline=deadline,
        )
        self.nodes = [node for node, _ in self._processes]
        if self._probed:
            LIVENESS.watch(
                id(self), name=self.name, role=self.spec.role,
                actors=list(self.actors), processes=list(self._processes), addresses=node_addresses(),
            )
        record_placed(self.name, self.spec.role, self.nodes)

    def _form_process_group(self, deadline: Deadline | None) -> None:
        """Rank 0 serves the rendezvous; every rank joins the default process group."""
        addr, port = ray_get(
            self.actors[0].rendezvous_address.remote(), what=f"{self.name} rendezvous", cancel=self.cancel, deadline=deadline
        )
        self.call(
            "init_process_group", addr, port, self.spec.dist_backend, self.timeout_s,
            what=f"{self.name} process group", deadline=deadline,
        )

    def _new_actor(self, rank: int) -> Any:
        placed = self.placement.ray_options(rank) if self.placement is not None else {}
        return self._remote_cls.options(**self._actor_options, **placed).remote(
            rank, self.world_size, *self.spec.args, **(self.spec.kwargs or {})
        )

    def restart_rank(self, rank: int, *, deadline: Deadline | None = None) -> None:
        """Replace rank ``rank``'s actor by a new one, built as at the start (the other ranks
        keep running and serving): the old one's processes are SIGKILLed on this host and
        the actor killed in Ray. Only for groups without a process group (independent
        engines): a rank cannot rejoin a torch.distributed group alone. The new actor is
        constructed and probed like the others; the caller starts what it serves."""
        import ray

        if self.spec.dist_backend:
            raise WorkerError(f"{self.name}: rank {rank} is part of a process group and cannot be restarted alone")
        key = id(self)
        LIVENESS.drop(key, rank)  # its hang is being handled: no wait may raise it again
        with RAY_GATE.call(f"{self.name}: killing rank {rank}"):
            kill_all(self._local_processes_of([rank]))
            with contextlib.suppress(Exception):
                ray.kill(self.actors[rank], no_restart=True)
            self.actors[rank] = self._new_actor(rank)
        self._processes[rank] = ray_get(
            self.actors[rank].process_ids.remote(),
            what=f"restarting {self.name} rank {rank}",
            cancel=self.cancel,
            deadline=deadline or Deadline(self.timeout_s, f"restarting {self.name} rank {rank}"),
            labels=[f"{self.name} rank {rank}"],
            ranks=[rank],
        )
        self.nodes[rank] = self._processes[rank][0]
        if self._probed:
            address = node_addresses().get(self.nodes[rank], "?")
            LIVENESS.replace(key, rank, self.actors[rank], self._processes[rank], address)

    def call_async(self, method: str, *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any) -> list[Any]:
        ranks = range(self.world_size) if ranks is None else ranks
        with RAY_GATE.call(f"{self.name}: {method}"):
            if self.cancel is not None:
                self.cancel.raise_if_cancelled(f"{self.name}: {method}")
            return [getattr(self.actors[r], method).remote(*args, **kwargs) for r in ranks]

    def get(
        self, refs: Any, *, what: str, deadline: Deadline | None = None, ranks: Sequence[int] | None = None
    ) -> Any:
        """Wait for ``refs`` (one per rank of ``ranks``, default every rank when there are as
        many); a failure names the rank (:class:`WorkerLost` carries it as ``rank``)."""
        deadline = deadline or Deadline(self.timeout_s, f"{self.name}: {what}")
        if ranks is None and isinstance(refs, list | tuple) and len(refs) == self.world_size:
            ranks = range(self.world_size)
        return ray_get(
            refs, what=f"{self.name}: {what}", cancel=self.cancel, deadline=deadline,
            labels=self.labels(ranks), ranks=ranks,
        )

    def labels(self, ranks: Sequence[int] | None) -> list[str] | None:
        """Names for refs of ``ranks`` (``<group> rank <i>``)."""
        return None if ranks is None else [f"{self.name} rank {r}" for r in ranks]

    def call(self, method: str, *args: Any, what: str | None = None, deadline: Deadline | None = None, ranks: Sequence[int] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank (or ``ranks``) and wait for all results."""
        return self.get(
            self.call_async(method, *args, ranks=ranks, **kwargs), what=what or method, deadline=deadline,
            ranks=None if ranks is None else list(ranks),
        )

    def pids(self) -> list[int]:
        return list(self.call("ping", what="ping"))

    def shutdown(self, graceful_s: float = 10.0, exit_s: float = 10.0) -> list[str]:
        """Tear every actor down and return once its processes have exited.

        A graceful ``teardown`` with a deadline of ``graceful_s``, then ``ray.kill``;
        then wait up to ``exit_s`` for the workers' processes on this host (and their
        children, e.g. an engine's subprocesses) to exit, and SIGKILL what is left.
        Idempotent; never raises for a worker that is already dead.

        Once the run is cancelled (an interrupt, another task's failure), or a rank of the
        group was declared hung (:mod:`rlcore.runtime.liveness`; its peers may be waiting
        on it in a collective), the graceful step is skipped: an actor busy in a long call
        would only run ``teardown`` after it; a hung rank's processes are SIGKILLed at once.
        When the cluster is shutting down (:data:`RAY_GATE` closed) no Ray call is made at
        all: the processes recorded at start are killed directly.

        Returns one line per rank that hung during the shutdown itself (its teardown did
        not return within ``graceful_s`` while its process was stopped), naming it.
        """
        import ray

        key = id(self)
        hung = {h.rank for h in LIVENESS.hung(key)}
        problems: list[str] = []
        if not self.actors:
            LIVENESS.unwatch(key)
            return problems
        if not ray.is_initialized():
            # The cluster is gone and its workers with it; no Ray call may follow (with
            # auto-init on, one would start a new local cluster).
            LIVENESS.unwatch(key)
            self.actors, self._processes = [], []
            return problems
        try:
            with RAY_GATE.call(f"{self.name}: shutdown"):
                procs = self._local_processes()
                problems = self._release_ranks(hung, graceful_s)
                self._kill_actors()
        except Cancelled:
            # The cluster is going down (or its head is gone): kill this host's worker
            # processes ourselves (a pid of another host's worker means nothing here).
            procs = processes_of([pid for node, pid in self._processes if node == _this_node()])
            kill_all(procs)
        finally:
            LIVENESS.unwatch(key)
        if problems:  # a stopped process will not exit on ray.kill: no point waiting for it
            kill_all(self._local_processes_of([r for r in range(len(self._processes)) if self._stopped(r)]))
        self.actors = []
        self._processes = []
        self._reap(procs, exit_s)
        for line in problems:
            log.error("%s", line)
        return problems

    def _release_ranks(self, hung: set[int], graceful_s: float) -> list[str]:
        """SIGKILL the ``hung`` ranks' processes, or (no rank hung, run not cancelled) ask
        every rank to tear down; returns a line per rank that hung during its teardown."""
        if hung:
            kill_all(self._local_processes_of(sorted(hung)))
            return []
        if self.cancel is not None and self.cancel.cancelled:
            return []
        late = self._teardown(graceful_s)
        return [self._late_line(r, graceful_s) for r in late if self._stopped(r)]

    def _kill_actors(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as err:
                log.debug("%s: ray.kill failed: %s", self.name, err)

    def _reap(self, procs: Sequence[Any], exit_s: float) -> None:
        """Wait up to ``exit_s`` for ``procs`` to exit; SIGKILL the ones left."""
        left = wait_exited(procs, exit_s)
        if left:
            log.warning(
                "%s: %d worker process(es) still alive %gs after ray.kill; SIGKILL: %s",
                self.name, len(left), exit_s, [p.pid for p in left],
            )
            kill_all(left)
            left = wait_exited(left, 5.0)
            if left:
                log.error("%s: processes %s survived SIGKILL", self.name, [p.pid for p in left])

    def _teardown(self, graceful_s: float) -> list[int]:
        """Ask every rank to release its resources (``teardown``), bounded by ``graceful_s``;
        returns the ranks whose teardown did not return in time."""
        import ray

        try:
            refs = [a.teardown.remote() for a in self.actors]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=graceful_s)
            return [r for r, ref in enumerate(refs) if ref not in done]
        except Exception as err:  # dead actors cannot tear down; kill them anyway
            log.debug("%s: graceful teardown failed: %s", self.name, err)
            return []

    def _local_processes(self) -> list[Any]:
        """The workers' processes on this host, with their descendants (``psutil.Process``)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        # Another host's process: ray.kill is all the driver can do.
        return processes_of([pid for node, pid in self._processes if node == here])

    def _local_processes_of(self, ranks: Sequence[int]) -> list[Any]:
        """The processes (with descendants) of ``ranks`` that run on this host."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        return processes_of([self._processes[r][1] for r in ranks if self._processes[r][0] == here])

    def _stopped(self, rank: int) -> bool:
        """Whether rank ``rank``'s process, or one of its children, is stopped (this host only)."""
        return any(is_stopped(p) for p in self._local_processes_of([rank]))

    def _late_line(self, rank: int, graceful_s: float) -> str:
        who = describe_worker(self.name, self.spec.role, rank, LIVENESS.where(id(self), rank), self._processes[rank][1])
        return (
            f"{who} hung during shutdown: its teardown did not return within {graceful_s:g}s "
            "and its process is stopped; killed"
        )

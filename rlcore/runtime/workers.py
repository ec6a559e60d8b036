"""Worker groups: N Ray actors of one plain Python class, forming a torch.distributed group.

Backends write their workers as plain classes (unit-testable without Ray);
:class:`WorkerGroup` wraps them as Ray actors, wires their process group (gloo
on CPU, NCCL on GPU) and calls them with deadlines and cancellation. Every
``get`` polls in short slices so a cancelled run never waits on a dead peer.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from rlcore.config.placement import Network, RolePlacement

# WorkerError and WorkerLost live in the contract (rlcore.errors); importing them from
# here keeps working.
from rlcore.errors import (
    Cancelled,
    CancelToken,
    ConfigError,
    Deadline,
    DeadlineExceeded,
    WorkerError,
    WorkerLost,
)
from rlcore.runtime.gate import RAY_GATE, RayGate  # noqa: F401  (re-exported: callers import them from here)
from rlcore.runtime.liveness import (
    LIVENESS,
    PROBE_GROUP,
    PROBE_METHOD,
    describe_worker,
    is_stopped,
    liveness_answer,
)

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` or ``localhost``: an address no other host can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (None when none does)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == address for a in addrs):
                return str(name)
    except Exception as err:  # pragma: no cover - psutil missing or no permission
        log.debug("cannot list network interfaces: %s", err)
    return None


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 (``lo`` on Linux)."""
    return interface_of("127.0.0.1") or "lo"


def pin_collectives_to(host: str) -> None:
    """Make gloo listen where the rendezvous is: on the loopback interface when ``host``
    is loopback (a single-host run then opens no port that another host can reach, and
    NCCL's bootstrap is pinned there too); otherwise on the interface that holds this
    process's node address, the one Ray reaches the node by, so ranks on other nodes
    reach this one whatever the host name resolves to (often 127.0.1.1).

    Sets ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` for loopback) in this process
    unless the user chose an interface; process groups created afterwards pick it up.
    """
    if is_loopback(host):
        iface = loopback_interface()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
        return
    own = interface_of(node_ip())
    if own is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", own)


#: Listening sockets of stores this process will serve, by (host, port): see :func:`listen_ahead`.
_LISTENING: dict[tuple[str, int], socket.socket] = {}
_listening_lock = threading.Lock()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_ahead(host: str) -> int:
    """Listen on a free port of ``host`` now, for a rendezvous store this process will
    serve later (:func:`tcp_store` with ``is_master`` takes the socket); returns the port.

    The ranks of a rendezvous are told the address at once and race to it: a client whose
    connect came before the master's store listened was refused, and torch's client
    retries only after a backoff (0.3-0.5 s measured, against milliseconds when the server
    listens first). Listening from the moment the address is handed out, a client that
    comes first waits in the socket's backlog. The port is the kernel's choice, held from
    then on, so nothing else can take it between the answer and the store.
    """
    sock = _listen(host, 0)
    port = int(sock.getsockname()[1])
    with _listening_lock:
        _LISTENING[(host, port)] = sock
    return port


def listening_address() -> tuple[str, int]:
    """This process's node address and a port already listening there (:func:`listen_ahead`):
    what rank 0 answers when asked where a store it will serve meets."""
    host = node_ip()
    return host, listen_ahead(host)


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> Any:
    """A ``torch.distributed.TCPStore`` for rendezvous at ``host:port``.

    torch's store server listens on every interface whatever ``host`` says, so the
    master binds the listening socket to ``host`` itself and hands it to the store: on
    loopback (a single-host run) the store answers only on this host; on a node's
    address (a run across nodes) only on that address, not on every interface. The
    socket :func:`listen_ahead` opened for ``host:port`` is used where there is one.
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    pin_collectives_to(host)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master, timeout=timeout)
    with _listening_lock:
        sock = _LISTENING.pop((host, port), None)
    if sock is None:
        sock = _listen(host, port)
    # The store owns the descriptor from here on (it closes it), so the socket object lets go.
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, master_listen_fd=sock.detach())


def server_host(network: Network | None) -> str:
    """The address a server of this process binds: loopback when the run has no reader
    on another node (:class:`rlcore.config.placement.Network`), else this node's address."""
    return node_ip() if network is not None and network.readers_elsewhere else "127.0.0.1"


def node_ip() -> str:
    """This process's address for rendezvous: the Ray node's address, which is loopback
    for rlcore's embedded single-host cluster (:mod:`rlcore.runtime.cluster`)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # pragma: no cover - fallback outside Ray
        pass
    return "127.0.0.1"


def require_ray(backend: str, role: str) -> None:
    """Raise unless this process is connected to Ray (a backend's init starts its
    workers in the run's cluster)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            f"the {backend} {role} backend needs a running Ray cluster: start one with "
            f"rlcore.runtime.cluster.Cluster(config.cluster).start() before calling rlcore_init_{role} "
            "(`rlcore run` does this)"
        )


def resolve_worker_device(requested: str, *, backend: str, section: str) -> str:
    """``<section>.options.device`` of ``backend``: ``cpu``, ``cuda``, or ``auto`` (CUDA when
    the Ray cluster has a GPU); ConfigError for anything else."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(
            f"{section}.options.device of backend '{backend}' is {requested!r}; use auto, cpu or cuda",
            key=f"{section}.options.device",
        )
    if requested != "auto":
        return requested
    return "cuda" if cluster_has_gpu() else "cpu"


def cluster_has_gpu() -> bool:
    """Whether the Ray cluster this process is connected to has a GPU: engines and ranks
    then run on CUDA (each actor gets one from Ray)."""
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1


def device_resources(
    device: str, devices_per_worker: float, threads_per_worker: int = 0
) -> tuple[dict[str, Any], int]:
    """:class:`WorkerGroup`'s ``num_cpus``, ``num_gpus`` and ``dist_backend`` for ranks on
    ``device``, and each rank's torch threads (``threads_per_worker``, 0: the default).

    On ``cuda`` a rank holds ``devices_per_worker`` GPUs (a fraction of one GPU when
    colocated ranks share it, as :func:`rlcore.config.placement.device_layout` bundles them) and one
    CPU (NCCL, one thread by default); on ``cpu`` ``devices_per_worker`` CPUs (gloo, as many
    threads): the convention of ``<role>.devices_per_worker`` that the preflight checks.
    """
    if device == "cuda":
        resources = {"num_cpus": 1.0, "num_gpus": float(devices_per_worker), "dist_backend": "nccl"}
        return resources, threads_per_worker or 1
    resources = {"num_cpus": float(devices_per_worker), "num_gpus": 0.0, "dist_backend": "gloo"}
    return resources, threads_per_worker or max(1, int(devices_per_worker))


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


def _failure(ray: Any, ref: Any) -> tuple[bool, BaseException] | None:
    """(is a worker death, error) for a finished ref that failed; None if it succeeded."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as err:
        return True, err
    except ray.exceptions.RayTaskError as err:
        return False, err.cause if getattr(err, "cause", None) is not None else err
    return None


def ray_get(
    refs: Any,
    *,
    what: str,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
    slice_s: float = 0.2,
    labels: Sequence[str] | None = None,
    settle_s: float = 2.0,
    ranks: Sequence[int] | None = None,
) -> Any:
    """``ray.get`` that observes cancellation and a deadline, and names ``what`` on failure.

    ``labels`` (one per ref, e.g. ``vllm-generation rank 0``) name the worker in
    errors; ``ranks`` (one per ref) say which rank of its group each ref's worker is
    (:attr:`WorkerLost.rank`, what a replacement restarts). When one ref fails, the others get ``settle_s`` to finish: a worker
    that *died* is the root cause and is reported before the errors it caused in
    its peers (a collective partner sees only a closed connection).
    """
    single = not isinstance(refs, list | tuple)
    pending = [refs] if single else list(refs)
    if not pending:
        # Handles that did their work in the driver return no refs; ray.wait([])
        # would start a local cluster.
        return []
    import ray

    names = list(labels) if labels is not None else [f"worker {i}" for i in range(len(pending))]
    deadline = deadline or Deadline.never(what)
    while True:
        # Checked before every slice: a cancelled run (or a closed cluster) makes no
        # further Ray call from this thread, even one the executor has abandoned.
        if cancel is not None and cancel.cancelled:
            raise Cancelled(f"{what} cancelled: {cancel.reason}")
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"{what} did not finish within {deadline.seconds:g}s")
        # A frozen worker anywhere in the run ends this wait too: in a synchronous run
        # nothing can finish without it, and the error names it (role, rank, pid).
        LIVENESS.raise_if_hung(what)
        timeout = slice_s if remaining is None else min(slice_s, remaining)
        with RAY_GATE.call(what):
            ready, not_ready = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            # Surface a failure as soon as any worker fails, not after the slowest finishes.
            if any(_failure(ray, r) for r in ready):
                _raise_first_failure(ray, pending, not_ready, names, what, settle_s, ranks)
            if not not_ready:
                values = ray.get(pending)
                return values[0] if single else values


def _raise_first_failure(
    ray: Any, pending: list[Any], not_ready: list[Any], names: list[str], what: str, settle_s: float,
    ranks: Sequence[int] | None = None,
) -> None:
    """Raise a WorkerError for the failed refs, a dead worker's first (see :func:`ray_get`)."""
    if not_ready:
        ray.wait(not_ready, num_returns=len(not_ready), timeout=settle_s)
    failures = []
    for i, r in enumerate(pending):
        done, _ = ray.wait([r], timeout=0)
        found = _failure(ray, r) if done else None
        if found:
            failures.append((not found[0], i, found))  # deaths sort first
    _, i, (died, err) = min(failures, key=lambda f: (f[0], f[1]))
    others = [f"{names[j]}: {type(e).__name__}" for _, j, (_, e) in failures if j != i]
    also = f" (then: {'; '.join(others)})" if others else ""
    if died:
        rank = ranks[i] if ranks is not None else None
        raise WorkerLost(f"{what}: {names[i]} died: {err}{also}", worker=names[i], index=i, rank=rank) from err
    raise WorkerError(f"{what}: {names[i]} failed: {type(err).__name__}: {err}{also}") from err


#: The environment every worker of the embedded cluster inherits from its raylet
#: (:func:`rlcore.runtime.cluster._worker_environment`); empty for any other cluster.
WORKER_ENV: dict[str, str] = {}


def actor_runtime_env(env: dict[str, str] | None) -> dict[str, Any] | None:
    """The per-actor ``runtime_env`` that gives an actor ``env``: only the variables its
    worker would not have anyway (from the embedded cluster's :data:`WORKER_ENV` or the
    job's runtime environment, which a joined cluster's workers get); ``None`` when none.

    An actor without a runtime environment of its own runs in one of the workers Ray
    starts ahead of time (one per CPU, while ``ray.init`` returns); any other makes Ray
    start a fresh worker process for it (Python, ``import ray``, the core worker: a
    second or more of a core on a small host) and end an idle one.
    """
    import ray

    job = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    have = {**WORKER_ENV, **job}
    extra = {k: v for k, v in (env or {}).items() if have.get(k) != v}
    return {"env_vars": extra} if extra else None


def _check_fits(name: str, world_size: int, num_cpus: float, num_gpus: float, placement: RolePlacement | None = None) -> None:
    """Fail at once when the cluster can never hold the group (Ray would wait forever)."""
    import ray

    total = ray.cluster_resources()
    where = "the Ray cluster"
    if placement is not None and placement.pinned:
        key = f"placement.nodes.{placement.role}"
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        chosen = [n for n in nodes if placement.matches(n.get("Resources", {}), n.get("Labels", {}))]
        if not chosen:
            raise WorkerError(
                f"{name}: no alive node of the Ray cluster has {placement.describe()} ({key}); "
                f"the nodes have resources {sorted({r for n in nodes for r in n.get('Resources', {})})} "
                f"and labels {sorted({f'{k}={v}' for n in nodes for k, v in n.get('Labels', {}).items() if not k.startswith('ray.io/')})}; "
                f"fix {key} or start the nodes with them (ray start --resources / --labels)"
            )
        # The group fits only on the nodes the selector picks.
        total = {kind: sum(n["Resources"].get(kind, 0.0) for n in chosen) for kind in ("CPU", "GPU")}
        where = f"the {len(chosen)} node(s) {key} selects"
    for kind, per in (("CPU", num_cpus), ("GPU", num_gpus)):
        need = per * world_size
        if need > total.get(kind, 0.0) + 1e-9:
            raise WorkerError(
                f"{name}: {world_size} workers x {per:g} {kind} = {need:g} {kind}, but {where} "
                f"has {total.get(kind, 0.0):g}; lower <role>.workers or <role>.devices_per_worker, "
                "or give the cluster more (cluster.num_cpus / cluster.num_gpus)"
            )


class WorkerGroup:
    """N actors of ``cls`` (a :class:`DistributedWorker` subclass), ranks 0..N-1.

    Args:
        cls: the worker class; constructed as ``cls(rank, world_size, *args, **kwargs)``.
        world_size: number of ranks.
        name: group name used in errors and actor names.
        num_cpus, num_gpus: Ray resources per actor.
        env: environment variables of the actors' processes.
        dist_backend: ``gloo``/``nccl`` to form a torch.distributed group, or None.
        placement: the nodes the actors may run on (``ctx.placement`` of the init hook);
            ``None`` or unpinned: wherever Ray finds room. :attr:`nodes` says where
            each rank landed, and :func:`placed_groups` lists every group started.
    """

    def __init__(
        self,
        cls: type,
        world_size: int,
        *,
        name: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env: dict[str, str] | None = None,
        dist_backend: str | None = "gloo",
        timeout_s: float = 300.0,
        cancel: CancelToken | None = None,
        deadline: Deadline | None = None,
        placement: RolePlacement | None = None,
    ) -> None:
        import ray

        self.name = name
        self.placement = placement
        self.world_size = world_size
        self.cancel = cancel
        self.timeout_s = timeout_s
        self.actors: list[Any] = []
        self._processes: list[tuple[str, int]] = []  # (Ray node id, pid) per rank
        self.nodes: list[str] = []  # Ray node id per rank, once started
        self.start_time_s = 0.0
        t0 = time.monotonic()
        with RAY_GATE.call(f"starting {name} workers"):
            if cancel is not None:
                cancel.raise_if_cancelled(f"starting {name} workers")
            _check_fits(name, world_size, num_cpus, num_gpus, placement)
            # The probe's own thread answers while the default group's call is busy.
            probed = LIVENESS.enabled and hasattr(cls, PROBE_METHOD)
            remote_cls = ray.remote(concurrency_groups={PROBE_GROUP: 1})(cls) if probed else ray.remote(cls)
            runtime_env = actor_runtime_env(env)
        # What starting a rank takes, kept for restart_rank (an engine started again alone).
        self._remote_cls, self._args, self._kwargs = remote_cls, tuple(args), dict(kwargs or {})
        self._actor_options: dict[str, Any] = {
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            **({"runtime_env": runtime_env} if runtime_env else {}),
            "name": None,
            "max_restarts": 0,
        }
        self._probed, self._dist_backend = probed, dist_backend
        try:
            for rank in range(world_size):
                with RAY_GATE.call(f"starting {name} rank {rank}"):
                    if cancel is not None:
                        cancel.raise_if_cancelled(f"starting {name} workers")
                    self.actors.append(self._new_actor(rank))
            self._processes = ray_get(
                [a.process_ids.remote() for a in self.actors], what=f"starting {name} workers", cancel=cancel, deadline=deadline
            )
            self.nodes = [node for node, _ in self._processes]
            if probed:
                LIVENESS.watch(
                    id(self), name=name, role=placement.role if placement else None,
                    actors=list(self.actors), processes=list(self._processes), addresses=_node_addresses(),
                )
            _PLACED.append({"group": name, "role": placement.role if placement else None, "nodes": list(self.nodes)})
            if dist_backend:
                addr, port = ray_get(self.actors[0].rendezvous_address.remote(), what=f"{name} rendezvous", cancel=cancel, deadline=deadline)
                self.call("init_process_group", addr, port, dist_backend, timeout_s, what=f"{name} process group", deadline=deadline)
        except BaseException:
            self.shutdown()
            raise
        self.start_time_s = time.monotonic() - t0

    def _new_actor(self, rank: int) -> Any:
        placed = self.placement.ray_options(rank) if self.placement is not None else {}
        return self._remote_cls.options(**self._actor_options, **placed).remote(
            rank, self.world_size, *self._args, **self._kwargs
        )

    def restart_rank(self, rank: int, *, deadline: Deadline | None = None) -> None:
        """Replace rank ``rank``'s actor by a new one, built as at the start (the other ranks
        keep running and serving): the old one's processes are SIGKILLed on this host and
        the actor killed in Ray. Only for groups without a process group (independent
        engines): a rank cannot rejoin a torch.distributed group alone. The new actor is
        constructed and probed like the others; the caller starts what it serves."""
        import ray

        if self._dist_backend:
            raise WorkerError(f"{self.name}: rank {rank} is part of a process group and cannot be restarted alone")
        key = id(self)
        LIVENESS.drop(key, rank)  # its hang is being handled: no wait may raise it again
        with RAY_GATE.call(f"{self.name}: killing rank {rank}"):
            _kill_all(self._local_processes_of([rank]))
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
            address = _node_addresses().get(self.nodes[rank], "?")
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

    def _local_processes(self) -> list[Any]:
        """The workers' processes on this host, with their descendants (``psutil.Process``)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        # Another host's process: ray.kill is all the driver can do.
        return _processes_of([pid for node, pid in self._processes if node == here])

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
                if hung:
                    _kill_all(self._local_processes_of(sorted(hung)))
                elif not (self.cancel is not None and self.cancel.cancelled):
                    late = self._teardown(graceful_s)
                    problems = [self._late_line(r, graceful_s) for r in late if self._stopped(r)]
                for a in self.actors:
                    try:
                        ray.kill(a, no_restart=True)
                    except Exception as err:
                        log.debug("%s: ray.kill failed: %s", self.name, err)
        except Cancelled:
            # The cluster is going down: kill this host's worker processes ourselves.
            procs = _processes_of([pid for _, pid in self._processes])
            _kill_all(procs)
        finally:
            LIVENESS.unwatch(key)
        if problems:  # a stopped process will not exit on ray.kill: no point waiting for it
            _kill_all(self._local_processes_of([r for r in range(len(self._processes)) if self._stopped(r)]))
        self.actors = []
        self._processes = []
        left = wait_exited(procs, exit_s)
        if left:
            log.warning(
                "%s: %d worker process(es) still alive %gs after ray.kill; SIGKILL: %s",
                self.name, len(left), exit_s, [p.pid for p in left],
            )
            _kill_all(left)
            left = wait_exited(left, 5.0)
            if left:
                log.error("%s: processes %s survived SIGKILL", self.name, [p.pid for p in left])
        for line in problems:
            log.error("%s", line)
        return problems

    def _local_processes_of(self, ranks: Sequence[int]) -> list[Any]:
        """The processes (with descendants) of ``ranks`` that run on this host."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        return _processes_of([self._processes[r][1] for r in ranks if self._processes[r][0] == here])

    def _stopped(self, rank: int) -> bool:
        """Whether rank ``rank``'s process, or one of its children, is stopped (this host only)."""
        return any(is_stopped(p) for p in self._local_processes_of([rank]))

    def _late_line(self, rank: int, graceful_s: float) -> str:
        role = self.placement.role if self.placement is not None else None
        who = describe_worker(self.name, role, rank, LIVENESS.where(id(self), rank), self._processes[rank][1])
        return (
            f"{who} hung during shutdown: its teardown did not return within {graceful_s:g}s "
            "and its process is stopped; killed"
        )


def _node_addresses() -> dict[str, str]:
    """Ray node id -> the node's address, for the cluster's alive nodes (names a rank's node)."""
    import ray

    try:
        with RAY_GATE.call("looking up the nodes' addresses"):
            return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    except Exception as err:  # naming the node is a courtesy: never fail a start for it
        log.debug("cannot list the cluster's nodes: %s", err)
        return {}


def _kill_all(procs: Sequence[Any]) -> None:
    """SIGKILL each ``psutil.Process`` (a stopped one too: SIGKILL needs no cooperation)."""
    for p in procs:
        try:
            p.kill()
        except Exception as err:  # gone meanwhile, or not ours to kill
            log.debug("SIGKILL of %d failed: %s", p.pid, err)


#: Every worker group this process started: ``{"group", "role", "nodes"}`` (Ray node id per rank).
_PLACED: list[dict[str, Any]] = []


def placed_groups() -> list[dict[str, Any]]:
    """Where the worker groups started by this process run (for the run's ``placement.json``)."""
    return [dict(p) for p in _PLACED]


def forget_placed(keep: int = 0) -> None:
    """Forget every worker group recorded after the first ``keep``: a run that ended drops
    its own, so the next run in this process (a second ``rlcore.open``) lists only its own."""
    del _PLACED[keep:]


def _processes_of(pids: Sequence[int]) -> list[Any]:
    """``psutil.Process`` objects of ``pids`` and all their descendants (those still there)."""
    import psutil

    found: dict[int, Any] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                found[p.pid] = p
        except psutil.Error:
            continue
    return list(found.values())


def wait_exited(procs: Sequence[Any], timeout_s: float, poll_s: float = 0.05) -> list[Any]:
    """Poll until every ``psutil.Process`` in ``procs`` has exited (a zombie counts as
    exited) or ``timeout_s`` passes; returns those still running."""
    import psutil

    def running(p: Any) -> bool:
        try:
            return bool(p.is_running()) and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = [p for p in left if running(p)]
    return left

"""The Ray cluster a run uses: an embedded local one by default, an existing one by address.

Ray is imported only when the cluster starts. The cluster is shared by the
whole process: starting it twice reuses it, and only the owner shuts it down.

The embedded cluster is a single-host one: its node address is 127.0.0.1, so Ray's
servers and agents, the worker groups' rendezvous stores and gloo all listen on
loopback only (:func:`rlcore.runtime.rendezvous.tcp_store`). Joining a cluster by address keeps
Ray's choice (the node's outward address): several hosts must reach each other; only a
loopback address (a single-host cluster of ``ray start`` nodes on 127.0.0.1) is joined on
loopback. Which cluster, and whether it can be joined, is decided before: :mod:`rlcore.runtime.join`.

No thread of a run can start a second cluster: Ray's auto-init (which ``ray.get`` and
friends run when Ray is not connected) is switched off when the cluster starts, and
:meth:`Cluster.shutdown` first closes :data:`rlcore.runtime.gate.RAY_GATE`, so a thread the
setup abandoned makes no Ray call during or after ``ray.shutdown()``. The shutdown of an
embedded cluster returns once every process of it (GCS, raylet, Ray's agents, workers)
has exited. ``ray.init`` replaces the driver's SIGTERM (and, in its C++ core, SIGINT)
handlers; :meth:`Cluster.start` puts the caller's back.

The embedded cluster retries Ray's local socket connects every 50 ms, not every second
(:data:`LOCAL_CONNECT_RETRY`): the raylet's first connect to its own object store often
came too early, and cost ``ray.init`` a second.

The embedded cluster's workers run at the driver's priority (Ray's ``worker_niceness``
0; Ray's default, 15, is for workers that are background work beside a raylet): here the
workers are the run, and at niceness 15 they got about 2% of a core beside two ordinary
busy processes on a 2-core host, so every init and step crawled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from rlcore.config import ROLE_SECTIONS, ClusterConfig, RunConfig
from rlcore.config.placement import (
    DeviceGroup,
    Network,
    NodeInfo,
    device_layout,
    role_placement,
    spans_nodes,
)
from rlcore.runtime.gate import RAY_GATE
from rlcore.runtime.head_watch import HEAD_WATCH
from rlcore.runtime.join import ClusterChoice, choose_cluster, is_loopback, single_host
from rlcore.runtime.liveness import LIVENESS

log = logging.getLogger(__name__)

_lock = threading.Lock()

#: The node address of the embedded cluster: nothing it runs is reachable from other hosts.
LOOPBACK = "127.0.0.1"

#: Niceness of the embedded cluster's worker processes: the driver's (see the module doc).
WORKER_NICENESS = 0

#: Ray's retry of a connect to a local socket (the raylet to its own object store, a
#: worker to its raylet): every 50 ms, 200 times, instead of every second, 10 times (the
#: same 10 s in all). The raylet connects to the object store it has just started in
#: another thread; when the store was not listening yet at the first try, ``ray.init``
#: took a whole second longer: 3 of 10 plain starts on a 2-core host, 0 of 10 with these
#: values (``bench/ray_start.py``, ``bench/results/ray_start_cpu.txt``).
LOCAL_CONNECT_RETRY = {
    "raylet_client_connect_timeout_milliseconds": 50,
    "raylet_client_num_connect_attempts": 200,
}


def loopback_env() -> dict[str, str]:
    """Environment of the embedded cluster's workers: gloo and NCCL's bootstrap on the
    loopback interface (unless this process already chose interfaces)."""
    from rlcore.runtime.addresses import loopback_interface

    iface = loopback_interface()
    return {
        name: os.environ.get(name, iface) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    }


@contextlib.contextmanager
def _worker_environment(env_vars: dict[str, str]) -> Iterator[None]:
    """Start the embedded cluster with ``env_vars`` in its processes' environment.

    Ray's processes inherit the driver's environment when ``ray.init`` starts them, and
    the raylet hands its own to every worker it starts. Given this way rather than as the
    job's ``runtime_env``, the variables leave the job's runtime environment empty, so
    the workers the raylet starts ahead of time (one per CPU, while ``ray.init`` returns)
    match the run's actors (:func:`rlcore.runtime.resources.actor_runtime_env`) instead of
    being ended for fresh processes. The driver's environment is put back afterwards;
    :data:`rlcore.runtime.resources.WORKER_ENV` records what the workers have.
    """
    from rlcore.runtime import resources

    saved = {name: os.environ.get(name) for name in env_vars}
    os.environ.update(env_vars)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    resources.WORKER_ENV.clear()
    resources.WORKER_ENV.update(env_vars)


def no_auto_init() -> None:
    """Switch Ray's auto-init off in this process: a Ray call without a connection raises
    instead of starting a new local cluster (``RAY_ENABLE_AUTO_CONNECT=0``, which Ray
    reads once at import, so the module's flag is set too)."""
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    try:
        from ray._private import auto_init_hook
    except ImportError:  # pragma: no cover - a Ray without auto-init
        return
    auto_init_hook.enable_auto_connect = False


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Restore this process's SIGINT/SIGTERM handlers after the block (``ray.init`` sets
    its own: a SIGTERM handler that exits, and its C++ core's crash handler, whose stack
    dump is not an answer to a plain SIGTERM)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _ray_processes() -> list[Any]:
    """The embedded cluster's processes on this host (GCS, raylet, ...) with everything
    they started (Ray's agents, workers): ``psutil.Process`` objects."""
    try:
        from ray._private import worker as ray_worker

        from rlcore.runtime.proc import processes_of

        node = ray_worker._global_node
        if node is None:
            return []
        return processes_of([proc.pid for _, proc in node.live_processes()])
    except Exception as err:  # pragma: no cover - a Ray without these internals
        log.debug("cannot list the Ray cluster's processes: %s", err)
        return []


#: How long ``ray.shutdown()`` may take once the cluster's head is gone (it waits about 15 s
#: on the dead GCS): it goes on in a daemon thread, which the process does not wait for.
LOST_HEAD_SHUTDOWN_S = 2.0


def _disconnect(ray: Any) -> None:
    """``ray.shutdown()``; bounded by :data:`LOST_HEAD_SHUTDOWN_S` once the head is gone
    (:data:`rlcore.runtime.head_watch.HEAD_WATCH`)."""

    def shutdown() -> None:
        with contextlib.suppress(Exception):  # a half-started cluster may not stop cleanly
            ray.shutdown()

    if not HEAD_WATCH.lost:
        shutdown()
        return
    thread = threading.Thread(target=shutdown, name="rlcore-ray-shutdown", daemon=True)
    thread.start()
    thread.join(LOST_HEAD_SHUTDOWN_S)
    if thread.is_alive():
        log.warning("ray.shutdown() did not return within %gs of a lost head; not waited for", LOST_HEAD_SHUTDOWN_S)


class Cluster:
    """Starts or joins Ray once; ``shutdown`` stops only a cluster it started."""

    def __init__(self, config: ClusterConfig, choice: ClusterChoice | None = None) -> None:
        self.config = config
        #: Which cluster and why (:func:`rlcore.runtime.join.choose_cluster`).
        self.choice = choice if choice is not None else choose_cluster(config)
        self.owned = False
        self.joined = False
        self.start_time_s: float | None = None
        self._network: Network | None = None
        self._devices: DeviceGroup | None = None

    @property
    def where(self) -> str:
        """The cluster in an error message."""
        if self.choice.address:
            return f"the Ray cluster at {self.choice.address}"
        return "the Ray cluster this process is connected to" if self.choice.attached else "the embedded Ray cluster"

    def start(self) -> Cluster:

        with _lock:
            import ray

            no_auto_init()
            if ray.is_initialized():
                # A driver of its own (a script that called ray.init): used, never shut down.
                self.joined = self.joined or self.choice.attached
                return self
            HEAD_WATCH.clear()
            RAY_GATE.open()
            LIVENESS.configure(self.config.hang_timeout_s)
            t0 = time.monotonic()
            env_vars = {
                # Workers inherit these: keep CPU threads per worker sane on small hosts.
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "TOKENIZERS_PARALLELISM": "false",
            }
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            if self.choice.address:
                self._join(self.choice.address, env_vars, kwargs)
            else:
                if self.config.num_cpus is not None:
                    kwargs["num_cpus"] = self.config.num_cpus
                if self.config.num_gpus is not None:
                    kwargs["num_gpus"] = self.config.num_gpus
                env_vars.update(loopback_env())
                # Owned from here on: an interrupt inside ray.init still shuts down what
                # it had started.
                self.owned = True
                with single_host(), _keep_signal_handlers(), _worker_environment(env_vars):
                    # address="local": a new cluster even where another one is reachable
                    # (RAY_ADDRESS, or /tmp/ray/ray_current_cluster of a `ray start`).
                    ray.init(
                        address="local",
                        _node_ip_address=LOOPBACK,
                        _system_config={"worker_niceness": WORKER_NICENESS, **LOCAL_CONNECT_RETRY},
                        **kwargs,
                    )
                log.info("started an embedded Ray cluster: %s", ray.cluster_resources())
            self.start_time_s = time.monotonic() - t0
            self._watch_head()
            return self

    def _watch_head(self) -> None:
        """Start :data:`rlcore.runtime.head_watch.HEAD_WATCH` on this cluster's GCS (unless
        ``cluster.hang_timeout_s`` is null): a head gone mid-run ends the run within it."""
        if self.config.hang_timeout_s is None or (self.choice.address or "").startswith("ray://"):
            return  # a Ray Client's driver runs on the cluster: its GCS need not be reachable from here
        import ray

        from rlcore.runtime.head_watch import gcs_reachable

        try:
            address = str(ray.get_runtime_context().gcs_address)
        except Exception as err:  # pragma: no cover - a Ray without it
            log.debug("cannot watch the GCS: %s", err)
            return
        if not gcs_reachable(address, 2.0):  # not from here (a GCS behind another address): not watched
            log.info("the GCS at %s accepts no connection from this process; its loss is left to Ray", address)
            return
        HEAD_WATCH.start(address, self.config.hang_timeout_s)

    def _join(self, address: str, env_vars: dict[str, str], kwargs: dict[str, Any]) -> None:
        """Join the cluster at ``address`` as this job's driver.

        Inside a Ray job, ``ray.init`` merges the job's runtime environment (its working
        directory, pip packages, variables) into the driver's, and the run's actors inherit
        it; a variable the job sets itself is left to the job (Ray refuses to merge two
        values of one variable). A loopback address is joined on loopback (:func:`single_host`).
        """
        import ray

        from rlcore.runtime.join import job_env_vars, use_token_like_ray_cli

        use_token_like_ray_cli(address)
        job_vars = job_env_vars()
        own = {k: v for k, v in env_vars.items() if k not in job_vars}
        loopback = is_loopback(address)
        if loopback:
            kwargs["_node_ip_address"] = LOOPBACK
        with single_host() if loopback else contextlib.nullcontext(), _keep_signal_handlers():
            ray.init(address=address, runtime_env={"env_vars": own} if own else None, **kwargs)
        self.joined = True
        log.info("joined Ray cluster at %s", address)

    def network(self, config: RunConfig) -> Network:
        """Who reaches the run's servers (:class:`rlcore.config.placement.Network`), decided once.

        The embedded cluster is one node: loopback, no token. On a joined cluster, the
        nodes each selected role may land on (``placement.nodes``) and the driver's node
        are looked up (:func:`rlcore.config.placement.spans_nodes`): more than one node gives
        readers elsewhere and a fresh per-run token.
        """
        if self._network is None:
            self._network = Network()
            if self.joined:
                import ray


                with RAY_GATE.call("looking up the cluster's nodes"):
                    nodes = [
                        NodeInfo(n["NodeID"], n.get("Resources", {}), n.get("Labels", {}))
                        for n in ray.nodes() if n.get("Alive")
                    ]
                    here = ray.get_runtime_context().get_node_id()
                roles = [r for r in ROLE_SECTIONS if getattr(config, r).backend]
                if spans_nodes([role_placement(config, r) for r in roles], nodes, here):
                    self._network = Network.spread()
            log.info("run network: %s", "node addresses, token required" if self._network.readers_elsewhere else "loopback")
        return self._network

    def reserve_devices(self, config: RunConfig, timeout_s: float = 120.0) -> DeviceGroup | None:
        """Reserve the GPU bundles of the policy and generation ranks as one Ray placement
        group (:func:`rlcore.config.placement.device_layout`, the layout the preflight counted and
        ``rlcore plan`` shows); ``None`` on a cluster without GPUs. Waits ``timeout_s`` for
        Ray to place it; a cluster that cannot hold it is refused naming both counts.
        Removed again by :meth:`shutdown`."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from rlcore.errors import ConfigError, Deadline
        from rlcore.runtime.waits import ray_get

        with RAY_GATE.call("reserving the run's GPUs"):
            have = ray.cluster_resources().get("GPU", 0.0)
            if have < 1:
                return None
            layout = device_layout(config)
            if layout.gpus > have + 1e-9:
                where = self.where
                raise ConfigError(
                    f"config key 'policy.workers': the GPU bundles of the workers need {layout.gpus} "
                    f"GPU ({'; '.join(layout.lines())}), but {where} has {have:g}; lower the workers "
                    "or share GPUs (placement.colocated=true, devices_per_worker 0.5)",
                    key="policy.workers",
                )
            labels = [b.labels(config) for b in layout.bundles]
            group = placement_group(
                [b.ray_bundle(config) for b in layout.bundles],
                strategy="PACK",
                **({"bundle_label_selector": labels} if any(labels) else {}),
            )
        try:
            ray_get(
                group.ready(),
                what=f"placing the run's {len(layout.bundles)} GPU bundle(s) ({layout.gpus} GPU)",
                deadline=Deadline(timeout_s, "reserving the run's GPUs"),
            )
        except BaseException:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
            raise
        self._devices = DeviceGroup(layout, group)
        log.info("reserved the run's GPUs: %s", "; ".join(layout.lines()))
        return self._devices

    def _release_devices(self) -> None:
        """Remove the run's placement group (a joined cluster keeps running without it)."""
        devices, self._devices = self._devices, None
        if devices is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(devices.group)

    def resources(self) -> dict[str, float]:
        import ray

        return dict(ray.cluster_resources())

    def shutdown(self, reason: str = "the run's Ray cluster is shut down", exit_s: float = 5.0) -> list[str]:
        """Stop the cluster if this object started it; returns what was left to SIGKILL.

        Ray calls are refused from here on (:data:`rlcore.runtime.gate.RAY_GATE`, with up to
        2 s for calls in flight to return), then ``ray.shutdown()``; then every process of
        the embedded cluster still there half a second later gets SIGTERM, and ``exit_s`` to
        exit before it is SIGKILLed (Ray's agents otherwise linger for a minute after their
        raylet is gone).
        """
        from rlcore.runtime import resources
        from rlcore.runtime.proc import wait_exited

        LIVENESS.clear()  # its groups go with the cluster: nothing is probed any more
        HEAD_WATCH.stop()  # a GCS stopped from here on is stopped on purpose
        with _lock:
            if self.joined and self.choice.attached:
                # The process's own connection (ray.init before rlcore): left as it was,
                # but for what this run reserved on it.
                if not HEAD_WATCH.lost:
                    self._release_devices()
                self.joined = False
                return []
            if self.joined:
                # A cluster joined by address stays up: only this driver's connection ends
                # (Ray then ends the actors of this job that are still there).
                import ray

                if not HEAD_WATCH.lost:  # a dead GCS cannot remove the placement group
                    self._release_devices()
                RAY_GATE.close(reason)
                _disconnect(ray)
                self.joined = False
                return []
            if not self.owned:
                return []
            import ray

            RAY_GATE.close(reason)
            self._devices = None  # the placement group ends with the cluster
            resources.WORKER_ENV.clear()  # what the next cluster's workers inherit is its own
            procs = _ray_processes()
            _disconnect(ray)
            self.owned = False
        # What outlived its raylet (agents, workers) is told to stop now, not when it notices.
        for p in wait_exited(procs, 0.5):
            with contextlib.suppress(Exception):
                p.terminate()
        left = wait_exited(procs, exit_s)
        killed = []
        for p in left:
            with contextlib.suppress(Exception):
                killed.append(f"{p.name()} ({p.pid})")
                p.kill()
        if killed:
            log.warning("Ray processes still alive %gs after ray.shutdown, SIGKILLed: %s", exit_s, killed)
        return killed

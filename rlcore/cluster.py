"""The Ray cluster a run uses: an embedded local one by default, an existing one by address.

Ray is imported only when the cluster starts. The cluster is shared by the
whole process: starting it twice reuses it, and only the owner shuts it down.

The embedded cluster is a single-host one: its node address is 127.0.0.1, so Ray's
servers and agents, the worker groups' rendezvous stores and gloo all listen on
loopback only (:func:`rlcore.workers.tcp_store`). Joining a cluster by address keeps
Ray's choice (the node's outward address): several hosts must reach each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from rlcore.config import ClusterConfig

log = logging.getLogger(__name__)

_lock = threading.Lock()

#: The node address of the embedded cluster: nothing it runs is reachable from other hosts.
LOOPBACK = "127.0.0.1"


def loopback_env() -> dict[str, str]:
    """Environment of the embedded cluster's workers: gloo and NCCL's bootstrap on the
    loopback interface (unless this process already chose interfaces)."""
    from rlcore.workers import loopback_interface

    iface = loopback_interface()
    return {
        name: os.environ.get(name, iface) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    }


@contextlib.contextmanager
def _single_host() -> Iterator[None]:
    """Start Ray as a single-host cluster: every Ray process binds to 127.0.0.1.

    Ray replaces a loopback ``_node_ip_address`` by the host's outward address, and its
    servers (GCS, raylet, dashboard and runtime-env agents, workers) then listen on every
    interface. Ray's own single-host mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the
    default on macOS and Windows) keeps the node on loopback; the switch is a constant read
    at ``import ray``, so it is set on the module for the duration of ``ray.init`` only.
    Once started, the node's address is fixed and later calls use it.
    """
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - a Ray without the switch: start as Ray decides
        log.warning("this Ray has no single-host switch; its ports may listen on every interface")
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


class Cluster:
    """Starts or joins Ray once; ``shutdown`` stops only a cluster it started."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.owned = False
        self.start_time_s: float | None = None

    def start(self) -> Cluster:
        with _lock:
            import ray

            if ray.is_initialized():
                return self
            t0 = time.monotonic()
            env_vars = {
                # Workers inherit these: keep CPU threads per worker sane on small hosts.
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "TOKENIZERS_PARALLELISM": "false",
            }
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": True,
                "runtime_env": {"env_vars": env_vars},
            }
            if self.config.address:
                ray.init(address=self.config.address, **kwargs)
                log.info("joined Ray cluster at %s", self.config.address)
            else:
                if self.config.num_cpus is not None:
                    kwargs["num_cpus"] = self.config.num_cpus
                if self.config.num_gpus is not None:
                    kwargs["num_gpus"] = self.config.num_gpus
                env_vars.update(loopback_env())
                with _single_host():
                    ray.init(_node_ip_address=LOOPBACK, **kwargs)
                self.owned = True
                log.info("started an embedded Ray cluster: %s", ray.cluster_resources())
            self.start_time_s = time.monotonic() - t0
            return self

    def resources(self) -> dict[str, float]:
        import ray

        return dict(ray.cluster_resources())

    def shutdown(self) -> None:
        with _lock:
            if not self.owned:
                return
            import ray

            if ray.is_initialized():
                ray.shutdown()
            self.owned = False


def has_cuda() -> bool:
    """Whether this process sees a CUDA device (imports torch)."""
    import torch

    return bool(torch.cuda.is_available())

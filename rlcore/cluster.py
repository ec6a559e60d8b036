"""The Ray cluster a run uses: an embedded local one by default, an existing one by address.

Ray is imported only when the cluster starts. The cluster is shared by the
whole process: starting it twice reuses it, and only the owner shuts it down.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from rlcore.config import ClusterConfig

log = logging.getLogger(__name__)

_lock = threading.Lock()


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
                ray.init(**kwargs)
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

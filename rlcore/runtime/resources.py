"""What a worker group asks of the Ray cluster: the device its ranks run on, Ray
resources per rank, the actors' runtime environment, and whether the cluster can ever
hold the group.
"""

from __future__ import annotations

from typing import Any

from rlcore.config.placement import RolePlacement
from rlcore.errors import ConfigError, WorkerError


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
    """:class:`rlcore.runtime.worker_group.WorkerGroup`'s ``num_cpus``, ``num_gpus`` and ``dist_backend`` for ranks on
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


def check_fits(name: str, world_size: int, num_cpus: float, num_gpus: float, placement: RolePlacement | None = None) -> None:
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



"""The generation handle: vLLM engines in a Ray worker group, as rlcore sees them.

:func:`start_generation` is the body of the ``rlcore_init_generation`` hook; it
returns a :class:`VLLMGeneration`, which implements
:class:`rlcore.handles.RefitReceiver` (the core's refit streams weights into
it) and the calls the training loop makes (``generate``, ``logprobs``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rlcore.context import InitContext
from rlcore.handles import Endpoint
from rlcore.runtime.generation_group import GroupGeneration
from rlcore.runtime.workers import WorkerGroup
from rlcore_vllm.options import VLLMOptions
from rlcore_vllm.worker import VLLMWorker

log = logging.getLogger(__name__)

GROUP_NAME = "vllm-generation"


class VLLMGeneration(GroupGeneration):
    """Handle of the ``vllm`` generation backend: ``workers`` independent engines.

    Attributes:
        group: the Ray worker group (one :class:`VLLMWorker` per engine).
        refit_ranks: number of engines; engine ``i`` is rank ``1 + i`` of refit channels.
        endpoints: each engine's OpenAI-compatible endpoint (server mode), else empty.
        start_info: per-worker start timings (seconds) reported by the workers.
    """

    device_type: str

    def __init__(
        self,
        group: WorkerGroup,
        specs: list[Any],
        *,
        endpoints: Sequence[Endpoint] = (),
        start_info: Sequence[dict[str, Any]] = (),
        device_type: str = "cpu",
    ) -> None:
        super().__init__(group, backend="vllm", role="generation")
        self.refit_ranks = group.world_size
        self.endpoints = list(endpoints)
        self.start_info = list(start_info)
        self.device_type = device_type
        self._specs = list(specs)

    # -------------------------------------------------------- training loop

    @property
    def endpoint(self) -> Endpoint | None:
        """Engine 0's OpenAI-compatible endpoint (server mode), else None.

        Each engine serves its own; spread load over :attr:`endpoints` if needed.
        """
        return self.endpoints[0] if self.endpoints else None


def _options(raw: Any) -> VLLMOptions:
    if isinstance(raw, VLLMOptions):
        return raw
    return VLLMOptions(**dict(raw or {}))


def start_generation(ctx: InitContext) -> VLLMGeneration:
    """Start ``generation.workers`` vLLM engines as configured by ``ctx``; see the module doc."""
    import ray

    from rlcore.errors import ConfigError
    from rlcore.tinymodel import ensure_model

    options = _options(ctx.options)
    section = ctx.config.generation
    model_dir = ensure_model(
        ctx.config.model, ctx.cache_dir, cancel=ctx.cancel, deadline=ctx.deadline
    )
    cuda = ray.cluster_resources().get("GPU", 0) >= 1
    if cuda and section.devices_per_worker != 1:
        raise ConfigError(
            "generation.devices_per_worker must be 1 for the vllm backend on GPUs (one GPU per "
            f"engine; tensor parallelism is not supported yet), got {section.devices_per_worker}",
            key="generation.devices_per_worker",
        )
    threads = max(1, int(section.devices_per_worker))
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: no engine-core subprocess
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    log_dir = ctx.run_dir / "vllm"
    group = WorkerGroup(
        VLLMWorker,
        section.workers,
        name=GROUP_NAME,
        args=(str(model_dir),),
        kwargs={
            "dtype": ctx.config.model.dtype,
            "refit_fed": bool(section.refit_fed),
            "options": options,
            "log_dir": str(log_dir),
            "network": ctx.network,
        },
        num_cpus=1.0 if cuda else float(section.devices_per_worker),
        num_gpus=1.0 if cuda else 0.0,
        env=env,
        dist_backend=None,
        timeout_s=options.call_timeout_s,
        cancel=ctx.cancel,
        deadline=ctx.deadline,
        placement=ctx.placement,
    )
    try:
        remaining = ctx.deadline.remaining()
        start_timeout = (
            options.server_start_timeout_s
            if remaining is None
            else min(options.server_start_timeout_s, remaining)
        )
        what = "starting vLLM servers" if options.serve_openai else "building vLLM engines"
        info = group.call("start", start_timeout, what=what, deadline=ctx.deadline)
        specs = group.call("weight_specs", ranks=[0], what="weight specs", deadline=ctx.deadline)[0]
        endpoints = []
        if options.serve_openai:
            for e in group.call("endpoint_info", what="endpoints", deadline=ctx.deadline):
                endpoints.append(Endpoint(base_url=e["base_url"], model=e["model"], api_key=e["api_key"]))
    except BaseException:
        group.shutdown()
        raise
    ctx.log.info(
        "vllm: %d engine(s) up (%s, %s) in %s",
        section.workers,
        "refit-fed" if section.refit_fed else "checkpoint weights",
        "OpenAI server" if options.serve_openai else "in-process",
        ", ".join(f"{i.get('total_s', 0.0):.1f}s" for i in info),
    )
    log.debug("vllm options: %s", asdict(options))
    return VLLMGeneration(
        group, specs, endpoints=endpoints, start_info=info, device_type="cuda" if cuda else "cpu"
    )

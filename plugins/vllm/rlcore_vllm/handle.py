"""The generation handle: vLLM engines in a Ray worker group, as rlcore sees them.

:func:`start_generation` is the body of the ``rlcore_init_generation`` hook; it
returns a :class:`VLLMGeneration`, which implements
:class:`rlcore.handles.RefitReceiver` (the core's refit streams weights into
it) and the calls the training loop makes (``generate``, ``logprobs``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import Any

from rlcore.context import InitContext
from rlcore.runtime.generation_group import Engines, GroupGeneration, start_engines
from rlcore.runtime.resources import cluster_has_gpu
from rlcore_vllm.options import VLLMOptions
from rlcore_vllm.worker import VLLMWorker

log = logging.getLogger(__name__)

GROUP_NAME = "vllm-generation"


class VLLMGeneration(GroupGeneration):
    """Handle of the ``vllm`` generation backend: ``workers`` independent engines, one
    :class:`VLLMWorker` each, with :class:`rlcore.runtime.generation_group.GroupGeneration`'s
    attributes; ``endpoints`` are the engines' servers in server mode, else empty."""


def _options(raw: Any) -> VLLMOptions:
    if isinstance(raw, VLLMOptions):
        return raw
    return VLLMOptions(**dict(raw or {}))


def start_generation(ctx: InitContext) -> VLLMGeneration:
    """Start ``generation.workers`` vLLM engines as configured by ``ctx``; see the module doc."""
    from rlcore.errors import ConfigError
    from rlcore.models.tiny import ensure_model

    options = _options(ctx.options)
    section = ctx.config.generation
    model_dir = ensure_model(
        ctx.config.model, ctx.cache_dir, cancel=ctx.cancel, deadline=ctx.deadline
    )
    cuda = cluster_has_gpu()
    if cuda and section.devices_per_worker != 1:
        raise ConfigError(
            "generation.devices_per_worker must be 1 for the vllm backend on GPUs (one GPU per "
            f"engine; tensor parallelism is not supported yet), got {section.devices_per_worker}",
            key="generation.devices_per_worker",
        )
    threads = max(1, int(section.devices_per_worker))
    # vLLM's own variables are set by the worker in its process (VLLMWorker._set_vllm_env).
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    engines = Engines(
        VLLMWorker,
        GROUP_NAME,
        model_dir,
        options,
        cuda=cuda,
        env=env,
        what="starting vLLM servers" if options.serve_openai else "building vLLM engines",
        endpoints=options.serve_openai,
        log_dir=str(ctx.run_dir / "vllm"),
        extra={"log_level": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")},
    )
    group, info, specs, endpoints = start_engines(ctx, engines)
    ctx.log.info(
        "vllm: %d engine(s) up (%s, %s) in %s",
        section.workers,
        "refit-fed" if section.refit_fed else "checkpoint weights",
        "OpenAI server" if options.serve_openai else "in-process",
        ", ".join(f"{i.get('total_s', 0.0):.1f}s" for i in info),
    )
    log.debug("vllm options: %s", asdict(options))
    return VLLMGeneration(
        group,
        specs,
        backend="vllm",
        endpoints=endpoints,
        start_info=info,
        device_type="cuda" if cuda else "cpu",
    )

"""The generation handle: SGLang servers in a Ray worker group, as rlcore sees them.

:func:`start_generation` is the body of the ``rlcore_init_generation`` hook; it
returns a :class:`SGLangGeneration`, which implements
:class:`rlcore.handles.RefitReceiver` (the core's refit streams weights into
it) and the calls the training loop makes (``generate``, ``logprobs``), and
carries SGLang's own OpenAI-compatible endpoint (``endpoint``).
"""

from __future__ import annotations

import logging
from typing import Any

from rlcore.context import InitContext
from rlcore.errors import ConfigError
from rlcore.handles import Endpoint
from rlcore.runtime.addresses import server_host
from rlcore.runtime.generation_group import Engines, GroupGeneration, start_engines
from rlcore.runtime.resources import cluster_has_gpu
from rlcore_sglang.options import SGLangOptions
from rlcore_sglang.worker import SGLangWorker

log = logging.getLogger(__name__)

GROUP_NAME = "sglang-generation"


class SGLangGeneration(GroupGeneration):
    """Handle of the ``sglang`` generation backend: ``workers`` independent SGLang servers,
    one :class:`SGLangWorker` each, with :class:`rlcore.runtime.generation_group.GroupGeneration`'s
    attributes; ``endpoints`` are the servers' own (SGLang's ``/v1``)."""

    #: rlcore's OpenAI-compatible endpoint in front of :meth:`generate` (option ``endpoint: rlcore``).
    front: Any = None

    # -------------------------------------------------------- training loop

    @property
    def endpoint(self) -> Endpoint | None:
        """The OpenAI-compatible endpoint: server 0's own ``/v1`` (each server serves one:
        :attr:`endpoints`), or rlcore's in front of :meth:`generate` (option ``endpoint: rlcore``)."""
        return self.front.endpoint if self.front is not None else super().endpoint

    # ------------------------------------------------------------ lifecycle

    def _release(self) -> None:
        """rlcore's endpoint in front, if any; the servers go with their workers."""
        if self.front is not None:
            self.front.stop()


def start_generation(ctx: InitContext) -> SGLangGeneration:
    """Start ``generation.workers`` SGLang servers as configured by ``ctx``; see the module doc."""
    from rlcore.models.tiny import ensure_model
    from rlcore_sglang.server import find_sglang_python

    options = ctx.options if isinstance(ctx.options, SGLangOptions) else SGLangOptions(**dict(ctx.options or {}))
    if options.endpoint not in ("sglang", "rlcore"):
        raise ConfigError(
            f"generation.options.endpoint must be 'sglang' (SGLang's own /v1) or 'rlcore' "
            f"(rlcore's endpoint with vLLM's token-id extensions), got {options.endpoint!r}",
            key="generation.options.endpoint",
        )
    section = ctx.config.generation
    ctx.cancel.raise_if_cancelled()
    ctx.deadline.raise_if_expired()
    find_sglang_python(options.python)  # fail before anything starts if the venv is missing
    model_dir = ensure_model(ctx.config.model, ctx.cache_dir, cancel=ctx.cancel, deadline=ctx.deadline)
    cuda = cluster_has_gpu()
    # rlcore's endpoint: its tokenizer and imports load while the servers start.
    front_tokenizer = None
    if options.endpoint == "rlcore":
        from rlcore.serve.openai_endpoint import prepare

        front_tokenizer = prepare(str(model_dir))
    engines = Engines(
        SGLangWorker,
        GROUP_NAME,
        model_dir,
        options,
        cuda=cuda,
        env={"TOKENIZERS_PARALLELISM": "false"},
        what="starting SGLang servers",
        log_dir=str(ctx.run_dir / "sglang"),
        extra={"threads": max(1, int(section.devices_per_worker))},
    )
    group, info, specs, endpoints = start_engines(ctx, engines)
    ctx.log.info(
        "sglang: %d server(s) up (%s) in %s",
        section.workers,
        "refit-fed" if section.refit_fed else "checkpoint weights",
        ", ".join(f"{i.get('total_s', 0.0):.1f}s" for i in info),
    )
    handle = SGLangGeneration(
        group, specs, backend="sglang", endpoints=endpoints, start_info=info, device_type="cuda" if cuda else "cpu"
    )
    if options.endpoint == "rlcore":
        try:
            handle.front = _front_endpoint(handle, model_dir, options, ctx, front_tokenizer)
        except BaseException:
            handle.shutdown()
            raise
    return handle


def _front_endpoint(
    handle: SGLangGeneration, model_dir: Any, options: SGLangOptions, ctx: InitContext, tokenizer: Any
) -> Any:
    """rlcore's OpenAI-compatible endpoint over ``handle.generate`` (option ``endpoint: rlcore``);
    ``tokenizer``: what :func:`rlcore.serve.openai_endpoint.prepare` started loading."""
    import json

    from rlcore.serve.openai_endpoint import Listen, OpenAIEndpoint, ServedModel

    eos: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        eos.update([value] if isinstance(value, int) else list(value or []))
    config = json.loads((model_dir / "config.json").read_text())
    model = ServedModel(
        options.served_model_name,
        max_sequence_length=options.context_length or int(config.get("max_position_embeddings", 2048)),
        eos_token_ids=sorted(eos),
    )
    listen = Listen(host=server_host(ctx.network), token=ctx.network.token)
    server = OpenAIEndpoint(handle, tokenizer, model, listen=listen)
    remaining = ctx.deadline.remaining()
    server.start(timeout_s=30.0 if remaining is None else max(1.0, min(30.0, remaining)))
    return server

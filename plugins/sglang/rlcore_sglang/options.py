"""``generation.options`` of the ``sglang`` backend (plain data: imported by ``rlcore plugins``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlcore.config import bounded


@dataclass
class SGLangOptions:
    """Options of the ``sglang`` generation backend."""

    #: Python of the SGLang venv. ``null``: ``$RLCORE_SGLANG_PYTHON``, else
    #: ``.venv-sglang/bin/python`` beside the running venv or above this package.
    python: str | None = None
    #: The OpenAI-compatible endpoint the handle offers: ``sglang`` (SGLang's own ``/v1``
    #: of server 0), or ``rlcore`` (:mod:`rlcore.serve.openai_endpoint` in front of the handle's
    #: ``generate``, speaking vLLM's token-id extensions, ``return_tokens_as_token_ids``
    #: and ``return_token_ids``, which SGLang's ``/v1`` lacks and NeMo Gym's training
    #: model server requires).
    endpoint: str = "sglang"
    #: Port of replica 0's server (replica i uses port + i); 0 picks free ports.
    port: int = bounded(0, ge=0, le=65535)
    #: Model name the server answers to (``model`` field of OpenAI requests).
    served_model_name: str = "policy"
    #: ``--max-total-tokens``: KV-cache size in tokens (bounds concurrent prompt + completion tokens).
    max_total_tokens: int = bounded(4096, ge=2)
    #: ``--context-length``: longest prompt + completion, in tokens (0: the model's).
    context_length: int = bounded(0, ge=0)
    #: CUDA only: ``--mem-fraction-static`` (GPU memory share SGLang takes at start).
    mem_fraction_static: float = bounded(0.8, gt=0, le=1)
    #: Extra ``sglang.launch_server`` arguments, appended last (e.g. ``["--log-level", "info"]``).
    extra_args: list[str] = field(default_factory=list)
    #: How long a replica waits for its server's ``/health_generate`` before giving up.
    server_start_timeout_s: float = bounded(180.0, gt=0)
    #: Upper bound on one HTTP call of a generate, logprobs or refit request.
    call_timeout_s: float = bounded(900.0, gt=0)

"""``generation.options`` of the ``vllm`` backend: plain data, imported by ``rlcore plugins``
and by the backend's own modules (never through the entry point)."""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.config import bounded


@dataclass
class VLLMOptions:
    """``generation.options`` of the ``vllm`` backend."""

    #: Start vLLM's OpenAI-compatible server in each worker (on 127.0.0.1; on the
    #: node's address, guarded by the run's token, when a reader is on another node)
    #: and serve generation through it; the handle's ``endpoint`` then points at
    #: worker 0's server. Off: the engine runs inside the worker process (faster start).
    serve_openai: bool = False
    #: CPU only: GiB of memory for the KV cache (vLLM's ``kv_cache_memory_bytes``;
    #: fractions allowed). The engine zeroes all of it at start: a tiny model needs a few
    #: MiB, and where first-touched memory is slow (a VM) each GiB can cost seconds.
    kv_cache_gib: float = bounded(1.0, ge=0.001)  # ~1 MiB at least
    #: CUDA only: fraction of GPU memory vLLM may take (``gpu_memory_utilization``).
    gpu_memory_utilization: float = bounded(0.9, gt=0, le=1)
    #: Longest prompt + completion, in tokens.
    max_model_len: int = bounded(512, ge=2)
    #: Run the model eagerly (no CUDA graphs / torch.compile): faster start.
    enforce_eager: bool = True
    #: Port of worker 0's server (worker i uses port + i); 0 picks free ports.
    port: int = bounded(0, ge=0, le=65535)
    #: Model name the server answers to (``model`` field of OpenAI requests).
    served_model_name: str = "policy"
    #: How long a worker waits for its server's ``/health`` before giving up.
    server_start_timeout_s: float = bounded(120.0, gt=0)
    #: Upper bound on one generate/logprobs call of the handle.
    call_timeout_s: float = bounded(900.0, gt=0)

"""``policy.options`` / ``generation.options`` of the ``megatron`` backend (and the
checkpoint artifact's name): plain data, imported by ``rlcore plugins``
and by the backend's own modules (never through the entry point)."""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.config import bounded
from rlcore.errors import ConfigError

#: Name of the converted checkpoint artifact (``<cache>/megatron.checkpoint/<key>``).
CHECKPOINT_ARTIFACT = "megatron.checkpoint"


#: Values of ``generation.options.attention`` (:mod:`rlcore_megatron.paged_attention`).
ATTENTIONS = ("auto", "flash", "flex", "torch")
#: Values of ``generation.options.engine``.
ENGINES = ("auto", "static", "dynamic")
#: What ``auto`` means on each device type.
AUTO_ENGINE = {"cuda": "dynamic", "cpu": "static"}


def resolve_engine(engine: str, device_type: str) -> str:
    """``static`` or ``dynamic`` for ``generation.options.engine`` on ``device_type``.

    ``auto`` is the dynamic engine on CUDA and the static engine on CPU; the
    dynamic engine on CPU is a :class:`~rlcore.errors.ConfigError`.
    """
    key = "generation.options.engine"
    check_engine_name(engine)
    if engine == "auto":
        return AUTO_ENGINE.get(device_type, "static")
    if engine == "dynamic" and device_type != "cuda":
        raise ConfigError(
            f"{key}=dynamic needs CUDA (megatron-core's dynamic engine allocates its KV cache "
            f"and sampling buffers on the GPU), but the generation runs on {device_type}: set "
            f"{key} to auto or static, or run it on GPUs (generation.options.device=cuda)",
            key=key,
        )
    return engine


def check_engine_name(engine: str) -> None:
    """``generation.options.engine`` is one of :data:`ENGINES`, or a ConfigError naming it."""
    if engine not in ENGINES:
        key = "generation.options.engine"
        raise ConfigError(f"{key} of backend 'megatron' is {engine!r}; use auto, static or dynamic", key=key)


def check_attention_name(attention: str) -> None:
    """``generation.options.attention`` is one of :data:`ATTENTIONS`, or a ConfigError naming it."""
    if attention not in ATTENTIONS:
        key = "generation.options.attention"
        raise ConfigError(
            f"{key} of backend 'megatron' is {attention!r}; use one of {', '.join(ATTENTIONS)}", key=key
        )


def check_inflight_refit(options: MegatronOptions, engine: str | None) -> None:
    """``inflight_refit`` needs steps to land between (the dynamic engine) and one rank per
    replica (tensor-parallel ranks would land at different steps and stall each other).
    ``engine``: the resolved engine, or None where it waits for the device found at start.
    Raises :class:`~rlcore.errors.ConfigError` naming the key."""
    key = "generation.options.inflight_refit"
    tp = options.tensor_model_parallel_size
    if options.inflight_refit and (engine == "static" or tp != 1):
        raise ConfigError(
            f"{key} of backend 'megatron' needs the dynamic engine (CUDA) at tensor_model_parallel_size 1, "
            f"but the engine is {engine or options.engine} at tensor_model_parallel_size {tp}; "
            f"set {key}=false (refits then wait for the call in flight)",
            key=key,
        )


@dataclass
class MegatronOptions:
    """``policy.options`` / ``generation.options`` of the ``megatron`` backend."""

    #: Tensor-parallel ranks per model replica. Heads, query groups and the MLP width must
    #: divide by it. The converted checkpoint is written at the policy's value (it is part
    #: of the checkpoint key); megatron-core's torch_dist format reshards on load, so a
    #: generation with another value loads it too.
    tensor_model_parallel_size: int = bounded(1, ge=1)
    #: The vocabulary is padded to a multiple of this times the tensor-parallel size, as
    #: Megatron-LM does (zero rows; their logits are ignored). Part of the checkpoint key.
    make_vocab_size_divisible_by: int = bounded(128, ge=1)
    #: Seed of megatron-core's RNG states (tensor-parallel and data-parallel).
    seed: int = bounded(0, ge=0)
    #: Timeout in seconds of every collective of the backend's process groups
    #: (conversion ranks included) and of each driver call to the workers after init.
    timeout_s: float = bounded(300.0, gt=0)
    #: ``auto`` (CUDA when the Ray cluster has GPUs), ``cpu`` or ``cuda``.
    device: str = "auto"
    #: Torch CPU threads per rank; 0: ``<role>.devices_per_worker`` on CPU, 1 on CUDA.
    threads_per_worker: int = bounded(0, ge=0)
    #: Rows per forward (and backward) pass on each rank; larger shards are split.
    micro_batch_size: int = bounded(32, ge=1)
    #: (policy) Clip the global gradient norm to this value; ``<= 0``: measure only.
    max_grad_norm: float = bounded(1.0)  # any: <= 0 measures only
    #: (policy) AdamW weight decay; the learning rate comes with every train step.
    weight_decay: float = bounded(0.0, ge=0)
    #: (generation) Requests the engine runs at once (the static engine's batch and KV
    #: cache size; the dynamic engine's most concurrent requests).
    max_batch_size: int = bounded(64, ge=1)
    #: (generation) Longest prompt + completion, in tokens (KV cache length).
    max_sequence_length: int = bounded(512, ge=2)
    #: (generation) megatron-core inference engine: ``auto`` (the dynamic engine on CUDA,
    #: the static engine on CPU), ``static`` (one batch at a time; runs anywhere) or
    #: ``dynamic`` (in-flight batching over a paged KV cache; CUDA only).
    engine: str = "auto"
    #: (generation, dynamic engine) KV cache per rank in GiB; 0: room for
    #: ``max_batch_size`` sequences of ``max_sequence_length`` tokens.
    kv_cache_gib: float = bounded(0.0, ge=0)
    #: (generation, dynamic engine) Attention over the paged KV cache: ``auto`` (flash-attn
    #: where it is importable, else ``flex``), ``flash`` (flash-attn, required), ``flex``
    #: (FlexAttention for decode steps: each request's keys read where they lie, compiled;
    #: torch for prefill) or ``torch`` (every step gathers its requests' blocks, then SDPA).
    attention: str = "auto"
    #: (generation, dynamic engine) Batch sizes decode steps are padded to and replayed from
    #: CUDA graphs of the decoder at (captured as each size first comes); 0: every step eager.
    cuda_graphs: int = bounded(16, ge=0)
    #: (generation, dynamic engine, tensor-parallel size 1) Take a refit while a call
    #: samples (``grpo.max_staleness`` > 0): between two engine steps, the requests held
    #: (megatron-core's suspend / resume) and their KV computed again with the new weights;
    #: each token carries its version. Off: a refit waits for the call in flight. It pays
    #: where calls are long against that recompute; on one shared GPU with 6-token samples
    #: it did not (bench/results/async_h200.txt).
    inflight_refit: bool = False
    #: (generation) Serve an OpenAI-compatible endpoint (``/v1/chat/completions``,
    #: ``/v1/completions``, ``/v1/models``, ``/tokenize``) in the driver, in front of the
    #: engine: environments such as NeMo Gym reach the policy through it. Requests are
    #: batched into the same ``generate`` calls the training loop makes
    #: (:mod:`rlcore.serve.openai_endpoint`).
    serve_openai: bool = False
    #: (generation, serve_openai) The model name requests use and ``/v1/models`` lists.
    served_model_name: str = "policy"
    #: (generation, serve_openai) Address to listen on. On loopback (the default) the
    #: endpoint moves to the node's address by itself when a reader is on another node;
    #: off loopback it always wants a bearer token (the run's), announced as the API key.
    host: str = "127.0.0.1"
    #: (generation, serve_openai) Port to listen on; 0 picks a free one.
    port: int = bounded(0, ge=0, le=65535)
    #: (generation, serve_openai) How long a batch waits for concurrent requests, in ms.
    batch_wait_ms: float = bounded(5.0, ge=0)

    def __post_init__(self) -> None:
        # What the options alone decide is refused when they are resolved (`rlcore plan`);
        # an `auto` engine on an `auto` device is checked again at start, once resolved.
        check_engine_name(self.engine)
        check_attention_name(self.attention)
        check_inflight_refit(self, self.planned_engine())

    def planned_engine(self) -> str | None:
        """The engine where the options alone decide it; None: ``auto`` on the device found
        at start."""
        if self.engine != "auto":
            return self.engine
        return AUTO_ENGINE.get(self.device)

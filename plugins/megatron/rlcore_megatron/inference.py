"""megatron-core's static inference engine over a converted model, CPU-safe.

A thin layer for the generation backend: an inference wrapper that always
passes an explicit causal mask (megatron-core builds its own on CUDA), an
adapter from a Hugging Face tokenizer to the interface megatron-core's
controller calls, and :func:`build_static_engine`. The engine's remaining CUDA
calls are covered by :mod:`rlcore_megatron.cpu_compat` (``kv_cache_device``,
``static_generation``).

Logits over the padded vocabulary: megatron-core samples over all
``padded_vocab_size`` entries and only clamps the sampled id, so the padded
rows (zero weights, logit 0) could be drawn at temperature > 0, and its
``log_softmax`` for ``return_log_probs`` would count them in the normaliser.
:class:`MaskedGPTInferenceWrapper` therefore sets the logits of padded entries
to ``-inf`` in every forward step when it knows the real vocabulary size
(:func:`build_static_engine` tells it): sampling and logprobs then cover exactly
the Hugging Face vocabulary.

The generation backend drives the engine with token ids only
(:class:`TokenIdAdapter`); :class:`HFTokenizerAdapter` serves text prompts.

Two engines (:func:`resolve_engine` picks one from ``generation.options.engine``):

* the legacy **static** engine (:func:`build_static_engine`): one batch at a time,
  a KV cache of ``max_batch_size x max_sequence_length``; it runs on CPU;
* the **dynamic** engine (:func:`build_dynamic_engine`, CUDA only: its context
  and controller allocate on the GPU and in pinned memory): in-flight batching
  over a block-paged KV cache, requests leave the batch at their end-of-sequence
  token. Its attention needs flash-attn; without it
  :mod:`rlcore_megatron.paged_attention` supplies FlexAttention for decode steps and a
  torch implementation for the others (``generation.options.attention``); decode steps
  replay CUDA graphs of the decoder (:mod:`rlcore_megatron.decode_graphs`,
  ``generation.options.cuda_graphs``).
  :func:`generate_dynamic` runs one call's requests to completion, with a hook between
  two engine steps where a refit from another thread lands inside
  :func:`requests_held` (megatron-core's suspend / resume: the requests go on with the
  new weights, their KV recomputed); :func:`reset_dynamic_engine` drops every request
  and KV block (a refit between calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.sampling_params import SamplingParams

from rlcore_megatron.cpu_compat import causal_mask
from rlcore_megatron.options import ENGINES, resolve_engine  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine

    from rlcore_megatron.convert import ModelSpec


class MaskedGPTInferenceWrapper(GPTInferenceWrapper):
    """``GPTInferenceWrapper`` that builds its causal mask on the tokens' device and
    masks the padded vocabulary.

    The base class asks ``megatron.core.inference.utils.get_attention_mask``
    (CUDA) or passes ``None`` (then the attention builds a CUDA default mask).
    With :attr:`real_vocab_size` set, logits of ids ``>= real_vocab_size`` are
    ``-inf`` in every step's output (sampling never draws them; logprobs are
    normalised over the real vocabulary).
    """

    #: The Hugging Face vocabulary size; None leaves the padded logits as they are.
    real_vocab_size: int | None = None

    @torch.inference_mode()
    def run_one_forward_step(
        self, inference_input: dict[str, Any], recv_buffer_seq_len: int | None = None
    ) -> torch.Tensor:
        logits = super().run_one_forward_step(inference_input, recv_buffer_seq_len)
        vocab = self.real_vocab_size
        if vocab is not None and logits is not None and logits.shape[-1] > vocab:
            logits[..., vocab:] = float("-inf")
        return logits

    def _build_attention_mask_and_position_ids(
        self, prompts_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        seq = prompts_tokens.size(1)
        positions = torch.arange(seq, dtype=torch.long, device=prompts_tokens.device)
        return causal_mask(seq, device=prompts_tokens.device), positions.unsqueeze(0).expand_as(
            prompts_tokens
        )


class TokenIdAdapter:
    """The tokenizer interface of megatron-core's controller for token-id-only use.

    The generation backend passes prompts as token ids and returns token ids, so
    no tokenizer is loaded: the controller only needs the end-of-document and BOS
    ids, and detokenizes every finished request (here: to an empty string).
    """

    def __init__(self, eod: int, bos: int | None = None, vocab_size: int | None = None) -> None:
        self.eod = eod
        self.bos = bos
        self.vocab_size = vocab_size

    def tokenize(self, text: str) -> list[int]:
        raise TypeError("TokenIdAdapter takes prompts as token ids only")

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def offsets(self, ids: list[int], text: str) -> list[int]:
        return [0] * len(ids)


class HFTokenizerAdapter:
    """The tokenizer interface megatron-core's text generation controller uses."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eod = tokenizer.eos_token_id
        self.bos = tokenizer.bos_token_id
        self.vocab_size = len(tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def offsets(self, ids: list[int], text: str) -> list[int]:
        out, pos = [], 0
        for i in ids:
            out.append(pos)
            pos += len(self.tokenizer.decode([i]))
        return out


def sampling_params(temperature: float, max_tokens: int, **extra: Any) -> SamplingParams:
    """megatron-core sampling parameters for the generation backend: the sampled tokens'
    logprobs, the full distribution (no top-p), greedy when ``temperature <= 0``."""
    greedy = temperature <= 0
    return SamplingParams(
        temperature=1.0 if greedy else float(temperature),
        top_k=1 if greedy else 0,
        top_p=0.0,
        return_log_probs=True,
        num_tokens_to_generate=int(max_tokens),
        **extra,
    )


def _controller(
    model: Any,
    tokenizer: Any,
    spec: ModelSpec,
    context: Any,
    config: Any,
) -> Any:
    """The text-generation controller both engines drive: the model in a
    :class:`MaskedGPTInferenceWrapper` that knows the real vocabulary, and the tokenizer
    (an adapter with megatron-core's interface, or a Hugging Face tokenizer wrapped in one)."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    wrapped = MaskedGPTInferenceWrapper(model, config, context)
    wrapped.real_vocab_size = spec.vocab_size
    adapter = tokenizer if hasattr(tokenizer, "eod") else HFTokenizerAdapter(tokenizer)
    return TextGenerationController(wrapped, adapter)


@dataclass(frozen=True)
class EngineSizes:
    """The sizes an engine is built with (the generation's options; defaults: the builders').

    Attributes:
        tp: tensor-parallel size (the vocabulary is padded for it).
        make_vocab_size_divisible_by: the vocabulary's padding, per tensor-parallel rank.
        max_batch_size: requests that run at once.
        max_sequence_length: tokens one request may hold (prompt and completion).
        seed: the engine's sampling seed.
    """

    tp: int = 1
    make_vocab_size_divisible_by: int = 128
    max_batch_size: int = 8
    max_sequence_length: int = 512
    seed: int = 1234


def _wrapper_config(spec: ModelSpec, params_dtype: torch.dtype, sizes: EngineSizes) -> Any:
    """megatron-core's ``InferenceWrapperConfig`` of both engines (the padded vocabulary at ``tp``)."""
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )

    return InferenceWrapperConfig(
        hidden_size=spec.hidden_size,
        params_dtype=params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=spec.padded_vocab_size(sizes.tp, sizes.make_vocab_size_divisible_by),
        inference_max_requests=sizes.max_batch_size,
        inference_max_seq_length=sizes.max_sequence_length,
    )


def build_static_engine(
    model: Any,
    tokenizer: Any,
    spec: ModelSpec,
    *,
    tp: int = 1,
    make_vocab_size_divisible_by: int = 128,
    max_batch_size: int = 8,
    max_sequence_length: int = 512,
    seed: int = 1234,
) -> StaticInferenceEngine:
    """megatron-core's legacy static engine (KV cache, batched) for a local-spec ``GPTModel``.

    ``tokenizer`` is a Hugging Face tokenizer or an adapter with megatron-core's
    tokenizer interface (:class:`TokenIdAdapter`). megatron-core's parallel state
    must be initialised and every tensor-parallel rank must call ``generate``.
    Logits of the padded vocabulary are masked (see :class:`MaskedGPTInferenceWrapper`).
    """
    import warnings

    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine

    sizes = EngineSizes(tp, make_vocab_size_divisible_by, max_batch_size, max_sequence_length, seed)
    config = _wrapper_config(spec, next(model.parameters()).dtype, sizes)
    context = StaticInferenceContext.from_config(config)
    controller = _controller(model, tokenizer, spec, context, config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # "The static engine will be deprecated": it is the one that runs on CPU.
        warnings.filterwarnings("ignore", message=".*static engine will be deprecated")
        return StaticInferenceEngine(
            controller, max_batch_size=max_batch_size, random_seed=seed, legacy=True
        )


# ---------------------------------------------------------------------------
# Engine choice and megatron-core's dynamic engine (CUDA)
# ---------------------------------------------------------------------------

#: KV-cache block of the dynamic engine, in tokens (flash-attn 2 pages must be multiples of 256).
KV_BLOCK_TOKENS = 256


def kv_block_bytes(spec: ModelSpec, tp: int, dtype: torch.dtype) -> int:
    """Bytes of one dynamic-engine KV block on one tensor-parallel rank (keys and values)."""
    kv_heads = spec.num_query_groups // tp
    return 2 * spec.num_layers * KV_BLOCK_TOKENS * kv_heads * spec.head_dim * dtype.itemsize


def kv_cache_gib(
    spec: ModelSpec,
    tp: int,
    dtype: torch.dtype,
    max_batch_size: int,
    max_sequence_length: int,
    requested_gib: float = 0.0,
) -> float:
    """The dynamic engine's KV buffer per rank, in GiB.

    ``requested_gib > 0`` is taken as is; otherwise room for ``max_batch_size``
    sequences of ``max_sequence_length`` tokens, plus megatron-core's dummy block
    (and half a block so its ``int(gib * 2**30) // block`` does not round one away).
    """
    if requested_gib > 0:
        return float(requested_gib)
    per_request = -(-int(max_sequence_length) // KV_BLOCK_TOKENS)
    blocks = int(max_batch_size) * per_request + 1
    return (blocks + 0.5) * kv_block_bytes(spec, tp, dtype) / 2**30


#: Batch sizes a decode step is padded to and captured at (``generation.options.cuda_graphs``).
DEFAULT_CUDA_GRAPHS = 16


def build_dynamic_engine(
    model: Any,
    tokenizer: Any,
    spec: ModelSpec,
    *,
    kv_cache_gib_requested: float = 0.0,
    attention: str = "auto",
    cuda_graphs: int = DEFAULT_CUDA_GRAPHS,
    **sizes: int,
) -> DynamicInferenceEngine:
    """megatron-core's dynamic engine (paged KV cache, in-flight batching) for a local-spec
    ``GPTModel`` on the current CUDA device.

    ``sizes`` are the fields of :class:`EngineSizes` as keywords (``tp``,
    ``make_vocab_size_divisible_by``, ``max_batch_size``, ``max_sequence_length``,
    ``seed``), the keywords :func:`build_static_engine` takes.
    At most ``max_batch_size`` requests run at once (more wait for a slot); each
    may hold ``max_sequence_length`` tokens; the KV buffer is :func:`kv_cache_gib`.
    Only the last token's logits are computed (``materialize_only_last_token_logits``;
    no prompt logprobs), prompts are prefilled whole (no chunking: one step takes
    up to ``max(16384, max_sequence_length)`` tokens). ``cuda_graphs`` > 0: decode steps
    are padded to one of that many batch sizes and replayed from CUDA graphs of the decoder
    (:mod:`rlcore_megatron.decode_graphs`); 0: every step eager. ``attention``:
    :func:`rlcore_megatron.paged_attention.install`. Logits of the padded vocabulary are
    masked as in the static engine (:class:`MaskedGPTInferenceWrapper`).
    """
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    from rlcore_megatron import decode_graphs, paged_attention

    engine_sizes = EngineSizes(**sizes)
    if not torch.cuda.is_available():
        raise RuntimeError("megatron-core's dynamic inference engine needs CUDA")
    paged_attention.install(attention)
    dtype = model.config.params_dtype
    context = _dynamic_context(spec, dtype, engine_sizes, kv_cache_gib_requested, cuda_graphs)
    config = _wrapper_config(spec, dtype, engine_sizes)
    controller = _controller(model, tokenizer, spec, context, config)
    engine = DynamicInferenceEngine(
        controller, context, random_seed=int(engine_sizes.seed), enable_chunked_prefill=False
    )
    zero_kv_cache(engine)
    graphs = decode_graphs.install(model)
    graphs.clear()
    graphs.enabled = cuda_graphs > 0
    return engine


def zero_kv_cache(engine: DynamicInferenceEngine) -> None:
    """Zero the KV cache megatron-core just allocated (``torch.empty``): attention masks the
    keys past a request's length in its last block rather than skipping them, and a masked
    NaN would still poison the sum (:mod:`rlcore_megatron.flex_decode`)."""
    buffer = getattr(engine.context, "memory_buffer", None)
    if isinstance(buffer, torch.Tensor):
        buffer.zero_()


def _dynamic_context(
    spec: ModelSpec,
    dtype: torch.dtype,
    sizes: EngineSizes,
    kv_cache_gib_requested: float,
    cuda_graphs: int,
) -> Any:
    """The dynamic engine's context: its paged KV buffer (:func:`kv_cache_gib`), limits, and
    the batch sizes decode steps are padded to (``cuda_graphs`` of them; none for 0)."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    tp, max_sequence_length = sizes.tp, sizes.max_sequence_length
    max_tokens = DynamicInferenceContext.round_up_tokens(
        max(DynamicInferenceContext.DEFAULT_MAX_TOKENS, int(max_sequence_length)), tp
    )
    return DynamicInferenceContext(
        params_dtype=dtype,
        num_layers=spec.num_layers,
        kv_channels=spec.head_dim,
        num_attention_heads=spec.num_query_groups,
        max_sequence_length=int(max_sequence_length),
        buffer_size_gb=kv_cache_gib(
            spec, tp, dtype, sizes.max_batch_size, max_sequence_length, kv_cache_gib_requested
        ),
        max_requests=int(sizes.max_batch_size),
        max_tokens=max_tokens,
        block_size_tokens=KV_BLOCK_TOKENS,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        num_cuda_graphs=int(cuda_graphs) or None,
        materialize_only_last_token_logits=True,
        use_cuda_graphs_for_non_decode_steps=False,
        use_flashinfer_fused_rope=False,
        unified_memory_level=0,
    )


@dataclass(frozen=True)
class DynamicSample:
    """One sample of the dynamic engine: its tokens, their logprobs, and the engine's id of
    the request (versions of a refit that landed mid-way are kept by request id)."""

    token_ids: list[int]
    logprobs: list[float]
    request_id: int


def generate_dynamic(
    engine: DynamicInferenceEngine,
    prompts: list[list[int]],
    n: int,
    max_tokens: int,
    temperature: float,
    between_steps: Callable[[], object] | None = None,
) -> list[list[DynamicSample]]:
    """``n`` samples per prompt from the dynamic engine.

    A sample ends at the tokenizer's end-of-document id (kept) or after
    ``max_tokens``. ``logprobs`` are the sampled tokens' logprobs before
    temperature; ``temperature <= 0`` is greedy. The caller seeds
    ``engine.controller.sampling_rng``. The engine's step loop is run here, not by
    ``engine.generate``: ``between_steps()`` is called before every step (a refit
    queued by another thread lands there: :class:`rlcore.runtime.step_gate.StepGate`).
    Runs until every request finished; on an error the engine is reset (no request or
    KV block outlives the call).
    """
    longest = max(len(p) for p in prompts) + int(max_tokens)
    if longest > engine.context.max_sequence_length:
        raise ValueError(
            f"prompt + max_tokens is {longest} tokens, more than the engine's "
            f"generation.options.max_sequence_length ({engine.context.max_sequence_length})"
        )
    params = sampling_params(
        temperature,
        max_tokens,
        skip_prompt_log_probs=True,
        termination_id=int(engine.controller.tokenizer.eod),
    )
    flat = [list(p) for p in prompts for _ in range(n)]
    try:
        ids, records = _run_to_completion(engine, flat, params, between_steps)
        samples = [_sample_of(records[rid], rid) for rid in ids]
    except BaseException:
        reset_dynamic_engine(engine)
        raise
    return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]


def _run_to_completion(
    engine: DynamicInferenceEngine,
    flat: list[list[int]],
    params: SamplingParams,
    between_steps: Callable[[], object] | None,
) -> tuple[list[int], dict[int, Any]]:
    """Add one request per prompt and step the engine until none is left: the request ids
    in order, and each one's finished record."""
    ids = []
    for p in flat:
        rid = int(next(engine.request_counter))
        engine.add_request(rid, p, params)
        ids.append(rid)
    records: dict[int, Any] = {}
    while engine.has_unfinished_requests():
        if between_steps is not None:
            between_steps()
            if not engine.has_unfinished_requests():  # a refit that failed dropped them
                break
        for record in engine.step_modern()["finished_request_records"]:
            records[record.request_id] = record
    if len(records) != len(flat):
        raise RuntimeError(f"megatron dynamic engine finished {len(records)} of {len(flat)} requests")
    return ids, records


def _sample_of(record: Any, rid: int) -> DynamicSample:
    """A finished record (every checkpoint of the request merged) as a sample."""
    from megatron.core.inference.inference_request import Status

    req = record.merge()
    if req.status != Status.COMPLETED:
        raise RuntimeError(f"megatron dynamic engine: request {req.request_id} {req.status}")
    return DynamicSample(
        [int(t) for t in req.generated_tokens], [float(x) for x in req.generated_log_probs or []], rid
    )


def generated_so_far(engine: DynamicInferenceEngine) -> dict[int, int]:
    """Tokens each unfinished request of the engine has generated so far (over every
    checkpoint of it: a request the engine suspended and resumed is one record)."""
    from megatron.core.inference.inference_request import Status

    done = (Status.COMPLETED, Status.FAILED)
    counts = {}
    for rid, entry in engine.requests.items():
        parts = entry.record.requests
        if parts[-1].status in done:
            continue
        counts[int(rid)] = sum(len(r.generated_tokens or []) for r in parts)
    return counts


@contextlib.contextmanager
def requests_held(engine: DynamicInferenceEngine) -> Iterator[dict[int, int]]:
    """Hold the engine's requests while the body changes its weights (megatron-core's own
    pause, ``suspend`` / ``resume``): each request in flight is checkpointed (its prompt
    becomes prompt + tokens so far) and the KV cache released; on resume every request is
    added again, so its KV is computed with the new weights, and it goes on sampling.
    Yields the tokens each request had generated (where the new weights start).

    If the body fails the weights may be half-loaded: the requests are dropped (the engine
    reset), so no sample goes on with them, and the error propagates."""
    counts = generated_so_far(engine)
    suspend_dynamic_engine(engine)
    try:
        yield counts
    except BaseException:
        resume_dynamic_engine(engine)
        reset_dynamic_engine(engine)
        raise
    resume_dynamic_engine(engine)


def suspend_dynamic_engine(engine: DynamicInferenceEngine) -> None:
    """megatron-core's ``suspend`` (the context's buffers released), and the decoder's CUDA
    graphs dropped with their memory: they replay addresses ``resume`` will not give back."""
    from rlcore_megatron import decode_graphs

    wrapped = getattr(getattr(engine, "controller", None), "inference_wrapped_model", None)
    graphs = decode_graphs.of(getattr(wrapped, "model", None))
    if graphs is not None:
        graphs.clear()
    engine.suspend()


def resume_dynamic_engine(engine: DynamicInferenceEngine) -> None:
    """megatron-core's ``resume``, and the controller pointed at the request metadata it
    allocated.

    ``resume`` allocates the context's request metadata anew, but the text generation
    controller keeps the on-device metadata tensors it took at construction (megatron-core
    0.16: ``termination_id``), which the context no longer writes. Left alone, every step
    after a resume compares the sampled tokens with that stale tensor: after a sleep (which
    resets the engine first) it holds zeros, so a sampled token 0 ends its sample. On an
    H100 6 of 64 samples of 32 tokens ended early so (``bench/engine_history_gpu.py``), and
    a colocated run, which sleeps and wakes its engine every step, sampled otherwise than a
    resumed one from the same weights."""
    engine.resume()
    zero_kv_cache(engine)
    context, held = engine.context, engine.controller._request_metadata
    for label, _dtype, on_device in context.request_metadata_types:
        if on_device:
            held[label] = context.request_metadata[label]


def reset_dynamic_engine(engine: DynamicInferenceEngine) -> None:
    """Drop every request and release every KV block (megatron-core 0.16 has no prefix
    cache: after this no state from before remains). Call it when the weights change."""
    engine.reset()

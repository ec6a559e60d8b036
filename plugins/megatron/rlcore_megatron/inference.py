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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)

from rlcore_megatron.cpu_compat import causal_mask

if TYPE_CHECKING:
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
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    config = InferenceWrapperConfig(
        hidden_size=spec.hidden_size,
        params_dtype=next(model.parameters()).dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=spec.padded_vocab_size(tp, make_vocab_size_divisible_by),
        inference_max_requests=max_batch_size,
        inference_max_seq_length=max_sequence_length,
    )
    context = StaticInferenceContext.from_config(config)
    wrapped = MaskedGPTInferenceWrapper(model, config, context)
    wrapped.real_vocab_size = spec.vocab_size
    adapter = tokenizer if hasattr(tokenizer, "eod") else HFTokenizerAdapter(tokenizer)
    controller = TextGenerationController(wrapped, adapter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # "The static engine will be deprecated": it is the one that runs on CPU.
        warnings.filterwarnings("ignore", message=".*static engine will be deprecated")
        return StaticInferenceEngine(
            controller, max_batch_size=max_batch_size, random_seed=seed, legacy=True
        )

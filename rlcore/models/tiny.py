"""A tiny Llama-family Hugging Face checkpoint, made locally and deterministically.

No downloads: the tokenizer is a real Hugging Face ``tokenizers`` tokenizer
built here (a character-level vocabulary over digits, arithmetic symbols and
lower-case letters, with BOS/EOS/PAD/UNK), saved as ``tokenizer.json`` so that
transformers and vLLM load it like any other. The weights are random from a
seed. The result is cached under ``<cache>/tiny-model/<key>`` through atomic
publish, so concurrent inits that ask for it end with one complete copy.

The default shape (hidden 128, 4 heads) gives head size 32, which vLLM's CPU
attention accepts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlcore.config import ModelConfig, TinyModelConfig
from rlcore.errors import CancelToken, Deadline
from rlcore.models.tokenizer import TRANSFORMERS_LOCK

log = logging.getLogger(__name__)

#: transformers' lazy imports are not thread-safe (two threads importing LlamaConfig
#: at once get ImportError), and concurrent inits in one process ask for the same model:
#: the one lock of :mod:`rlcore.models.tokenizer`, under which the driver imports transformers.
_WRITE_LOCK = TRANSFORMERS_LOCK

#: Bump when the recipe below changes, so old cached models are not reused.
RECIPE_VERSION = 2
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]
ALPHABET = list("0123456789+-*=?() ,.:\n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def tiny_model_key(cfg: TinyModelConfig, dtype: str) -> str:
    fields = asdict(cfg)
    if not fields["eos_logit_bias"]:  # models made before the field existed keep their key
        del fields["eos_logit_bias"]
    blob = json.dumps({"recipe": RECIPE_VERSION, "dtype": dtype, **fields}, sort_keys=True)
    return f"llama-h{cfg.hidden_size}-l{cfg.num_layers}-s{cfg.seed}-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The character-level tokenizer (deterministic: the vocabulary is fixed, not trained)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own token; decoding joins them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    bos = vocab["<s>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
        # Chat servers (vLLM's /v1/chat/completions, which NeMo Gym calls) need a template:
        # the messages' text, lower-cased into the tiny vocabulary, one per line.
        chat_template=(
            "{% for m in messages %}{{ m['content'] | lower }}\n{% endfor %}"
            "{% if add_generation_prompt %}={% endif %}"
        ),
    )


def write_tiny_model(directory: Path, cfg: TinyModelConfig, dtype: str = "float32") -> None:
    """Write tokenizer, config and seeded random weights (safetensors) into ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(directory))
    vocab_size = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.device("cpu"):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    # Re-draw every weight from our own generator: independent of transformers' init order.
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if cfg.eos_logit_bias:
        shift_eos_logit(model, tokenizer.eos_token_id, cfg.eos_logit_bias, gen)
    from transformers.utils import logging as hf_logging

    # A progress bar for one tiny shard is noise, and tqdm leaves its monitor thread
    # running in this (driver) process afterwards.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.to(getattr(torch, dtype)).save_pretrained(str(directory), safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def shift_eos_logit(model: Any, eos: int, shift: float, gen: Any) -> None:
    """Shift ``eos``'s logit by about ``shift`` nats for any input, through weights alone
    (Llama has no output bias): dimension 0 of the residual stream becomes a constant
    feature. Every token's embedding holds ``c`` there, no attention or MLP output writes
    it and no layer norm passes it on (their weight 0), so the final norm's input holds
    ``c`` there whatever the text; the final norm's weight scales it to about 1 (calibrated
    on random text) and only ``eos``'s row of the output layer reads it, with weight
    ``shift``. Everything else the model computes is as drawn. ``model``: a transformers
    ``LlamaForCausalLM``; ``gen``: the recipe's ``torch.Generator`` (the calibration text)."""
    import torch

    body = model.model
    with torch.no_grad():
        c = float(body.embed_tokens.weight[:, 1:].std())  # a typical entry: the norms barely move
        body.embed_tokens.weight[:, 0] = c
        for layer in body.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
            layer.input_layernorm.weight[0] = 0.0
            layer.post_attention_layernorm.weight[0] = 0.0
        seen: list[torch.Tensor] = []
        hook = body.norm.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
        try:
            vocab = body.embed_tokens.weight.shape[0]
            body(input_ids=torch.randint(0, vocab, (2, 32), generator=gen))
        finally:
            hook.remove()
        rms = float(seen[0].float().pow(2).mean(-1).sqrt().mean())
        body.norm.weight[0] = rms / c
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = float(shift)


def ensure_model(
    model: ModelConfig,
    cache_dir: Path,
    *,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
) -> Path:
    """The checkpoint directory to use: ``model.path`` if set, else the cached tiny model.

    Creates and publishes the tiny model atomically the first time.
    """
    if model.path:
        path = Path(model.path).expanduser()
        if not (path / "config.json").is_file():
            from rlcore.errors import ConfigError

            raise ConfigError(
                f"config key 'model.path' is '{model.path}', which is not a Hugging Face checkpoint "
                "directory (no config.json); set model.path=null to use the tiny local model",
                key="model.path",
            )
        return path
    from rlcore.publish import is_complete, publish_dir

    destination = cache_dir / "tiny-model" / tiny_model_key(model.tiny, model.dtype)
    if is_complete(destination):  # made by an earlier run: no lock, no wait behind a writer
        return destination
    with _WRITE_LOCK:  # across processes, atomic publish picks one winner
        return publish_dir(
            destination,
            lambda d: write_tiny_model(d, model.tiny, model.dtype),
            cancel=cancel,
            deadline=deadline,
        )


def load_tokenizer(
    model: ModelConfig,
    cache_dir: Path,
    *,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
):  # -> transformers.PreTrainedTokenizerBase
    """The tokenizer of the run's model (made first if it is the tiny model), through
    :func:`rlcore.models.tokenizer.load`."""
    from rlcore.models import tokenizer

    return tokenizer.load(ensure_model(model, cache_dir, cancel=cancel, deadline=deadline))

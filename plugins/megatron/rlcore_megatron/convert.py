"""Hugging Face <-> Megatron weight mapping for Llama-family and Qwen2 models.

Megatron names below are those of megatron-core's ``GPTModel`` built with the
local layer spec (``get_gpt_layer_local_spec``), whose layers keep their norms
as separate modules (``input_layernorm``, ``pre_mlp_layernorm``) rather than
fused into the following linear layer as the Transformer Engine spec does.

=================================================  ==================================================
Hugging Face                                        Megatron (per tensor-parallel rank)
=================================================  ==================================================
``model.embed_tokens.weight`` [V, H]                ``embedding.word_embeddings.weight`` rows
                                                    ``[r*Vp/tp, (r+1)*Vp/tp)`` of the padded [Vp, H]
``model.layers.i.input_layernorm.weight``           ``decoder.layers.i.input_layernorm.weight``
``...self_attn.{q,k,v}_proj.{weight,bias}``         ``decoder.layers.i.self_attention.linear_qkv.*``:
                                                    per query group ``[q heads of the group; k; v]``,
                                                    groups split over ranks (column parallel)
``...self_attn.o_proj.weight``                      ``...self_attention.linear_proj.weight``,
                                                    input columns split (row parallel)
``...post_attention_layernorm.weight``              ``decoder.layers.i.pre_mlp_layernorm.weight``
``...mlp.{gate,up}_proj.weight``                    ``...mlp.linear_fc1.weight`` = ``[gate_r; up_r]``
                                                    (each rank holds its gate rows, then its up rows)
``...mlp.down_proj.weight``                         ``...mlp.linear_fc2.weight`` (row parallel)
``model.norm.weight``                               ``decoder.final_layernorm.weight``
``lm_head.weight`` (absent when tied)               ``output_layer.weight`` (column parallel, padded)
=================================================  ==================================================

The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp``
(as Megatron-LM does) with zero rows; the padded rows' logits must be ignored
(slice logits to ``hf vocab_size``). Export drops the padding again.

Both directions stream one layer at a time:

* :func:`hf_to_megatron` reads Hugging Face tensors through a lazy getter (see
  :class:`HFCheckpoint`, which maps safetensors files) and yields this rank's
  Megatron shards, so a conversion never holds more than one layer of
  Hugging Face tensors.
* :func:`megatron_to_hf` reads this rank's shards and yields full Hugging Face
  tensors, gathering tensor-parallel shards with a collective per tensor. Every
  rank of the tensor-parallel group must consume it in lockstep. This is what
  refit export uses: one layer in flight, never a full model copy.

Everything that touches megatron-core (:func:`megatron_config_from_hf`,
:func:`build_gpt_model`) imports it lazily; the mapping itself needs only torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

#: Bump when the mapping or the model recipe changes: converted checkpoints are keyed by it.
RECIPE_VERSION = 1

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ConversionError(ValueError):
    """A checkpoint this converter cannot map (architecture, option, shape or name)."""


# ---------------------------------------------------------------------------
# Model description
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """What the mapping needs to know about a Llama-family / Qwen2 model.

    Built from a Hugging Face config by :meth:`from_hf`; independent of
    transformers' version (the ``rope_theta`` / ``rope_parameters`` spellings).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    #: Llama 3.x frequency scaling factor, or None for plain RoPE.
    rope_scaling_factor: float | None
    tie_word_embeddings: bool
    #: Biases on q/k/v projections (Qwen2).
    qkv_bias: bool
    init_std: float

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelSpec:
        """From a ``transformers.PretrainedConfig``, its ``to_dict()``, or a config.json path."""
        cfg = _config_dict(hf_config)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConversionError(
                f"model_type {model_type!r} is not supported by the megatron converter; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        groups = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % groups:
            raise ConversionError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConversionError(
                f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)"
            )
        if model_type == "llama":
            if cfg.get("attention_bias") or cfg.get("mlp_bias"):
                raise ConversionError("Llama with attention_bias or mlp_bias is not supported")
            qkv_bias = False
        else:
            qkv_bias = True
            if cfg.get("use_sliding_window"):
                raise ConversionError("Qwen2 with use_sliding_window=True is not supported")
        theta, factor = _rope(cfg)
        return cls(
            model_type=model_type,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_query_groups=groups,
            head_dim=head_dim,
            ffn_hidden_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling_factor=factor,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            init_std=float(cfg.get("initializer_range", 0.02)),
        )

    def check_tp(self, tp: int) -> None:
        """Raise if the model cannot be split ``tp`` ways."""
        for what, n in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_query_groups),
            ("intermediate_size", self.ffn_hidden_size),
        ):
            if n % tp:
                raise ConversionError(
                    f"{what} = {n} is not divisible by tensor_model_parallel_size = {tp}"
                )

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Vocabulary size padded to a multiple of ``divisible_by * tp`` (Megatron-LM's rule)."""
        multiple = max(1, divisible_by) * tp
        return math.ceil(self.vocab_size / multiple) * multiple


def _config_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, str | Path):
        path = Path(hf_config)
        if path.is_dir():
            path = path / "config.json"
        return json.loads(path.read_text())
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(
        f"expected a Hugging Face config, a dict or a path, got {type(hf_config).__name__}"
    )


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None) from either transformers spelling."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not params and scaling:
        params = dict(scaling)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        # megatron-core's RotaryEmbedding._apply_scaling hard-codes these three.
        fixed = {
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        for key, value in fixed.items():
            if float(params.get(key, value)) != value:
                raise ConversionError(
                    f"llama3 rope scaling with {key}={params.get(key)} is not supported "
                    f"(megatron-core fixes it to {value})"
                )
        return theta, float(params.get("factor", 8.0))
    raise ConversionError(f"rope type {rope_type!r} is not supported (default and llama3 only)")


# ---------------------------------------------------------------------------
# Megatron config and model
# ---------------------------------------------------------------------------


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in _DTYPES:
        raise ConversionError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}")
    return getattr(torch, name)


def megatron_config_from_hf(
    hf_config: Any, tp: int = 1, *, dtype: str = "float32", **overrides: Any
) -> TransformerConfig:
    """megatron-core's ``TransformerConfig`` equivalent to a Llama / Qwen2 Hugging Face config.

    RMSNorm, SwiGLU, no linear biases except Qwen2's q/k/v, rotary embeddings
    (passed to :func:`build_gpt_model`, which also handles tied embeddings),
    dropout off, no fused kernels (they need CUDA extensions), softmax in fp32
    as Hugging Face computes it. ``overrides`` set any other field.
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = hf_config if isinstance(hf_config, ModelSpec) else ModelSpec.from_hf(hf_config)
    spec.check_tp(tp)
    params_dtype = torch_dtype(dtype)
    fields: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_std,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_softmax_in_fp32=True,
        # Fused kernels need Apex / TE / CUDA; the plain PyTorch paths are exact.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(
    hf_config: Any,
    tp: int = 1,
    *,
    dtype: str = "float32",
    make_vocab_size_divisible_by: int = 128,
    init_weights: bool = False,
    **config_overrides: Any,
) -> GPTModel:
    """A ``GPTModel`` with the local layer spec, shaped like ``hf_config``, split ``tp`` ways.

    megatron-core's parallel state must be initialised with this ``tp`` (see
    :func:`rlcore_megatron.parallel.init_model_parallel`). Weights are left
    uninitialised unless ``init_weights``: they are meant to be loaded
    (:func:`load_hf_weights` or a distributed checkpoint). The logits it returns
    are vocab-parallel and padded (:meth:`ModelSpec.padded_vocab_size`).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = hf_config if isinstance(hf_config, ModelSpec) else ModelSpec.from_hf(hf_config)
    config = megatron_config_from_hf(
        spec, tp, dtype=dtype, perform_initialization=init_weights, **config_overrides
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=spec.padded_vocab_size(tp, make_vocab_size_divisible_by),
        max_sequence_length=spec.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,  # type: ignore[arg-type]
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
    )
    mark_tensor_parallel(model)
    return model


def mark_tensor_parallel(model: Any) -> None:
    """Set megatron-core's tensor-parallel attributes on every parameter.

    megatron-core sets ``tensor_model_parallel`` / ``partition_dim`` on the weights of
    its parallel layers only while initialising them: with
    ``perform_initialization=False`` (weights to be loaded) they are missing, and
    code that tells sharded from replicated parameters by them (gradient norms,
    ``param_is_not_tensor_parallel_duplicate``) would take every shard for a
    duplicate. Set them as initialisation would (column-parallel and vocab-parallel
    weights split on dim 0, row-parallel on dim 1), and the defaults
    (replicated) elsewhere, as Megatron-LM's ``get_model`` does.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
    for param in model.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)


# ---------------------------------------------------------------------------
# Reading Hugging Face checkpoints lazily
# ---------------------------------------------------------------------------


class HFCheckpoint:
    """Lazy, read-only access to the tensors of a Hugging Face safetensors checkpoint.

    Tensors are read one at a time from memory-mapped files; nothing is loaded
    until asked for. Use as a context manager (or call :meth:`close`).
    """

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            single = self.directory / "model.safetensors"
            if not single.is_file():
                raise ConversionError(
                    f"{self.directory} has no model.safetensors or model.safetensors.index.json "
                    "(only safetensors checkpoints are supported)"
                )
            weight_map = {}
            with safe_open(str(single), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), single.name)
        self.weight_map = weight_map
        self._files: dict[str, Any] = {}
        self._safe_open = safe_open

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        try:
            file = self.weight_map[name]
        except KeyError:
            raise ConversionError(f"{self.directory}: tensor {name!r} is missing") from None
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = self._safe_open(
                str(self.directory / file), framework="pt"
            ).__enter__()
        return handle.get_tensor(name)

    def close(self) -> None:
        for handle in self._files.values():
            handle.__exit__(None, None, None)
        self._files.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------


def hf_layer_names(spec: ModelSpec, layer: int) -> list[str]:
    """Hugging Face tensor names of one decoder layer, in export order."""
    p = f"model.layers.{layer}."
    names = [p + "input_layernorm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        names.append(p + f"self_attn.{proj}.weight")
        if spec.qkv_bias:
            names.append(p + f"self_attn.{proj}.bias")
    names += [
        p + "self_attn.o_proj.weight",
        p + "post_attention_layernorm.weight",
        p + "mlp.gate_proj.weight",
        p + "mlp.up_proj.weight",
        p + "mlp.down_proj.weight",
    ]
    return names


def hf_names(spec: ModelSpec) -> list[str]:
    """Every Hugging Face tensor name of the model, in export order (what save_pretrained writes)."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        names += hf_layer_names(spec, i)
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every Hugging Face tensor, in export order, without touching any weight.

    What a refit checks against the receiver before the first byte moves.
    """
    h, d = spec.hidden_size, spec.head_dim
    q, kv, ffn = spec.num_heads * d, spec.num_query_groups * d, spec.ffn_hidden_size
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h),
        "mlp.down_proj.weight": (h, ffn),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for name in hf_names(spec):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[name] = (spec.vocab_size, h)
        elif name == "model.norm.weight":
            shapes[name] = (h,)
        else:
            shapes[name] = per_layer[name.split(".", 3)[3]]
    return shapes


def megatron_names(spec: ModelSpec) -> list[str]:
    """Every Megatron parameter name of the local-spec GPTModel."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if spec.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        names += [
            p + "self_attention.linear_proj.weight",
            p + "pre_mlp_layernorm.weight",
            p + "mlp.linear_fc1.weight",
            p + "mlp.linear_fc2.weight",
        ]
    names.append("decoder.final_layernorm.weight")
    if not spec.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


# ---------------------------------------------------------------------------
# HF -> Megatron
# ---------------------------------------------------------------------------


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank].clone() if size > 1 else t


def _pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    if t.shape[0] == padded:
        return t
    import torch

    out = torch.zeros((padded, *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def fuse_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's fused QKV (weight [out, in] or bias [out]): per query group, its q heads, k, v."""
    import torch

    g, d = spec.num_query_groups, spec.head_dim
    tail = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(g, spec.heads_per_group * d, *tail),
            k.reshape(g, d, *tail),
            v.reshape(g, d, *tail),
        ],
        dim=1,
    )
    return fused.reshape(-1, *tail)


def split_qkv(
    spec: ModelSpec, fused: torch.Tensor, groups: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv` for ``groups`` query groups (default: all)."""
    g = spec.num_query_groups if groups is None else groups
    d, hpg = spec.head_dim, spec.heads_per_group
    tail = fused.shape[1:]
    per_group = fused.reshape(g, (hpg + 2) * d, *tail)
    q, k, v = per_group.split([hpg * d, d, d], dim=1)
    return (
        q.reshape(g * hpg * d, *tail).contiguous(),
        k.reshape(g * d, *tail).contiguous(),
        v.reshape(g * d, *tail).contiguous(),
    )


def hf_to_megatron(
    get: Callable[[str], torch.Tensor],
    spec: ModelSpec,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    dtype: torch.dtype | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(megatron_name, shard)`` for tensor-parallel rank ``tp_rank``, one layer at a time.

    ``get(hf_name)`` returns a Hugging Face tensor (e.g. :meth:`HFCheckpoint.get`);
    each is read once, when its Megatron tensor is produced. ``dtype`` casts
    (None keeps the checkpoint's).
    """
    import torch

    spec.check_tp(tp_size)
    padded = spec.padded_vocab_size(tp_size, make_vocab_size_divisible_by)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def col(t: torch.Tensor) -> torch.Tensor:
        return cast(_shard(t, 0, tp_rank, tp_size))

    def row(t: torch.Tensor) -> torch.Tensor:
        return cast(_shard(t, 1, tp_rank, tp_size))

    embed = get("model.embed_tokens.weight")
    _check_shape("model.embed_tokens.weight", embed, (spec.vocab_size, spec.hidden_size))
    yield "embedding.word_embeddings.weight", col(_pad_vocab(embed, padded))
    del embed
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield m + "input_layernorm.weight", cast(get(h + "input_layernorm.weight"))
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = (get(h + f"self_attn.{p}_proj.{kind}") for p in ("q", "k", "v"))
            _check_shape(
                h + f"self_attn.q_proj.{kind}", q, (spec.num_heads * spec.head_dim,), prefix=True
            )
            _check_shape(
                h + f"self_attn.k_proj.{kind}",
                k,
                (spec.num_query_groups * spec.head_dim,),
                prefix=True,
            )
            yield m + f"self_attention.linear_qkv.{kind}", col(fuse_qkv(spec, q, k, v))
        yield m + "self_attention.linear_proj.weight", row(get(h + "self_attn.o_proj.weight"))
        yield m + "pre_mlp_layernorm.weight", cast(get(h + "post_attention_layernorm.weight"))
        gate = _shard(get(h + "mlp.gate_proj.weight"), 0, tp_rank, tp_size)
        up = _shard(get(h + "mlp.up_proj.weight"), 0, tp_rank, tp_size)
        yield m + "mlp.linear_fc1.weight", cast(torch.cat([gate, up], dim=0))
        del gate, up
        yield m + "mlp.linear_fc2.weight", row(get(h + "mlp.down_proj.weight"))
    yield "decoder.final_layernorm.weight", cast(get("model.norm.weight"))
    if not spec.tie_word_embeddings:
        yield "output_layer.weight", col(_pad_vocab(get("lm_head.weight"), padded))


def _check_shape(
    name: str, t: torch.Tensor, expected: tuple[int, ...], prefix: bool = False
) -> None:
    got = tuple(t.shape)
    if (got[: len(expected)] if prefix else got) != expected:
        raise ConversionError(f"tensor {name!r} has shape {list(got)}, expected {list(expected)}")


def load_hf_weights(
    model: Any,
    get: Callable[[str], torch.Tensor],
    spec: ModelSpec,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
) -> None:
    """Copy Hugging Face weights into a local-spec ``GPTModel`` (this rank's shards), in place.

    Checks that every parameter of the model is written exactly once with its
    exact shape; casts to the parameters' dtype.
    """
    import torch

    params = dict(model.named_parameters())
    written: set[str] = set()
    with torch.no_grad():
        for name, shard in hf_to_megatron(
            get,
            spec,
            tp_rank=tp_rank,
            tp_size=tp_size,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        ):
            param = params.get(name)
            if param is None or name in written:
                raise ConversionError(f"the Megatron model has no (other) parameter {name!r}")
            if tuple(param.shape) != tuple(shard.shape):
                raise ConversionError(
                    f"{name}: Megatron shard shape {list(param.shape)} != converted {list(shard.shape)} "
                    f"(tp_rank {tp_rank} of {tp_size})"
                )
            param.copy_(shard)
            written.add(name)
    missing = sorted(set(params) - written)
    if missing:
        raise ConversionError(f"the conversion did not write Megatron parameters {missing}")


# ---------------------------------------------------------------------------
# Megatron -> HF (streaming export)
# ---------------------------------------------------------------------------


def _all_gather(t: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
    if size == 1:
        return t
    import torch
    import torch.distributed as dist

    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def megatron_to_hf(
    get: Callable[[str], torch.Tensor],
    spec: ModelSpec,
    *,
    tp_size: int = 1,
    group: Any = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` from this rank's Megatron shards, one layer at a time.

    ``get(megatron_name)`` returns this rank's shard (e.g. ``params[name].detach()``).
    With ``tp_size > 1`` each tensor is all-gathered over ``group`` (the
    tensor-parallel group; torch.distributed's default group if None), so every
    rank of the group must iterate the generator to the end, in lockstep.
    Yields exactly :func:`hf_names` in that order, unpadded, in the model's dtype.
    """

    def col(name: str) -> torch.Tensor:
        return _all_gather(get(name), 0, group, tp_size)

    def row(name: str) -> torch.Tensor:
        return _all_gather(get(name), 1, group, tp_size)

    yield "model.embed_tokens.weight", col("embedding.word_embeddings.weight")[: spec.vocab_size]
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield h + "input_layernorm.weight", get(m + "input_layernorm.weight")
        qkv_parts = {}
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            qkv_parts[kind] = split_qkv(spec, col(m + f"self_attention.linear_qkv.{kind}"))
        for idx, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            for kind, parts in qkv_parts.items():
                yield h + f"self_attn.{proj}.{kind}", parts[idx]
        del qkv_parts
        yield h + "self_attn.o_proj.weight", row(m + "self_attention.linear_proj.weight")
        yield h + "post_attention_layernorm.weight", get(m + "pre_mlp_layernorm.weight")
        gate_r, up_r = get(m + "mlp.linear_fc1.weight").chunk(2, dim=0)
        yield h + "mlp.gate_proj.weight", _all_gather(gate_r, 0, group, tp_size).contiguous()
        yield h + "mlp.up_proj.weight", _all_gather(up_r, 0, group, tp_size).contiguous()
        yield h + "mlp.down_proj.weight", row(m + "mlp.linear_fc2.weight")
    yield "model.norm.weight", get("decoder.final_layernorm.weight")
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", col("output_layer.weight")[: spec.vocab_size]


def export_hf_weights(model: Any, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a (possibly tensor-parallel) local-spec ``GPTModel`` as Hugging Face tensors.

    Uses megatron-core's tensor-parallel group; see :func:`megatron_to_hf` for
    the lockstep rule. The yielded tensors are new (gathered) or detached views
    of the parameters: copy them before the next optimizer step if kept.
    """
    from megatron.core import parallel_state

    params = dict(model.named_parameters())
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None
    return megatron_to_hf(lambda name: params[name].detach(), spec, tp_size=tp_size, group=group)


# ---------------------------------------------------------------------------
# Hugging Face state_dict view (what refit moves between backends)
# ---------------------------------------------------------------------------

#: The alias a Hugging Face ``state_dict`` carries for tied input/output embeddings.
TIED_ALIAS = "lm_head.weight"


def state_dict_names(spec: ModelSpec) -> list[str]:
    """Names of the Hugging Face ``state_dict`` in refit stream order.

    :func:`hf_names` (what ``save_pretrained`` writes), plus ``lm_head.weight`` at
    the end for tied embeddings: ``state_dict()`` lists a tied weight under both
    names, and so do the other backends' refit specs (vLLM, FSDP), so the Megatron
    backend sends and accepts the alias too.
    """
    names = hf_names(spec)
    if spec.tie_word_embeddings:
        names.append(TIED_ALIAS)
    return names


def tensor_specs(spec: ModelSpec, dtype: str) -> list[Any]:
    """``rlcore.refit.specs.TensorSpec`` of every refit tensor, in stream order.

    From :func:`hf_shapes` alone: no weight is read or built, so a refit-fed
    generation and the driver can both answer it.
    """
    from rlcore.refit.specs import TensorSpec

    shapes = hf_shapes(spec)
    shapes.setdefault(TIED_ALIAS, (spec.vocab_size, spec.hidden_size))
    dtype = _DTYPES.get(dtype, dtype)
    return [TensorSpec(name, tuple(shapes[name]), dtype) for name in state_dict_names(spec)]


def export_hf_state_dict(model: Any, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`export_hf_weights` plus the tied alias: exactly :func:`state_dict_names`.

    Collective over the tensor-parallel group, like :func:`megatron_to_hf`: every
    rank of the group iterates it to the end. The alias is gathered again from the
    embedding (one more all-gather) rather than kept alive since the first tensor.
    """
    from megatron.core import parallel_state

    yield from export_hf_weights(model, spec)
    if spec.tie_word_embeddings:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None
        embed = dict(model.named_parameters())["embedding.word_embeddings.weight"].detach()
        yield TIED_ALIAS, _all_gather(embed, 0, group, tp_size)[: spec.vocab_size]


def vocab_divisor(padded_vocab_size: int, tp: int) -> int:
    """The ``make_vocab_size_divisible_by`` that pads to exactly ``padded_vocab_size`` at ``tp``.

    A checkpoint written at the policy's tensor-parallel size has that size's
    padded vocabulary; a generation at another size builds its model with this
    divisor so the global embedding shapes agree.
    """
    if padded_vocab_size % tp:
        raise ConversionError(
            f"padded vocabulary {padded_vocab_size} is not divisible by tensor_model_parallel_size {tp}"
        )
    return padded_vocab_size // tp


def load_hf_stream(
    model: Any,
    stream: Iterator[tuple[str, torch.Tensor]],
    spec: ModelSpec,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
) -> int:
    """Load a ``(hf_name, full tensor)`` stream, in any order, into a local-spec ``GPTModel``.

    The stream is what a refit receives (:func:`rlcore.refit.channels.receive_weights`):
    every name of :func:`hf_names`, optionally the tied alias (ignored: the embedding
    carries it). Tensors that arrive before :func:`hf_to_megatron` asks for them are
    buffered (at most about one layer when the sender's order follows the layers).
    Every parameter is written exactly once (:func:`load_hf_weights`); a name the
    model does not know, a missing one or a leftover raises :class:`ConversionError`.
    Returns the number of tensors consumed.
    """
    pending: dict[str, Any] = {}
    count = 0
    it = iter(stream)

    def get(name: str) -> torch.Tensor:
        nonlocal count
        while name not in pending:
            try:
                got, tensor = next(it)
            except StopIteration:
                raise ConversionError(f"refit stream ended before {name!r}") from None
            if got in pending:
                raise ConversionError(f"refit stream sent {got!r} twice")
            pending[got] = tensor
            count += 1
        return pending.pop(name)

    load_hf_weights(
        model,
        get,
        spec,
        tp_rank=tp_rank,
        tp_size=tp_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    for name, tensor in it:
        pending[name] = tensor
        count += 1
    if spec.tie_word_embeddings:
        pending.pop(TIED_ALIAS, None)
    if pending:
        raise ConversionError(
            f"refit stream sent tensors the model does not have: {sorted(pending)}"
        )
    return count

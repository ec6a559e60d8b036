"""HF <-> Megatron conversion: mapping units, logits equal to transformers, bit-exact round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlcore_megatron.convert import (
    ConversionError,
    ModelSpec,
    fuse_qkv,
    hf_names,
    hf_shapes,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    split_qkv,
)

LOGITS_TOL = 1e-4


def _spec(**over: Any) -> ModelSpec:
    cfg = dict(
        model_type="llama",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=51,
    )
    cfg.update(over)
    return ModelSpec.from_hf(cfg)


def test_spec_reads_both_rope_spellings() -> None:
    old = _spec(rope_theta=500000.0)
    new = _spec(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling_factor is None
    llama3 = _spec(
        rope_parameters={
            "rope_theta": 5e5,
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    assert llama3.rope_scaling_factor == 32.0
    qwen = _spec(model_type="qwen2")
    assert qwen.qkv_bias and not old.qkv_bias
    assert old.head_dim == 16 and old.heads_per_group == 2


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"model_type": "mistral"}, "not supported"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "low_freq_factor": 2.0}},
            "low_freq_factor",
        ),
    ],
)
def test_unsupported_configs_are_refused(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(ConversionError, match=match):
        _spec(**bad)


def test_tp_divisibility_and_vocab_padding() -> None:
    spec = _spec()
    assert spec.padded_vocab_size(1) == 128 and spec.padded_vocab_size(2) == 256
    assert spec.padded_vocab_size(2, divisible_by=1) == 52
    with pytest.raises(ConversionError, match="num_key_value_heads = 2 is not divisible"):
        spec.check_tp(4)


def test_qkv_fusion_interleaves_per_query_group_and_inverts() -> None:
    import torch

    spec = _spec()  # 4 heads, 2 groups, head_dim 16
    d, h = spec.head_dim, spec.hidden_size
    q = torch.arange(4 * d * h, dtype=torch.float32).reshape(4 * d, h)
    k = -torch.arange(2 * d * h, dtype=torch.float32).reshape(2 * d, h) - 1
    v = k - 1e6
    fused = fuse_qkv(spec, q, k, v)
    # Group 0: q heads 0,1 then k head 0 then v head 0; group 1 likewise.
    assert torch.equal(fused[: 2 * d], q[: 2 * d])
    assert torch.equal(fused[2 * d : 3 * d], k[:d])
    assert torch.equal(fused[3 * d : 4 * d], v[:d])
    assert torch.equal(fused[4 * d : 6 * d], q[2 * d :])
    for a, b in zip(split_qkv(spec, fused), (q, k, v), strict=True):
        assert torch.equal(a, b)
    bias = fuse_qkv(spec, q[:, 0], k[:, 0], v[:, 0])
    assert bias.shape == (8 * d,)
    assert all(
        torch.equal(a, b)
        for a, b in zip(split_qkv(spec, bias), (q[:, 0], k[:, 0], v[:, 0]), strict=True)
    )


def test_mapping_names_and_tp_shards_without_a_model() -> None:
    """hf_to_megatron at TP=2 gives shards that concatenate to the TP=1 tensors; export inverts TP=1."""
    import torch

    spec = _spec(model_type="qwen2", tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (51, 64),
        "model.norm.weight": (64,),
    }
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
            p + "self_attn.q_proj.weight": (64, 64),
            p + "self_attn.q_proj.bias": (64,),
            p + "self_attn.k_proj.weight": (32, 64),
            p + "self_attn.k_proj.bias": (32,),
            p + "self_attn.v_proj.weight": (32, 64),
            p + "self_attn.v_proj.bias": (32,),
            p + "self_attn.o_proj.weight": (64, 64),
            p + "mlp.gate_proj.weight": (96, 64),
            p + "mlp.up_proj.weight": (96, 64),
            p + "mlp.down_proj.weight": (64, 96),
        }
    hf = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    assert sorted(hf) == sorted(hf_names(spec))
    assert hf_shapes(spec) == shapes and list(hf_shapes(spec)) == hf_names(spec)
    full = dict(hf_to_megatron(hf.__getitem__, spec))
    assert list(full) == megatron_names(spec)
    assert full["embedding.word_embeddings.weight"].shape == (128, 64)
    assert not full["embedding.word_embeddings.weight"][51:].any()
    shards = [dict(hf_to_megatron(hf.__getitem__, spec, tp_rank=r, tp_size=2)) for r in range(2)]
    col = [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias",
    ]
    row = [
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    ]
    padded2 = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert padded2.shape == (256, 64) and torch.equal(padded2[:51], hf["model.embed_tokens.weight"])
    for n in col[1:]:
        assert torch.equal(torch.cat([s[n] for s in shards]), full[n])
    for n in row:
        assert torch.equal(torch.cat([s[n] for s in shards], dim=1), full[n])
    # linear_fc1 per rank is [gate_r; up_r], not a slice of the TP=1 [gate; up].
    fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:48], hf["model.layers.0.mlp.gate_proj.weight"][48:])
    assert torch.equal(fc1[48:], hf["model.layers.0.mlp.up_proj.weight"][48:])
    back = list(megatron_to_hf(full.__getitem__, spec))
    assert [n for n, _ in back] == hf_names(spec)
    for n, t in back:
        assert torch.equal(t, hf[n]), n


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_logits_match_transformers(tp_report: Any, tp: int, model: str) -> None:
    entry = tp_report(tp)[f"model/{model}"]
    assert "error" not in entry, entry["error"]
    assert entry["logits_max_abs_diff"] < LOGITS_TOL, entry
    assert entry["logits_std"] > 0.01, "logits too small for the comparison to mean anything"
    assert entry["padded_vocab"] == 128 * tp


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_reverse_mapping_round_trip_is_bit_exact(tp_report: Any, tp: int, model: str) -> None:
    entry = tp_report(tp)[f"model/{model}"]
    assert "error" not in entry, entry["error"]
    assert entry["export_names_equal"], entry
    assert entry["export_order_is_hf_names"], entry
    assert entry["export_mismatches"] == [], entry


def test_spec_of_rlcore_tiny_model(llama_dir: Path) -> None:
    import json

    cfg = json.loads((llama_dir / "config.json").read_text())
    spec = ModelSpec.from_hf(llama_dir)
    assert spec.model_type == "llama" and spec.vocab_size == cfg["vocab_size"]
    assert not spec.tie_word_embeddings and not spec.qkv_bias
    assert spec == ModelSpec.from_hf(cfg)

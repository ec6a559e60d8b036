"""Which megatron-core engine the generation runs (``generation.options.engine``), on CPU.

The dynamic engine itself needs CUDA (``test_megatron_dynamic_gpu.py``); here:
the option, its resolution, the error on CPU, the KV-cache sizing and the torch
paged attention that stands in for flash-attn (and FlexAttention's decode path through
megatron-core's method, eager here), against a direct computation.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlcore.config import resolve_options
from rlcore.errors import ConfigError
from rlcore.runtime.addresses import free_port
from rlcore_megatron import inference, paged_attention
from rlcore_megatron.convert import ModelSpec
from rlcore_megatron.options import MegatronOptions
from rlcore_megatron.worker import MegatronGenerationWorker

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's own


def test_engine_option_defaults_to_auto_and_is_checked() -> None:
    assert MegatronOptions().engine == "auto" and MegatronOptions().kv_cache_gib == 0.0
    opts = resolve_options(
        {"engine": "dynamic", "kv_cache_gib": 2},
        MegatronOptions,
        section="generation",
        backend="megatron",
    )
    assert (opts.engine, opts.kv_cache_gib) == ("dynamic", 2.0)


@pytest.mark.parametrize(
    ("engine", "device", "want"),
    [
        ("auto", "cpu", "static"),
        ("auto", "cuda", "dynamic"),
        ("static", "cpu", "static"),
        ("static", "cuda", "static"),
        ("dynamic", "cuda", "dynamic"),
    ],
)
def test_resolve_engine(engine: str, device: str, want: str) -> None:
    assert inference.resolve_engine(engine, device) == want


def test_dynamic_engine_on_cpu_is_a_config_error_naming_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError, match="needs CUDA") as err:
        inference.resolve_engine("dynamic", "cpu")
    assert err.value.key == "generation.options.engine"
    assert "auto or static" in str(err.value)
    with pytest.raises(ConfigError, match="use auto, static or dynamic") as err:
        inference.resolve_engine("paged", "cuda")
    assert err.value.key == "generation.options.engine"


def test_an_unknown_engine_is_refused_when_the_options_are_resolved() -> None:
    """As `rlcore plan` resolves them: before any worker starts."""
    with pytest.raises(ConfigError, match="'paged'; use auto, static or dynamic") as err:
        resolve_options({"engine": "paged"}, MegatronOptions, section="generation", backend="megatron")
    assert err.value.key == "generation.options.engine"


def test_generation_worker_refuses_the_dynamic_engine_on_cpu_before_building() -> None:
    # No process group: the check comes before anything is built.
    w = MegatronGenerationWorker(0, 1)
    with pytest.raises(ConfigError, match="generation.options.engine=dynamic needs CUDA"):
        w.start("/nonexistent", "float32", MegatronOptions(engine="dynamic"), "cpu")
    assert w.model is None and w.engine is None


def test_generation_worker_reports_the_static_engine_on_cpu(llama_dir: Path) -> None:
    w = MegatronGenerationWorker(0, 1)
    w.init_process_group("127.0.0.1", free_port(), "gloo", 60.0)
    try:
        info = w.start(str(llama_dir), "float32", MegatronOptions(max_batch_size=4))
        assert info["engine"] == "static" == w.engine_kind
        from megatron.core.inference.engines.static_engine import StaticInferenceEngine

        assert isinstance(w.engine, StaticInferenceEngine)
    finally:
        w.teardown()


def test_kv_cache_is_sized_for_max_batch_size_full_sequences() -> None:
    spec = ModelSpec.from_hf(
        {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        }
    )
    block = inference.kv_block_bytes(spec, 2, torch.bfloat16)
    assert block == 2 * 16 * 256 * 4 * 128 * 2  # k+v, layers, tokens, kv heads at TP=2, dim, bf16
    gib = inference.kv_cache_gib(spec, 2, torch.bfloat16, 32, 600)
    blocks = int(gib * 2**30) // block  # what megatron-core's context computes
    assert blocks == 32 * math.ceil(600 / 256) + 1  # + its dummy block
    assert inference.kv_cache_gib(spec, 2, torch.bfloat16, 32, 600, requested_gib=3.5) == 3.5


def _reference(q, k_cache, v_cache, requests, cu, scale):  # type: ignore[no-untyped-def]
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for r, (n_q, n_k, blocks) in enumerate(requests):
        keys = torch.cat([k_cache[b] for b in blocks])[:n_k]
        values = torch.cat([v_cache[b] for b in blocks])[:n_k]
        for j in range(n_q):
            t, pos = cu[r] + j, n_k - n_q + j
            for h in range(q.shape[1]):
                w = (keys[: pos + 1, h // group] @ q[t, h] * scale).softmax(0)
                out[t, h] = w @ values[: pos + 1, h // group]
    return out


def test_paged_attention_matches_direct_attention() -> None:
    """Prefill, decode and chunk-continuation requests in one step, grouped-query heads,
    a padded request and padding tokens; stale NaN in the cache past each length."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block, n_blocks = 4, 2, 8, 4, 16
    k_cache = torch.randn(n_blocks, block, kv_heads, dim)
    v_cache = torch.randn(n_blocks, block, kv_heads, dim)
    # (query tokens, key length, blocks): prefill, decode, a later chunk, a 1-token prefill
    requests = [(3, 3, [2, 7]), (1, 6, [0, 9]), (2, 9, [11, 3, 4]), (1, 1, [8])]
    for _, n_k, blocks in requests:
        for p in range(n_k, len(blocks) * block):
            k_cache[blocks[p // block], p % block] = float("nan")
            v_cache[blocks[p // block], p % block] = float("nan")
    table = torch.full((len(requests) + 1, 3), -1, dtype=torch.int32)  # + a padded request
    for r, (_, _, blocks) in enumerate(requests):
        table[r, : len(blocks)] = torch.tensor(blocks)
    n_q = torch.tensor([r[0] for r in requests] + [0])
    n_k = torch.tensor([r[1] for r in requests] + [0], dtype=torch.int32)
    cu = torch.zeros(len(n_q) + 1, dtype=torch.int32)
    cu[1:] = n_q.cumsum(0)
    q = torch.randn(int(cu[-1]) + 3, heads, dim)  # 3 padding tokens
    scale = dim**-0.5
    kv = paged_attention.PagedKV(k_cache, v_cache, cu, n_k, table, int(n_q.max()), int(n_k.max()))
    got = paged_attention.paged_attention(q, kv, scale)
    want = _reference(q, k_cache, v_cache, requests, cu.tolist(), scale)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 1e-5
    assert (got[int(cu[-1]) :] == 0).all()


@pytest.mark.parametrize("path", ["flex", "torch"])
def test_paged_attention_decode_step_through_megatrons_method_signature(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paged_attention, "_decode_path", path)
    torch.manual_seed(1)
    heads, kv_heads, dim, block = 4, 4, 8, 4
    k_cache, v_cache = torch.randn(6, block, kv_heads, dim), torch.randn(6, block, kv_heads, dim)
    table = torch.tensor([[1, 4], [0, -1]], dtype=torch.int32)
    n_k = torch.tensor([7, 2], dtype=torch.int32)
    q = torch.randn(2, 1, heads, dim)  # decode: one token per request

    class Layer:
        config = object()
        softmax_scale = None
        layer_number = 1

    got = paged_attention._flash_decode_and_prefill(
        Layer(), q, k_cache, v_cache, 1, 7, None, None, n_k, table, True
    )
    assert got.shape == (2, 1, heads, dim)
    requests = [(1, 7, [1, 4]), (1, 2, [0])]
    want = _reference(q[:, 0], k_cache, v_cache, requests, [0, 1], dim**-0.5)
    assert (got[:, 0] - want).abs().max() < 1e-5


def test_auto_attention_is_flash_attn_where_importable_and_flex_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core.transformer import attention

    monkeypatch.setattr(attention.Attention, "flash_decode_and_prefill", object())
    monkeypatch.setattr(attention, "is_fa_min_version", None)
    monkeypatch.setattr(paged_attention, "_decode_path", "flex")
    monkeypatch.setattr(attention, "flash_attn_varlen_func", lambda *a, **k: None)
    assert paged_attention.install("auto") == "flash"  # flash-attn present: nothing patched
    assert attention.is_fa_min_version is None
    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    monkeypatch.setattr(attention, "HAVE_FA3", False)
    assert paged_attention.install("auto") == "flex"
    assert attention.Attention.flash_decode_and_prefill is paged_attention._flash_decode_and_prefill
    assert attention.is_fa_min_version("2.7.3") is True
    assert paged_attention.install("torch") == "torch"  # idempotent patch, the decode path switched
    assert paged_attention._decode_path == "torch"


def test_flash_attention_asked_for_without_flash_attn_is_refused_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core.transformer import attention

    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    monkeypatch.setattr(attention, "HAVE_FA3", False)
    with pytest.raises(ConfigError, match=r"generation.options.attention=flash needs flash-attn"):
        paged_attention.resolve("flash")
    with pytest.raises(ConfigError, match=r"generation.options.attention.*'flesh'"):
        MegatronOptions(attention="flesh")


# -- Refits in flight (generation.options.inflight_refit; the landing itself: the GPU tests) ----


INFLIGHT_REFUSED = r"generation.options.inflight_refit.*dynamic engine.*inflight_refit=false"


@pytest.mark.parametrize(
    "options",
    [{"engine": "static"}, {"tensor_model_parallel_size": 2}, {"device": "cpu"}],
    ids=["static-engine", "tp2", "cpu-device"],
)
def test_inflight_refit_the_options_rule_out_is_refused_when_they_are_resolved(options: dict) -> None:
    """What the options alone decide (an explicit static engine or CPU device, TP > 1) is a
    config error when the options are resolved, as `rlcore plan` does; off, any of them is fine."""
    resolve_options(options, MegatronOptions, section="generation", backend="megatron")
    with pytest.raises(ConfigError, match=INFLIGHT_REFUSED) as err:
        resolve_options({**options, "inflight_refit": True}, MegatronOptions, section="generation", backend="megatron")
    assert err.value.key == "generation.options.inflight_refit"


@pytest.mark.parametrize(("resolved", "ok"), [("dynamic", True), ("static", False)])
def test_inflight_refit_on_an_auto_engine_is_checked_again_once_the_device_is_known(resolved: str, ok: bool) -> None:
    """``engine: auto`` on ``device: auto`` waits for the device found at start: the
    generation's start checks the engine it resolved."""
    from rlcore_megatron.options import check_inflight_refit

    options = resolve_options({"inflight_refit": True}, MegatronOptions, section="generation", backend="megatron")
    assert options.planned_engine() is None
    if ok:
        check_inflight_refit(options, resolved)
        return
    with pytest.raises(ConfigError, match=INFLIGHT_REFUSED):
        check_inflight_refit(options, resolved)


def test_rlcore_plan_refuses_inflight_refit_on_the_static_engine(tmp_path: Path) -> None:
    """Through the core's preparation of a run (what `rlcore plan` and `rlcore run` do first)."""
    from rlcore.config import load_config
    from rlcore.setup.preflight import prepare_checked
    from rlcore.setup.registry import load_registry

    example = Path(__file__).resolve().parents[3] / "examples" / "megatron.yaml"
    cfg = load_config(
        str(example),
        [f"setup.cache_dir={tmp_path}", "generation.options.engine=static", "generation.options.inflight_refit=true"],
    )
    with pytest.raises(ConfigError, match=INFLIGHT_REFUSED) as err:
        prepare_checked(cfg, load_registry(cfg.plugins.allow))
    assert err.value.key == "generation.options.inflight_refit"


@pytest.mark.parametrize(
    ("options", "landing"),
    [
        ({}, "between_calls"),  # off by default: the refit waits for the call in flight
        ({"inflight_refit": True, "engine": "dynamic"}, "pause"),
        ({"engine": "dynamic", "tensor_model_parallel_size": 2}, "between_calls"),
        # (inflight_refit with the static engine or TP > 1: refused when resolved, above)
    ],
)
def test_the_declared_landing_follows_the_option(options: dict, landing: str) -> None:
    import dataclasses

    from rlcore_megatron.plugin import rlcore_declare_backend

    decl = rlcore_declare_backend()
    view = {"options": dataclasses.asdict(MegatronOptions(**options))}
    got = decl.refit_landing(view)
    assert got.landing.value == landing
    assert got.token_versions == (landing == "pause")


def test_each_token_takes_the_version_of_the_last_refit_before_it() -> None:
    worker = MegatronGenerationWorker(0, 1)
    worker._landed = {7: [(2, 11), (5, 12)], 8: [(0, 11)]}
    assert worker._versions(7, 6, 10) == [10, 10, 11, 11, 11, 12]
    assert worker._versions(8, 3, 10) == [11, 11, 11]  # a request still waiting when it landed
    assert worker._versions(9, 2, 10) == [10, 10]  # done before the refit
    worker.eos_ids = {2}  # the cut keeps the versions aligned with the tokens
    cut = worker._cut_at_eos([5, 2, 9], [-0.1, -0.2, -0.3], [10, 11, 11])
    assert cut == {"token_ids": [5, 2], "logprobs": [-0.1, -0.2], "versions": [10, 11]}

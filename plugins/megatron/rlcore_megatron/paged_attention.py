"""Paged attention in plain torch, for megatron-core's dynamic engine without flash-attn.

megatron-core 0.16's dynamic inference engine keeps its KV cache in fixed-size
blocks and runs attention through flash-attn's paged kernels
(``flash_attn_varlen_func`` with a ``block_table`` for prefill and mixed steps,
``flash_attn_with_kvcache`` for decode-only steps), from
``Attention.flash_decode_and_prefill``; ``Attention.forward`` also asserts that
flash-attn >= 2.7.3 is installed. flash-attn has no wheels on PyPI (it compiles
for hours against one torch/CUDA pair), so rlcore's GPU machines do not have it.

:func:`install` replaces that one method (``generation.options.attention``:
:data:`rlcore_megatron.options.ATTENTIONS`; ``auto`` only when neither flash-attn 2 nor 3 is importable):

* decode-only steps (one query token per request: nearly every step of a long
  completion) go through FlexAttention over the paged cache
  (:mod:`rlcore_megatron.flex_decode`: each request's keys read once, where they lie);
* prefill and mixed steps, and every step with ``attention: torch``, go through
  :func:`paged_attention`: the same computation in torch (gather the request's
  blocks, a causal mask aligned to the end of each request's keys as flash-attn's,
  ``scaled_dot_product_attention``). It reads each request's blocks up to the step's
  longest key length, so it moves more memory than a paged kernel.

Megatron's own code keeps doing everything else (appending to the cache, RoPE,
block allocation). Both paths are free of host synchronisation, so a decode step
can be captured in a CUDA graph (:mod:`rlcore_megatron.decode_graphs`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_LOCK = threading.Lock()

#: The patched method's path for decode-only steps (:func:`install` sets it).
_decode_path = "flex"
#: The decode step's mask, made at its first layer and read by the others (per thread).
_step = threading.local()


@dataclass(frozen=True)
class PagedKV:
    """One step's block-paged KV cache and where each request's queries and keys are.

    Attributes:
        k_cache, v_cache: ``[blocks, block_size, kv_heads, dim]``.
        cu_seqlens_q: request ``r`` owns query tokens ``cu_seqlens_q[r]:cu_seqlens_q[r + 1]``.
        seqlens_k: request ``r``'s keys are the first ``seqlens_k[r]`` positions of its blocks.
        block_table: ``[requests, blocks per request]``, request ``r``'s blocks (``-1`` = none).
        max_seqlen_q, max_seqlen_k: bounds of the per-request lengths (Python ints, so
            nothing here waits for the GPU).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def paged_attention(q: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    """Causal attention of packed query tokens over a block-paged KV cache.

    ``q`` is ``[tokens, heads, dim]``: request ``r`` owns tokens
    ``kv.cu_seqlens_q[r]:kv.cu_seqlens_q[r + 1]`` (tokens past the last request are
    padding and get zeros). Request ``r``'s keys are the first ``kv.seqlens_k[r]``
    positions of its blocks ``kv.block_table[r]``, the query tokens being its last
    ``len_q`` positions (the mask is aligned bottom-right, as flash-attn's
    ``causal=True``). ``heads`` is a multiple of ``kv_heads`` (grouped-query
    attention: query head ``h`` reads kv head ``h // group``). Returns
    ``[tokens, heads, dim]``.
    """
    tokens = q.shape[0]
    requests = kv.block_table.shape[0]
    if tokens == 0 or requests == 0:
        return torch.zeros_like(q)
    block_size = kv.k_cache.shape[1]
    n_blocks = min(kv.block_table.shape[1], max(1, -(-int(kv.max_seqlen_k) // block_size)))
    width = n_blocks * block_size  # key positions read per request
    q_width = max(1, int(kv.max_seqlen_q))

    len_k = kv.seqlens_k[:requests].long()
    cu = kv.cu_seqlens_q[: requests + 1].long()
    len_q = cu[1:] - cu[:-1]
    key_pos = torch.arange(width, device=q.device)
    key_ok = key_pos < len_k[:, None]  # [requests, width]

    keys, values = _gather_keys_values(kv, key_ok, n_blocks)
    query, slot, valid = _pack_queries(q, cu, q_width)

    # Query i of request r sits at key position len_k - len_q + i and sees keys up to it.
    q_pos = (len_k - len_q)[:, None] + torch.arange(q_width, device=q.device)
    mask = (key_pos <= q_pos[:, :, None]) & key_ok[:, None, :]  # [requests, q_width, width]
    mask[..., 0] |= ~mask.any(-1)  # padding rows: one visible key keeps the softmax finite

    out = _attend(query, keys, values, mask, scale)  # [requests, heads, q_width, dim]
    flat = out.transpose(1, 2).reshape(requests * q_width, q.shape[1], q.shape[2])
    picked = flat[slot.clamp(max=requests * q_width - 1)]
    return torch.where(valid[:, None, None], picked, 0)


def _gather_keys_values(
    kv: PagedKV, key_ok: torch.Tensor, n_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each request, ``[requests, width, kv_heads, dim]``, positions past
    its length zeroed (the cache there is stale or never written; 0 * NaN would leak
    through the softmax)."""
    requests, width = key_ok.shape
    kv_heads, dim = kv.k_cache.shape[2], kv.k_cache.shape[3]
    pages = kv.block_table[:, :n_blocks].long().clamp(min=0)
    keep = key_ok[:, :, None, None]
    keys = kv.k_cache[pages].reshape(requests, width, kv_heads, dim).where(keep, 0)
    values = kv.v_cache[pages].reshape(requests, width, kv_heads, dim).where(keep, 0)
    return keys, values


def _pack_queries(
    q: torch.Tensor, cu: torch.Tensor, q_width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed query tokens -> ``[requests, heads, q_width, dim]``, with each token's slot and
    whether it belongs to a request. Padding tokens get slots of their own past the end
    (unique, so the scatter is deterministic) and are dropped after."""
    tokens, heads, dim = q.shape
    requests = cu.shape[0] - 1
    token = torch.arange(tokens, device=q.device)
    req = torch.searchsorted(cu[1:], token, right=True)
    req_c = req.clamp(max=requests - 1)
    offset = token - cu[req_c]
    valid = (req < requests) & (offset < q_width)
    slot = torch.where(valid, req_c * q_width + offset, requests * q_width + token)
    padded = q.new_zeros(requests * q_width + tokens, heads, dim).index_copy_(0, slot, q)
    query = padded[: requests * q_width].view(requests, q_width, heads, dim).transpose(1, 2)
    return query, slot, valid


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with each kv head repeated for its query heads."""
    heads, kv_heads = query.shape[1], keys.shape[2]
    k_heads, v_heads = keys.transpose(1, 2), values.transpose(1, 2)
    if heads != kv_heads:
        k_heads = k_heads.repeat_interleave(heads // kv_heads, dim=1)
        v_heads = v_heads.repeat_interleave(heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(
        query, k_heads, v_heads, attn_mask=mask[:, None], scale=scale
    )


def _flash_decode_and_prefill(
    self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *step: Any
) -> torch.Tensor:
    """``Attention.flash_decode_and_prefill`` (megatron-core 0.16) over :func:`paged_attention`.

    ``step`` is the rest of megatron-core's arguments, positional in its call:
    ``max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table,
    is_decode_only``. Decode-only steps pass ``q`` as ``[requests, 1, heads, dim]`` (one
    token per request), the others as ``[tokens, 1, heads, dim]`` with ``cu_seqlens_q``;
    both return ``[tokens, 1, heads, dim]`` as megatron-core's flash-attn calls do.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    max_seqlen_q, max_seqlen_k, cu_seqlens_q, _, seqlens_k, block_table, is_decode_only = step
    if isinstance(self.config, MLATransformerConfig):
        raise NotImplementedError("rlcore's torch paged attention does not cover MLA")
    scale = getattr(self, "softmax_scale", None)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    flat = q.reshape(q.shape[0], q.shape[-2], q.shape[-1])
    if is_decode_only and _decode_path == "flex":
        out = _flex_or_none(self.layer_number, flat, k, v, seqlens_k, block_table, scale)
        if out is not None:
            return out.unsqueeze(1)
    if is_decode_only:
        cu_seqlens_q = torch.arange(block_table.shape[0] + 1, dtype=torch.int32, device=q.device)
        max_seqlen_q = 1
    kv = PagedKV(k, v, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q, max_seqlen_k)
    return paged_attention(flat, kv, scale).unsqueeze(1)


_flash_decode_and_prefill._rlcore_paged_attention = True  # type: ignore[attr-defined]


def _flex_or_none(
    layer_number: int,
    flat: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """The decode step through FlexAttention, or None once it has failed here (its compile,
    say, on a torch or GPU it does not support): then the torch path serves every step from
    now on, and the warning says why. A capture in progress is not a failure of FlexAttention
    and propagates (:mod:`rlcore_megatron.decode_graphs` handles it)."""
    global _decode_path
    from rlcore_megatron import flex_decode

    try:
        mask = _decode_mask(layer_number, seqlens_k, block_table, k.shape)
        return flex_decode.paged_decode(flat, k, v, mask, scale, compiled=flat.is_cuda)
    except Exception as err:
        if flat.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        _decode_path = "torch"
        log.warning(
            "megatron generation: FlexAttention failed for a decode step (%s: %s); decode steps use "
            "the torch paged attention from now on (generation.options.attention=torch says so up front)",
            type(err).__name__, str(err)[:300],
        )
        return None


def _decode_mask(layer_number: int, seqlens_k: torch.Tensor, block_table: torch.Tensor, cache_shape: Any) -> Any:
    """The step's :class:`rlcore_megatron.flex_decode.StepMask`, made at its first layer: a
    layer number not above the last one seen starts a new step (the model's layers run in
    order), so every layer of a step, and of a CUDA graph's capture, reads the same one."""
    from rlcore_megatron import flex_decode

    last = getattr(_step, "layer", None)
    if last is None or layer_number <= last or _step.table is not block_table:
        blocks, block_size = cache_shape[0], cache_shape[1]
        _step.mask = flex_decode.step_mask(seqlens_k, block_table, blocks, block_size)
        _step.table = block_table
    _step.layer = layer_number
    return _step.mask


def flash_attn_available() -> bool:
    """Whether megatron-core found flash-attn (2 or 3) for its dynamic-batching attention."""
    from megatron.core.transformer import attention

    return bool(attention.HAVE_FA3 or attention.flash_attn_varlen_func is not None)


def resolve(attention: str) -> str:
    """``flash``, ``flex`` or ``torch`` for ``generation.options.attention`` here: ``auto`` is
    flash-attn where it is importable, else ``flex``; ``flash`` without flash-attn is a
    :class:`~rlcore.errors.ConfigError` naming the key."""
    from rlcore.errors import ConfigError
    from rlcore_megatron.options import check_attention_name

    key = "generation.options.attention"
    check_attention_name(attention)
    if attention == "auto":
        return "flash" if flash_attn_available() else "flex"
    if attention == "flash" and not flash_attn_available():
        raise ConfigError(
            f"{key}=flash needs flash-attn (2 or 3), which is not importable here; "
            f"set {key}=auto (FlexAttention) or install flash-attn",
            key=key,
        )
    return attention


def install(attention: str = "auto") -> str:
    """Route megatron-core's dynamic-batching attention as ``attention`` says
    (:func:`resolve`) and return the path in use: ``flash`` leaves megatron-core as it is;
    ``flex`` and ``torch`` patch ``Attention.flash_decode_and_prefill`` (and, without
    flash-attn, the version check of ``Attention.forward``, ``attention.is_fa_min_version``,
    which that module uses for nothing else). The patch is process-wide (the last call's
    decode path holds); thread-safe."""
    global _decode_path
    from megatron.core.transformer import attention as mcore_attention

    path = resolve(attention)
    if path == "flash":
        return path
    with _LOCK:
        _decode_path = path
        if not getattr(mcore_attention.Attention.flash_decode_and_prefill, "_rlcore_paged_attention", False):
            mcore_attention.Attention.flash_decode_and_prefill = _flash_decode_and_prefill
            if not flash_attn_available():
                mcore_attention.is_fa_min_version = _no_flash_attn_needed
            log.info("megatron-core's dynamic engine attends through rlcore's %s path", path)
    return path


def _no_flash_attn_needed(version: str, check_equality: bool = True) -> bool:
    return True

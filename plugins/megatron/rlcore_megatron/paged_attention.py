"""Paged attention in plain torch, for megatron-core's dynamic engine without flash-attn.

megatron-core 0.16's dynamic inference engine keeps its KV cache in fixed-size
blocks and runs attention through flash-attn's paged kernels
(``flash_attn_varlen_func`` with a ``block_table`` for prefill and mixed steps,
``flash_attn_with_kvcache`` for decode-only steps), from
``Attention.flash_decode_and_prefill``; ``Attention.forward`` also asserts that
flash-attn >= 2.7.3 is installed. flash-attn has no wheels on PyPI (it compiles
for hours against one torch/CUDA pair), so rlcore's GPU machines do not have it.

:func:`install` replaces that one method, only when neither flash-attn 2 nor 3
is importable, with :func:`paged_attention`: the same computation in torch
(gather the request's blocks, a causal mask aligned to the end of each
request's keys as flash-attn's, ``scaled_dot_product_attention``). It reads each
request's blocks up to the step's longest key length, so it moves more memory
than flash-attn's kernels; with flash-attn installed nothing is patched.
Megatron's own code keeps doing everything else (appending to the cache, RoPE,
block allocation).
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
    if is_decode_only:
        cu_seqlens_q = torch.arange(block_table.shape[0] + 1, dtype=torch.int32, device=q.device)
        max_seqlen_q = 1
    kv = PagedKV(k, v, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q, max_seqlen_k)
    return paged_attention(flat, kv, scale).unsqueeze(1)


_flash_decode_and_prefill._rlcore_paged_attention = True  # type: ignore[attr-defined]


def flash_attn_available() -> bool:
    """Whether megatron-core found flash-attn (2 or 3) for its dynamic-batching attention."""
    from megatron.core.transformer import attention

    return bool(attention.HAVE_FA3 or attention.flash_attn_varlen_func is not None)


def install() -> bool:
    """Route megatron-core's dynamic-batching attention through :func:`paged_attention`.

    Only when flash-attn is absent (:func:`flash_attn_available`); idempotent and
    thread-safe. Patches ``Attention.flash_decode_and_prefill`` and the flash-attn
    version check of ``Attention.forward`` (``attention.is_fa_min_version``, which
    that module uses for nothing else). Returns whether the torch path is in use.
    """
    from megatron.core.transformer import attention

    if flash_attn_available():
        return False
    with _LOCK:
        if not getattr(
            attention.Attention.flash_decode_and_prefill, "_rlcore_paged_attention", False
        ):
            attention.Attention.flash_decode_and_prefill = _flash_decode_and_prefill
            attention.is_fa_min_version = _no_flash_attn_needed
            log.info(
                "flash-attn not found: megatron-core's dynamic engine uses torch paged attention"
            )
    return True


def _no_flash_attn_needed(version: str, check_equality: bool = True) -> bool:
    return True

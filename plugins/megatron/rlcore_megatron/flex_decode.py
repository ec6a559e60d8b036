"""Decode steps of megatron-core's dynamic engine through FlexAttention over the paged KV cache.

A decode step has one query token per request and reads each request's keys where they lie:
megatron-core's cache is ``[blocks, 256, kv_heads, dim]`` per layer, and a request owns the
blocks its row of the block table names. :func:`paged_decode` hands that cache to
``torch.nn.attention.flex_attention`` as one long key sequence (``[1, kv_heads, blocks * 256,
dim]``, a view: nothing is copied) and tells it, through a block mask, which 128-token pieces
of it each request reads. Compiled, FlexAttention's decoding kernel then reads every request's
keys and values once, with grouped-query heads, and skips the rest of the cache: the memory a
decode step must move, and no more. The torch path of :mod:`rlcore_megatron.paged_attention`
gathers every request's blocks up to the step's longest one into a dense copy first.

Keys past a request's length in its last block are masked, not skipped: their weight is 0,
and 0 x NaN is NaN, so the cache must hold finite values there. megatron-core allocates it
with ``torch.empty``; :func:`rlcore_megatron.inference.zero_kv_cache` zeroes it whenever it is
allocated, and after that it only ever holds keys and values the model computed.

The mask is made once per step (:class:`StepMask`) and serves every layer. Its ``mask_mod``
is the whole truth (a key belongs to the request and lies before its length), so eager
FlexAttention, which ignores the block structure, computes the same thing: the CPU tests
run it so against the torch path. The compiled kernel evaluates ``mask_mod`` only on each
request's last, partial piece; the full pieces before it are listed as such.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch

#: Tokens per FlexAttention block (a "piece"); megatron-core's KV blocks (256 tokens) are two
#: of them. A cache of smaller blocks (tests) takes its block size instead.
FLEX_BLOCK = 128

_COMPILE_LOCK = threading.Lock()
_compiled: Any = None


def _no_q_blocks() -> dict[str, bool]:
    """The query-side block lists serve only the backward pass: skipped where this torch can."""
    from torch.nn.attention.flex_attention import BlockMask

    return {"compute_q_blocks": False} if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {}


_NO_Q_BLOCKS = _no_q_blocks()


@dataclass(frozen=True)
class StepMask:
    """Which pieces of the cache each request of one decode step reads.

    Attributes:
        partial_count, partial_index: ``[requests, 1, 1]`` and ``[requests, 1, 1, pieces]``:
            the request's last piece when its length is not a multiple of :data:`FLEX_BLOCK`.
        full_count, full_index: the same for the pieces it reads whole, in order.
        owner, logical: ``[pieces + 1]``: the request that owns each piece of the cache and
            its place in that request (the last entry takes the table's padding).
        lengths: ``[requests]``: keys of each request.
        piece: tokens per piece.
    """

    partial_count: torch.Tensor
    partial_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor
    owner: torch.Tensor
    logical: torch.Tensor
    lengths: torch.Tensor
    piece: int


def step_mask(seqlens_k: torch.Tensor, block_table: torch.Tensor, cache_blocks: int, block_size: int) -> StepMask:
    """The :class:`StepMask` of a decode step: request ``r`` has ``seqlens_k[r]`` keys in its
    blocks ``block_table[r]`` (``-1``: none) of a cache of ``cache_blocks`` blocks of
    ``block_size`` tokens (a multiple of :data:`FLEX_BLOCK`, or smaller). Tensor operations
    only: safe to capture in a CUDA graph."""
    piece = min(FLEX_BLOCK, block_size)
    if block_size % piece:
        raise ValueError(f"KV blocks of {block_size} tokens are not a multiple of {FLEX_BLOCK}")
    device = block_table.device
    requests = block_table.shape[0]
    split = block_size // piece
    pieces = cache_blocks * split
    table = block_table.long().clamp(min=0)
    # Megatron block b holds pieces split * b .. split * b + split - 1, in order.
    mine = (table[:, :, None] * split + torch.arange(split, device=device)).reshape(requests, -1)
    width = mine.shape[1]
    lengths = seqlens_k[:requests].long()
    full = lengths // piece
    partial = (lengths - full * piece > 0).to(torch.int32)
    place = torch.arange(width, device=device).expand(requests, width)
    used = place * piece < lengths[:, None]
    target = torch.where(used, mine, pieces)  # unused entries land on the spare last slot
    owner = torch.full((pieces + 1,), -1, dtype=torch.long, device=device)
    owner.scatter_(0, target.reshape(-1), torch.arange(requests, device=device)[:, None].expand(requests, width).reshape(-1))
    logical = torch.zeros(pieces + 1, dtype=torch.long, device=device)
    logical.scatter_(0, target.reshape(-1), place.reshape(-1))
    full_index = torch.zeros(requests, pieces, dtype=torch.int32, device=device)
    full_index[:, :width] = mine.to(torch.int32)
    partial_index = torch.zeros(requests, pieces, dtype=torch.int32, device=device)
    partial_index[:, :1] = mine.gather(1, full.clamp(max=width - 1)[:, None]).to(torch.int32)
    return StepMask(
        partial.view(requests, 1, 1),
        partial_index.view(requests, 1, 1, pieces),
        full.to(torch.int32).view(requests, 1, 1),
        full_index.view(requests, 1, 1, pieces),
        owner,
        logical,
        lengths,
        piece,
    )


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    partial_count: torch.Tensor,
    partial_index: torch.Tensor,
    full_count: torch.Tensor,
    full_index: torch.Tensor,
    owner: torch.Tensor,
    logical: torch.Tensor,
    lengths: torch.Tensor,
    piece: int,
    scale: float,
) -> torch.Tensor:
    """FlexAttention of ``q`` ``[requests, heads, dim]`` over the cache (a :class:`StepMask`'s
    fields as tensors: what ``torch.compile`` takes as plain inputs)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    requests, heads, dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    keys = k_cache.view(1, blocks * block_size, kv_heads, dim).transpose(1, 2)
    values = v_cache.view(1, blocks * block_size, kv_heads, dim).transpose(1, 2)

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        at = kv_idx // piece
        return (owner[at] == b) & (logical[at] * piece + kv_idx % piece < lengths[b])

    block_mask = BlockMask.from_kv_blocks(
        partial_count,
        partial_index,
        full_count,
        full_index,
        BLOCK_SIZE=(FLEX_BLOCK, piece),
        mask_mod=visible,
        seq_lengths=(1, blocks * block_size),
        **_NO_Q_BLOCKS,
    )
    out = flex_attention(
        q.unsqueeze(2), keys, values, block_mask=block_mask, scale=scale, enable_gqa=heads != kv_heads
    )
    return out.squeeze(2)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: StepMask,
    scale: float,
    *,
    compiled: bool = True,
) -> torch.Tensor:
    """One query token per request (``q``: ``[requests, heads, dim]``) over the paged cache
    (``[blocks, block_size, kv_heads, dim]``); returns ``[requests, heads, dim]``. A request
    without keys gets zeros. ``compiled``: FlexAttention's fused kernel (``torch.compile``,
    recompiled once with the batch size dynamic when a second size comes); eager FlexAttention materialises every score of the whole cache
    and is for tests on small caches only."""
    attend = _compiled_attend() if compiled else _attend
    return attend(
        q,
        k_cache,
        v_cache,
        mask.partial_count,
        mask.partial_index,
        mask.full_count,
        mask.full_index,
        mask.owner,
        mask.logical,
        mask.lengths,
        mask.piece,
        scale,
    )


def _compiled_attend() -> Any:
    global _compiled
    with _COMPILE_LOCK:
        if _compiled is None:
            # Past dynamo's recompile limit a frame runs eagerly, and eager FlexAttention scores
            # the whole cache: leave room for dtypes and engines (one dynamic batch size each).
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), 64))
            _compiled = torch.compile(_attend, fullgraph=True)
    return _compiled

"""Decode steps of megatron-core's dynamic engine through FlexAttention over the paged KV cache.

A decode step has one query token per request and reads each request's keys where they lie:
megatron-core's cache is ``[blocks, 256, kv_heads, dim]`` per layer, and a request owns the
blocks its row of the block table names. :func:`paged_decode` hands that cache to
``torch.nn.attention.flex_attention`` as it lies in memory, one sequence of rows
``[1, 1, blocks * 256 * kv_heads, dim]`` (a view: nothing is copied; a ``[1, kv_heads, ...]``
view would be strided across heads, and FlexAttention copies such a key whole, the layer's
cache, every step), with every query head reading that one key "head". A block mask names
which 128-row pieces of it each request reads (a piece is 128 / kv_heads tokens of every kv
head), and its ``mask_mod`` keeps, of each piece, the rows of the query head's own kv head up
to the request's length. Compiled, FlexAttention's decoding kernel then reads every request's
keys and values once, all query heads of a request together, and skips the rest of the
cache: the memory a decode step must move, and no more. The torch path of
:mod:`rlcore_megatron.paged_attention` gathers every request's blocks up to the step's
longest one into a dense copy first.

Keys past a request's length in its last block are masked, not skipped: their weight is 0,
and 0 x NaN is NaN, so the cache must hold finite values there. megatron-core allocates it
with ``torch.empty``; :func:`rlcore_megatron.inference.zero_kv_cache` zeroes it whenever it is
allocated, and after that it only ever holds keys and values the model computed.

The mask is made once per step (:class:`StepMask`) and serves every layer. Its ``mask_mod``
is the whole truth (a row belongs to the request, to the query head's kv head, and lies
before the request's length), so eager FlexAttention, which ignores the block structure,
computes the same thing: the CPU tests run it so against the torch path.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch

#: Rows of the flattened cache per FlexAttention block (a "piece"); a megatron-core KV block
#: (256 tokens x kv_heads rows) is 2 x kv_heads of them. A cache of smaller blocks (tests)
#: takes its block's rows instead.
FLEX_BLOCK = 128

_COMPILE_LOCK = threading.Lock()
_compiled: Any = None


def _no_q_blocks() -> dict[str, bool]:
    """The query-side block lists serve only the backward pass: skipped where this torch can."""
    from torch.nn.attention.flex_attention import BlockMask

    known = inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if "compute_q_blocks" in known else {}


_NO_Q_BLOCKS = _no_q_blocks()


@dataclass(frozen=True)
class StepMask:
    """Which pieces of the flattened cache each request of one decode step reads.

    Attributes:
        count, index: ``[requests, 1, 1]`` and ``[requests, 1, 1, pieces]``: the pieces the
            request reads, in order (the first ``count``).
        owner, logical: ``[pieces + 1]``: the request that owns each piece of the cache and
            its place in that request (the last entry takes the table's padding).
        lengths: ``[requests]``: keys of each request.
        rows: rows per piece; ``rows // kv_heads`` tokens.
        kv_heads: rows per token.
    """

    count: torch.Tensor
    index: torch.Tensor
    owner: torch.Tensor
    logical: torch.Tensor
    lengths: torch.Tensor
    rows: int
    kv_heads: int


def step_mask(
    seqlens_k: torch.Tensor, block_table: torch.Tensor, cache_blocks: int, block_size: int, kv_heads: int
) -> StepMask:
    """The :class:`StepMask` of a decode step: request ``r`` has ``seqlens_k[r]`` keys in its
    blocks ``block_table[r]`` (``-1``: none) of a cache of ``cache_blocks`` blocks of
    ``block_size`` tokens of ``kv_heads`` rows each. Tensor operations only: safe to capture
    in a CUDA graph."""
    block_rows = block_size * kv_heads
    rows = min(FLEX_BLOCK, block_rows)
    if block_rows % rows or rows % kv_heads:
        raise ValueError(
            f"KV blocks of {block_size} tokens x {kv_heads} kv heads do not split into pieces of {rows} rows"
        )
    tokens = rows // kv_heads  # per piece
    device = block_table.device
    requests = block_table.shape[0]
    split = block_rows // rows
    pieces = cache_blocks * split
    table = block_table.long().clamp(min=0)
    # Megatron block b holds pieces split * b .. split * b + split - 1, in token order.
    mine = (table[:, :, None] * split + torch.arange(split, device=device)).reshape(requests, -1)
    width = mine.shape[1]
    lengths = seqlens_k[:requests].long()
    place = torch.arange(width, device=device).expand(requests, width)
    used = place * tokens < lengths[:, None]
    target = torch.where(used, mine, pieces)  # unused entries land on the spare last slot
    owner = torch.full((pieces + 1,), -1, dtype=torch.long, device=device)
    owner.scatter_(0, target.reshape(-1), torch.arange(requests, device=device)[:, None].expand(requests, width).reshape(-1))
    logical = torch.zeros(pieces + 1, dtype=torch.long, device=device)
    logical.scatter_(0, target.reshape(-1), place.reshape(-1))
    index = torch.zeros(requests, pieces, dtype=torch.int32, device=device)
    index[:, :width] = mine.to(torch.int32)
    count = used.sum(1).to(torch.int32)
    return StepMask(count.view(requests, 1, 1), index.view(requests, 1, 1, pieces), owner, logical, lengths, rows, kv_heads)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    count: torch.Tensor,
    index: torch.Tensor,
    owner: torch.Tensor,
    logical: torch.Tensor,
    lengths: torch.Tensor,
    rows: int,
    scale: float,
) -> torch.Tensor:
    """FlexAttention of ``q`` ``[requests, heads, dim]`` over the flattened cache (a
    :class:`StepMask`'s fields as plain inputs, what ``torch.compile`` takes)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    requests, heads, dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    length = blocks * block_size * kv_heads
    keys = k_cache.view(1, 1, length, dim)
    values = v_cache.view(1, 1, length, dim)
    group = heads // kv_heads
    tokens = rows // kv_heads

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        at = kv_idx // rows
        token = logical[at] * tokens + (kv_idx % rows) // kv_heads
        return (owner[at] == b) & (token < lengths[b]) & (kv_idx % kv_heads == h // group)

    block_mask = BlockMask.from_kv_blocks(
        count, index, BLOCK_SIZE=(FLEX_BLOCK, rows), mask_mod=visible, seq_lengths=(1, length), **_NO_Q_BLOCKS
    )
    out = flex_attention(q.unsqueeze(2), keys, values, block_mask=block_mask, scale=scale, enable_gqa=heads > 1)
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
    recompiled once with the batch size dynamic when a second size comes); eager
    FlexAttention scores the whole cache and is for tests on small caches only."""
    attend = _compiled_attend() if compiled else _attend
    return attend(
        q,
        k_cache,
        v_cache,
        mask.count,
        mask.index,
        mask.owner,
        mask.logical,
        mask.lengths,
        mask.rows,
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

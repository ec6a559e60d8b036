"""Decode steps of megatron-core's dynamic engine through FlexAttention over the paged KV cache.

A decode step has one query token per request and reads each request's keys where they lie:
megatron-core's cache is ``[blocks, 256, kv_heads, dim]`` per layer, and a request owns the
blocks its row of the block table names. :func:`paged_decode` hands that cache to
``torch.nn.attention.flex_attention`` as one long key sequence per kv head,
``[1, kv_heads, blocks * 256, dim]`` (a strided view made before the compiled call, so the
compiled function takes it as the input it is and copies nothing), and the queries as a batch
of requests, ``[requests, heads, 1, dim]``; the key batch of one serves every request. A block
mask names which 128-token pieces of the sequence each request reads, and its ``mask_mod``
keeps, of each piece, the positions before the request's length. With the batch size static
(padded to a power of two: a handful of compiles), FlexAttention picks its decoding kernel,
which reads each request's keys and values once for all query heads of a kv head and splits
long contexts across the GPU: the memory a decode step must move, and no more
(``bench/flex_decode_kernels.py`` measures each layout against that floor). The torch path of
:mod:`rlcore_megatron.paged_attention` gathers every request's blocks up to the step's longest
one into a dense copy first.

Keys past a request's length in its last block are masked, not skipped: their weight is 0,
and 0 x NaN is NaN, so the cache must hold finite values there. megatron-core allocates it
with ``torch.empty``; :func:`rlcore_megatron.inference.zero_kv_cache` zeroes it whenever it is
allocated, and after that it only ever holds keys and values the model computed.

The mask is made once per step (:class:`StepMask`) and serves every layer. Its ``mask_mod``
is the whole truth (the piece belongs to the request and the position lies before its
length), so eager FlexAttention, which ignores the block structure, computes the same thing:
the CPU tests run it so against the torch path.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch

#: Tokens per FlexAttention key block (a "piece"); a megatron-core KV block of 256 tokens is
#: two. A cache of smaller blocks (tests) takes its block size instead.
FLEX_BLOCK = 128
#: The fewest requests a compiled call is padded to (the batch is padded to a power of two).
MIN_BATCH = 16

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
    """Which pieces of the cache each request of one decode step reads.

    Attributes:
        count, index: ``[batch, 1, 1]`` and ``[batch, 1, 1, pieces]``: the pieces the
            request reads, in order (the first ``count``); ``batch`` is the step's requests
            padded to a power of two, the padding reading nothing.
        owner, logical: ``[pieces + 1]``: the request that owns each piece of the cache and
            its place in that request (the last entry takes the table's padding).
        lengths: ``[batch]``: keys of each request.
        piece: tokens per piece.
        requests: the step's requests (the rows of the output that count).
    """

    count: torch.Tensor
    index: torch.Tensor
    owner: torch.Tensor
    logical: torch.Tensor
    lengths: torch.Tensor
    piece: int
    requests: int


def padded_batch(requests: int) -> int:
    """The batch a step of ``requests`` is compiled for: a power of two, at least :data:`MIN_BATCH`."""
    return max(MIN_BATCH, 1 << max(0, requests - 1).bit_length())


def step_mask(seqlens_k: torch.Tensor, block_table: torch.Tensor, cache_blocks: int, block_size: int) -> StepMask:
    """The :class:`StepMask` of a decode step: request ``r`` has ``seqlens_k[r]`` keys in its
    blocks ``block_table[r]`` (``-1``: none) of a cache of ``cache_blocks`` blocks of
    ``block_size`` tokens. Tensor operations only: safe to capture in a CUDA graph."""
    piece = min(FLEX_BLOCK, block_size)
    if block_size % piece:
        raise ValueError(f"KV blocks of {block_size} tokens do not split into pieces of {piece} tokens")
    device = block_table.device
    requests = block_table.shape[0]
    batch = padded_batch(requests)
    split = block_size // piece
    pieces = cache_blocks * split
    table = block_table.long().clamp(min=0)
    # Megatron block b holds pieces split * b .. split * b + split - 1, in token order.
    mine = (table[:, :, None] * split + torch.arange(split, device=device)).reshape(requests, -1)
    width = mine.shape[1]
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    lengths[:requests] = seqlens_k[:requests].long()
    place = torch.arange(width, device=device).expand(requests, width)
    used = place * piece < lengths[:requests, None]
    target = torch.where(used, mine, pieces)  # unused entries land on the spare last slot
    owner = torch.full((pieces + 1,), -1, dtype=torch.long, device=device)
    owner.scatter_(0, target.reshape(-1), torch.arange(requests, device=device)[:, None].expand(requests, width).reshape(-1))
    logical = torch.zeros(pieces + 1, dtype=torch.long, device=device)
    logical.scatter_(0, target.reshape(-1), place.reshape(-1))
    index = torch.zeros(batch, pieces, dtype=torch.int32, device=device)
    index[:requests, :width] = mine.to(torch.int32)
    count = torch.zeros(batch, dtype=torch.int32, device=device)
    count[:requests] = used.sum(1).to(torch.int32)
    return StepMask(count.view(batch, 1, 1), index.view(batch, 1, 1, pieces), owner, logical, lengths, piece, requests)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    count: torch.Tensor,
    index: torch.Tensor,
    owner: torch.Tensor,
    logical: torch.Tensor,
    lengths: torch.Tensor,
    piece: int,
    scale: float,
) -> torch.Tensor:
    """FlexAttention of ``q`` ``[batch, heads, dim]`` over ``keys``/``values``
    ``[1, kv_heads, positions, dim]`` (a :class:`StepMask`'s fields as plain inputs, what
    ``torch.compile`` takes)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    heads, kv_heads, positions = q.shape[1], keys.shape[1], keys.shape[2]

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        at = kv_idx // piece
        return (owner[at] == b) & (logical[at] * piece + kv_idx % piece < lengths[b])

    block_mask = BlockMask.from_kv_blocks(
        count, index, BLOCK_SIZE=(FLEX_BLOCK, piece), mask_mod=visible, seq_lengths=(1, positions), **_NO_Q_BLOCKS
    )
    out = flex_attention(q.unsqueeze(2), keys, values, block_mask=block_mask, scale=scale, enable_gqa=heads != kv_heads)
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
    once per padded batch size); eager FlexAttention scores the whole cache and is for tests
    on small caches only."""
    blocks, block_size, kv_heads, dim = k_cache.shape
    keys = k_cache.view(1, blocks * block_size, kv_heads, dim).transpose(1, 2)
    values = v_cache.view(1, blocks * block_size, kv_heads, dim).transpose(1, 2)
    batch = mask.count.shape[0]
    if batch != q.shape[0]:
        q = torch.cat([q, q.new_zeros(batch - q.shape[0], *q.shape[1:])])
    attend = _compiled_attend() if compiled else _attend
    out = attend(q, keys, values, mask.count, mask.index, mask.owner, mask.logical, mask.lengths, mask.piece, scale)
    return out[: mask.requests]


def _compiled_attend() -> Any:
    global _compiled
    with _COMPILE_LOCK:
        if _compiled is None:
            # Past dynamo's recompile limit a frame runs eagerly, and eager FlexAttention scores
            # the whole cache: leave room for every padded batch size of a few dtypes and caches.
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), 64))
            # A static batch is what lets FlexAttention choose its decoding kernel.
            _compiled = torch.compile(_attend, fullgraph=True, dynamic=False)
    return _compiled

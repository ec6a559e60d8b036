"""One decode step's attention over megatron-core's paged KV cache, kernel by kernel (issue 43).

Each layout hands the cache (``[blocks, 256, kv_heads, dim]``, as megatron-core keeps it) to
compiled FlexAttention differently; every one is timed on the same step (one query token per
request) against the bytes the step must read (each request's keys and values once), checked
against a gather + SDPA reference, and profiled for copies (a kernel that copies the layer's
cache makes a step's cost grow with the cache, not the context):

* ``heads``: ``rlcore_megatron.flex_decode``'s own step mask and attention: the cache as
  ``[1, kv_heads, rows, dim]`` (a strided view), queries ``[requests, heads, 1, dim]``, the
  batch static: FlexAttention's decoding kernel, all query heads of a kv head together;
* ``heads-dynamic``: the same with the batch size dynamic (the main kernel, a query head each);
* ``heads-inside``: the same view made inside the compiled function;
* ``sdpa``: the reference, each request's blocks gathered to a dense copy, then SDPA.

    python3 bench/flex_decode_kernels.py [--requests 512] [--mean 190] [--device cuda]

On a CPU (``--device cpu``, small sizes) it checks the layouts' results only.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 256  # megatron-core's KV block, tokens


def make_step(requests: int, mean: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: str) -> dict:
    """A decode step: ``requests`` sequences of uniform lengths around ``mean`` in a cache with
    their blocks shuffled (as a long-running engine's are), plus a spare 10 %."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, mean // 4), mean * 7 // 4 + 1, (requests,), generator=g)
    per = (-(-lengths // BLOCK)).tolist()
    width = max(per)
    blocks = int(sum(per) * 1.1) + 1
    order = torch.randperm(blocks, generator=g)
    table = torch.full((requests, width), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(per):
        table[r, :n] = order[at:at + n].to(torch.int32)
        at += n
    k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(requests, heads, dim, generator=g).to(dtype)
    return {k_: t.to(device) for k_, t in dict(q=q, k=k, v=v, table=table, lengths=lengths).items()}


def heads_inside(q, k, v, count, index, owner, logical, lengths, piece, scale):
    """The plugin's attention with the cache's view made inside the compiled function."""
    from rlcore_megatron import flex_decode

    blocks, block, kv_heads, dim = k.shape
    keys = k.view(1, blocks * block, kv_heads, dim).transpose(1, 2)
    values = v.view(1, blocks * block, kv_heads, dim).transpose(1, 2)
    return flex_decode._attend(q, keys, values, count, index, owner, logical, lengths, piece, scale)


def reference(step: dict, scale: float) -> torch.Tensor:
    """Each request's blocks gathered to a dense copy, padded keys masked, SDPA with GQA."""
    q, k, v, table, lengths = step["q"], step["k"], step["v"], step["table"], step["lengths"]
    requests, width = table.shape
    pages = table.long().clamp(min=0)
    keys = k[pages].reshape(requests, width * BLOCK, k.shape[2], k.shape[3]).transpose(1, 2)
    values = v[pages].reshape(requests, width * BLOCK, v.shape[2], v.shape[3]).transpose(1, 2)
    ok = (torch.arange(width * BLOCK, device=q.device) < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=ok, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[2])
    return out.squeeze(2)


def timed(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median seconds of one call."""
    for _ in range(3):
        fn()
    if device != "cuda":
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernels(fn: Callable[[], Any]) -> str:
    """The GPU kernels of one call, heaviest first (copies show here)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(
        ((e.key, e.count, getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))
         for e in prof.key_averages()), key=lambda r: -r[2])
    return "; ".join(f"{name[:60]} x{n} {us:.0f} us" for name, n, us in rows[:5] if us > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--mean", type=int, default=190, help="mean keys per request")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layouts", default="heads,heads-inside,heads-dynamic")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    step = make_step(args.requests, args.mean, args.heads, args.kv_heads, args.dim, dtype, args.device)
    scale = args.dim ** -0.5
    q, k, v, lengths = step["q"], step["k"], step["v"], step["lengths"]
    from rlcore_megatron import flex_decode

    requests = q.shape[0]
    mask = flex_decode.step_mask(lengths, step["table"], k.shape[0], BLOCK)  # the plugin's own, per step
    padded = torch.cat([q, q.new_zeros(mask.count.shape[0] - requests, *q.shape[1:])])
    mask_args = (mask.count, mask.index, mask.owner, mask.logical, mask.lengths, mask.piece, scale)
    ref = reference(step, scale)
    bytes_read = int(lengths.sum()) * args.kv_heads * args.dim * 2 * k.element_size()
    cache_bytes = 2 * k.numel() * k.element_size()
    print(f"# {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}; "
          f"{args.requests} requests, {float(lengths.float().mean()):.0f} keys each on average, "
          f"{args.heads} heads / {args.kv_heads} kv heads of {args.dim}; cache {cache_bytes / 1e6:.0f} MB, "
          f"in use {bytes_read / 1e6:.1f} MB", flush=True)
    bandwidth = float("nan")
    if args.device == "cuda":
        a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        copy = timed(lambda: b.copy_(a), "cuda", 10)
        bandwidth = 2 * a.numel() / copy
        del a, b
        print(f"hbm_copy_bandwidth_gb_per_s: {bandwidth / 1e9:.0f}; the step's floor {bytes_read / bandwidth * 1e6:.1f} us")
    keys = k.view(1, -1, args.kv_heads, args.dim).transpose(1, 2)
    values = v.view(1, -1, args.kv_heads, args.dim).transpose(1, 2)
    compiled = args.device == "cuda"

    def build(layout: str) -> Callable[[], torch.Tensor]:
        if layout == "sdpa":
            return lambda: reference(step, scale)
        wrap = (lambda f, **kw: torch.compile(f, fullgraph=True, **kw)) if compiled else (lambda f, **kw: f)
        if layout in ("heads", "heads-dynamic"):
            fn = wrap(flex_decode._attend, dynamic=layout == "heads-dynamic")
            return lambda: fn(padded, keys, values, *mask_args)[:requests]
        if layout == "heads-inside":
            fn = wrap(heads_inside, dynamic=False)
            return lambda: fn(padded, k, v, *mask_args)[:requests]
        raise SystemExit(f"unknown layout {layout!r}")

    for layout in ["sdpa", *args.layouts.split(",")]:
        try:
            fn = build(layout)
            out = fn()
            err = (out.float() - ref.float()).abs().max().item()
            seconds = timed(fn, args.device, args.repeats)
            line = f"{layout}: max |diff| vs reference {err:.2e}"
            if args.device == "cuda":
                line += (f"; {seconds * 1e6:.1f} us a layer = {bytes_read / seconds / 1e9:.0f} GB/s = "
                         f"{bytes_read / bandwidth / seconds:.2f} of the floor\n    kernels: {kernels(fn)}")
            print(line, flush=True)
        except Exception as exc:  # noqa: BLE001 - one layout failing is a finding, the others go on
            print(f"{layout}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()

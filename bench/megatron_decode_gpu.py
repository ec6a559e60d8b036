"""Megatron generation's decode speed on one GPU: each attention path, with and without CUDA
graphs, on the same requests, against this GPU's bandwidth roofline (issue 43 item 2).

One process on cuda:0 builds the generation worker's model in the ``--preset`` shape (random
weights, the tiny tokenizer's vocabulary, ``--dtype``) and, for every candidate, a fresh
megatron-core dynamic engine around it (``generation.options.attention`` x
``generation.options.cuda_graphs``). Each candidate first runs a short call (compiles,
captures), then the timed call: ``--requests`` requests of random prompts (``--prompt``
tokens on average) sampling ``--tokens`` tokens each at temperature 1, end-of-sequence
ignored, so every request decodes to the end, as a long completion does.

* ``roofline_tokens_per_s``: the measured HBM bandwidth (a 4 GiB device copy, read + write)
  over the bytes one decode step must read (every weight once, and the mean KV cache in use:
  prompt + half the completion per request), times the batch;
* per candidate: tokens/s of the timed call, that over the roofline and over the first
  candidate (the old path: torch attention, no graphs); graphs captured and their seconds;
* equality (``--check``): greedy tokens and logprobs of ``--check`` requests x 64 tokens of each
  candidate against the first; a sample equal to the first up to the first token where they
  part counts its logprobs up to there.

    source .gpu/setup.sh && python3 bench/megatron_decode_gpu.py [--requests 512 --tokens 512]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = [("torch", 0), ("flex", 0), ("torch", 16), ("flex", 16)]


def hbm_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy (read + write)."""
    import torch

    x = torch.empty(2 * 1024**3, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t) / 10
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 * 2 / seconds


def model_dir(preset: str) -> Path:
    from rlcore.config import MODEL_PRESETS
    from rlcore.models.tiny import ALPHABET, SPECIAL_TOKENS

    shape = MODEL_PRESETS[preset]
    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_layers"], "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"], "vocab_size": len(SPECIAL_TOKENS) + len(ALPHABET),
        "max_position_embeddings": shape["max_position_embeddings"], "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False,
        "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0,
    }))
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=64, help="mean prompt tokens (uniform in [p/2, 3p/2])")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--check", type=int, default=64, help="greedy equality on this many requests (0: skip)")
    ap.add_argument("--candidates", default=",".join(f"{a}:{g}" for a, g in CANDIDATES),
                    help="attention:cuda_graphs,... (the first is the reference)")
    ap.add_argument("--first-tokens", type=int, default=0,
                    help="timed tokens of the first candidate (0: --tokens; the old path is slow)")
    ap.add_argument("--profile", type=int, default=0,
                    help="after each candidate's timed call, profile a call of this many tokens: where a step's "
                         "wall time goes (Python functions, cProfile) and the GPU's busy time (torch.profiler)")
    args = ap.parse_args()

    import torch

    from rlcore.runtime.addresses import free_port
    from rlcore_megatron import decode_graphs, inference
    from rlcore_megatron.options import MegatronOptions
    from rlcore_megatron.worker import MegatronGenerationWorker

    candidates = [(a, int(g)) for a, g in (c.split(":") for c in args.candidates.split(","))]
    bandwidth = hbm_bandwidth()
    longest = int(args.prompt * 1.5) + args.tokens + 1
    options = MegatronOptions(max_batch_size=args.requests, max_sequence_length=longest, seed=3)
    gen = MegatronGenerationWorker(0, 1)
    gen.init_process_group("127.0.0.1", free_port(), "nccl", 120.0)
    gen.start(str(model_dir(args.preset)), args.dtype, options, "cuda")
    with torch.no_grad():  # random weights as the tiny model's recipe draws them
        for name, p in gen.model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    gen.serving, gen.loaded_version = True, 1
    gen.engine = None
    gc.collect()
    torch.cuda.empty_cache()
    spec = gen.spec
    weight_bytes = sum(p.numel() * p.element_size() for p in gen.model.parameters())
    kv_per_token = inference.kv_block_bytes(spec, 1, getattr(torch, args.dtype)) // inference.KV_BLOCK_TOKENS

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, args.prompt // 2), int(args.prompt * 1.5) + 1, (args.requests,), generator=g)
    prompts = [[2, *torch.randint(4, spec.vocab_size, (int(n) - 1,), generator=g).tolist()] for n in lengths]
    mean_prompt = float(lengths.float().mean())

    def roofline(batch: int, tokens: int) -> float:
        step_bytes = weight_bytes + batch * (mean_prompt + tokens / 2) * kv_per_token
        return batch / (step_bytes / bandwidth)

    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.preset} {args.dtype}: "
          f"{sum(p.numel() for p in gen.model.parameters()) / 1e9:.3f} B parameters, {weight_bytes / 1e9:.2f} GB, "
          f"KV {kv_per_token} B/token", flush=True)
    print(f"hbm_copy_bandwidth_gb_per_s: {bandwidth / 1e9:.0f}")
    print(f"# workload: {args.requests} requests, prompts of {mean_prompt:.1f} tokens on average, "
          f"{args.tokens} tokens each (end-of-sequence ignored), temperature 1")
    print(f"roofline_tokens_per_s: {roofline(args.requests, args.tokens):.0f}", flush=True)

    def engine_for(attention: str, graphs: int) -> Any:
        gen.engine = None
        gc.collect()
        torch.cuda.empty_cache()
        engine = inference.build_dynamic_engine(
            gen.model, inference.TokenIdAdapter(eod=-1, vocab_size=spec.vocab_size), spec,
            attention=attention, cuda_graphs=graphs, tp=1, make_vocab_size_divisible_by=gen.divisible,
            max_batch_size=args.requests, max_sequence_length=longest, seed=4,
        )
        gen.engine = engine
        return engine

    def call(engine: Any, batch: list[list[int]], tokens: int, temperature: float) -> tuple[list, float]:
        engine.controller.sampling_rng.manual_seed(7)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = inference.generate_dynamic(engine, batch, 1, tokens, temperature)
        torch.cuda.synchronize()
        return [s for group in out for s in group], time.perf_counter() - t

    reference: list | None = None
    first_rate = None
    for index, (attention, graphs) in enumerate(candidates):
        label = f"{attention}{'+graphs' if graphs else ''}"
        try:
            engine = engine_for(attention, graphs)
            t0 = time.perf_counter()
            call(engine, prompts, 8, 1.0)  # compiles and captures the sizes a full batch meets first
            warm = time.perf_counter() - t0
            tokens = args.first_tokens if index == 0 and args.first_tokens else args.tokens
            samples, seconds = call(engine, prompts, tokens, 1.0)
        except Exception as err:  # noqa: BLE001 - a candidate that fails is reported, the rest go on
            print(f"{label}: failed: {type(err).__name__}: {str(err)[:400]}", flush=True)
            continue
        produced = sum(len(s.token_ids) for s in samples)
        rate = produced / seconds
        first_rate = first_rate or rate
        stats = decode_graphs.of(gen.model).stats if graphs else None
        graph_note = (f", {stats.captures} graphs captured in {stats.capture_s:.1f} s, {stats.replays} replays"
                      + (f", disabled: {stats.disabled}" if stats.disabled else "")) if stats else ""
        print(f"{label}: {rate:,.0f} tokens/s ({produced} tokens in {seconds:.2f} s) = "
              f"{rate / roofline(args.requests, tokens):.3f} of roofline, {rate / first_rate:.2f}x the first; "
              f"first call {warm:.1f} s{graph_note}", flush=True)
        if args.profile:
            profile(functools.partial(call, engine, prompts, args.profile, 1.0), args.profile)
        if args.check:
            greedy, _ = call(engine, prompts[: args.check], 64, 0.0)
            if reference is None:
                reference = greedy
            else:
                print(f"  {label} vs {candidates[0][0]}: {equality(greedy, reference)}", flush=True)
        del engine
    gen.engine = None
    sys.stdout.flush()


def profile(run: Any, steps: int) -> None:
    """Where a decode step's wall time goes: cProfile's heaviest functions (cumulative, per
    step), then torch.profiler's GPU kernel time per step and its heaviest kernels."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    wall = time.perf_counter() - t
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(35)
    print(f"  profile: {steps} steps in {wall:.2f} s under cProfile ({wall / steps * 1e3:.1f} ms a step)")
    for line in text.getvalue().splitlines():
        if line.strip() and ("/" in line or "ncalls" in line):
            print("   ", line[:200])
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
    events = tp.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e6
    print(f"  profile: GPU busy {gpu / steps * 1e3:.2f} ms of {wall / steps * 1e3:.2f} ms a step (torch.profiler)")
    for line in events.table(sort_by="self_device_time_total", row_limit=15).splitlines():
        print("   ", line[:180])
    sys.stdout.flush()


def equality(got: list, ref: list) -> str:
    """Greedy samples equal to the reference, where the rest part, and the largest logprob
    difference over the tokens before each parting."""
    same, parts, diff = 0, [], 0.0
    for a, b in zip(got, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None)
        same += n is None
        if n is not None:
            parts.append(n)
        upto = len(a.token_ids) if n is None else n
        diff = max([diff, *(abs(x - y) for x, y in zip(a.logprobs[:upto], b.logprobs[:upto], strict=True))])
    where = f", the others part at token {sorted(parts)}" if parts else ""
    return f"{same}/{len(ref)} greedy samples equal{where}; max |logprob diff| before parting {diff:.3g}"


if __name__ == "__main__":
    main()

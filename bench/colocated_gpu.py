"""Megatron policy and generation colocated on one GPU: cuda_ipc refit and the memory handoff.

Two processes on ``cuda:0`` (``torch.multiprocessing`` spawn, no Ray), driving the
backend's worker classes as its Ray actors would
(``plugins/megatron/tests/_colocated.py``): a TP=1 policy
(:class:`rlcore_megatron.worker.MegatronPolicyWorker`, megatron-core's random init)
and a refit-fed generation (:class:`rlcore_megatron.worker.MegatronGenerationWorker`,
megatron-core's dynamic engine), the generation started first (the planner's
colocated rule: Megatron is not colocated-overlap-safe). The model is the
Llama-shaped 1.1 B-parameter bfloat16 model of ``bench/megatron_gpu.py``.

Measured in one run:

* ceilings, in the policy's process: one device-to-device copy of all the
  weights' bytes as one buffer; the same bytes as one ``copy_`` per tensor and as
  one ``torch._foreach_copy_``; the cuda_ipc channel's own ceiling (one copy of
  the same bytes from a buffer the other process shared);
* the cuda_ipc transport alone: Hugging Face-layout tensors on both sides (the
  sender's registered persistent, so shared in place), the receiver copying every
  view in one ``_foreach_copy_`` (or per tensor);
* the Megatron refit over cuda_ipc (the first, which opens the handles, and the
  median of the next), on both paths: ``native`` (the two workers hold the same
  layout and agree on it when the channel opens: the Megatron tensors, fused QKV
  and gate/up and float32 norms, are copied as they are from the policy's
  parameter buffer into the generation's, adjacent copies merged) and ``hf`` (the
  native layout not offered: the policy's export, q/k/v split and norms cast, +
  the generation's ``load_hf_stream``, q/k/v and gate/up fused, into the live
  model); and the export alone;
* the collective transport on one GPU: NCCL refuses two ranks on one device (the
  attempt and its error are reported), gloo (through host memory) is measured;
* the memory handoff: ``sleep`` / ``wake`` of each side, and the peak GPU memory
  of a train step + refit + generation cycle with and without the handoff, against
  each side alone (NVML's device-wide used memory, sampled every millisecond, less
  what was used before the processes started; per-process peaks from torch's
  caching allocator beside it).

    python bench/colocated_gpu.py              # 1 x H200
    python bench/colocated_gpu.py --small      # a quick dry run (tiny model)

On the GPU machines: ``PYTHONPATH=.:plugins/megatron`` and megatron-core (a wheel)
are all it needs beyond torch; NVML comes from ``nvidia-ml-py`` (there already).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# megatron_gpu sets the environment (NVLink multicast off everywhere) and sys.path (the repo,
# the Megatron plugin) at import, before torch is imported; its model config and rows serve here.
from megatron_gpu import REPO, llama_config, rows  # noqa: E402

if str(REPO / "plugins" / "megatron" / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "plugins" / "megatron" / "tests"))

GIB = 1 << 30


class Sampler:
    """Device-wide used memory (NVML) every millisecond, in a thread; ``peak()`` since ``reset()``."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.max = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def _run(self) -> None:
        while not self.stop.is_set():
            u = self.used()
            with self.lock:
                self.max = max(self.max, u)
            time.sleep(0.001)

    def reset(self) -> None:
        time.sleep(0.01)
        with self.lock:
            self.max = self.used()

    def peak(self) -> int:
        time.sleep(0.01)
        with self.lock:
            return self.max

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def main() -> None:  # noqa: PLR0915 - one measurement after the other, top to bottom
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny model (dry run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-gib", type=float, default=16.0, help="the dynamic engine's KV cache")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--json", type=str, default=None, help="also write the figures here")
    args = ap.parse_args()

    import torch
    from _colocated import ProcActor, RemoteError, both

    from rlcore.refit.channels import ChannelSpec
    from rlcore.refit.specs import plan_buckets
    from rlcore.runtime.addresses import free_port

    t_start = time.monotonic()
    if args.small:
        shape = dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=1024)
        args.kv_gib = min(args.kv_gib, 1.0)
    else:
        shape = dict(layers=16, hidden=2048, ffn=8192, heads=16, kv_heads=8, vocab=32000)
    work = Path(tempfile.mkdtemp(prefix="colocated-"))
    model_dir = work / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(llama_config(**shape)))
    report: dict[str, Any] = {"shape": shape, "kv_gib": args.kv_gib}
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    sampler = Sampler()
    idle = sampler.used()
    env = {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}
    gen, pol = ProcActor("generation", env), ProcActor("policy", env)
    try:
        say(
            f"device: {torch.cuda.get_device_name(0)} (UUID {gen.call('device_uuid')}); torch {torch.__version__}; "
            f"processes: generation then policy, both on cuda:0"
        )
        gen.call("start_generation", str(model_dir), "bfloat16", 1234, 32, 2048, args.kv_gib)
        gen_started = sampler.used() - idle
        pol.call("start_policy", str(model_dir), "bfloat16", 1234)
        both_started = sampler.used() - idle
        specs = pol.call("call", "weight_specs")
        nbytes = sum(s.nbytes for s in specs)
        buckets = plan_buckets(specs, args.bucket_mb << 20)
        say(
            f"model: Llama-shaped {shape['layers']} layers, hidden {shape['hidden']}, ffn {shape['ffn']}, "
            f"heads {shape['heads']}/{shape['kv_heads']}, vocab {shape['vocab']}, bfloat16: "
            f"{sum(s.numel for s in specs) / 1e9:.2f} B params, {gib(nbytes)} in {len(specs)} tensors; "
            f"refit buckets of {args.bucket_mb} MiB ({len(buckets)})"
        )
        say(f"device memory used after the generation started: {gib(gen_started)}; after the policy too: {gib(both_started)}")

        # -- ceilings ------------------------------------------------------------------
        c = pol.call("copy_ceilings", args.repeats)
        report["ceilings"] = c
        say(
            f"ceiling: one device-to-device copy of the {gib(c['bytes'])} in one process: {ms(c['one_copy'])} "
            f"({c['bytes'] / c['one_copy'] / 1e9:.0f} GB/s); as {int(c['tensors'])} per-tensor copy_: "
            f"{ms(c['per_tensor'])}; as one _foreach_copy_: {ms(c['foreach'])}"
        )

        # -- the transport alone -----------------------------------------------------------
        raw = ChannelSpec("cuda_ipc", "raw", 2, addr="127.0.0.1", port=free_port(), timeout_s=120)
        both(pol, gen, "raw_open", (raw, 0, specs, False), (raw, 1, specs, False))
        ceil = both(pol, gen, "call", ("refit_ceiling", raw, 0, int(nbytes)), ("refit_ceiling", raw, 0, int(nbytes)))
        ceilings = [
            both(pol, gen, "call", ("refit_ceiling", raw, 0, int(nbytes)), ("refit_ceiling", raw, 0, int(nbytes)))[1]
            for _ in range(args.repeats)
        ]
        ipc_ceiling = statistics.median(ceilings)
        say(f"ceiling over the cuda_ipc channel (one copy from the other process's shared buffer): {ms(ipc_ceiling)} (first {ms(ceil[1])})")
        flat = ChannelSpec("cuda_ipc", "flat", 2, addr="127.0.0.1", port=free_port(), timeout_s=120)
        both(pol, gen, "raw_open", (flat, 0, specs, True), (flat, 1, specs, True))
        results, parts = {}, {}
        for label, channel, mode in (
            ("per_tensor", raw, "per_tensor"), ("foreach", raw, "foreach"), ("merged", flat, "merged"),
        ):
            times, first, copies = [], None, 0
            for step in range(args.repeats + 1):
                (send_s, _), (recv_s, copies) = both(
                    pol, gen, ("raw_send", "raw_receive"), (channel, step, buckets), (channel, step, buckets, mode)
                )
                if first is None:
                    first = max(send_s, recv_s)
                else:
                    times.append(max(send_s, recv_s))
            results[label] = {"median": statistics.median(times), "first": first, "copies": copies}
            parts[label] = both(pol, gen, "channel_timings", (channel.key,), (channel.key,))
        for channel in (raw, flat):
            both(pol, gen, "raw_close", (channel,), (channel,))
        report["transport_alone"] = {"results": results, "parts": parts}
        r = results
        say(
            f"cuda_ipc transport alone (Hugging Face layout on both sides, the sender's tensors shared in place; "
            f"median of {args.repeats}): one allocation per tensor, {r['per_tensor']['copies']} copy_ as they come "
            f"{ms(r['per_tensor']['median'])} ({r['per_tensor']['median'] / c['one_copy']:.2f}x the one-copy ceiling), "
            f"one _foreach_copy_ {ms(r['foreach']['median'])} ({r['foreach']['median'] / c['one_copy']:.2f}x); "
            f"one buffer in plan order on both sides, copy_views -> {r['merged']['copies']} copy "
            f"{ms(r['merged']['median'])} ({r['merged']['median'] / c['one_copy']:.2f}x); "
            f"first refit (opens {len(specs)} handles) {ms(r['per_tensor']['first'])}"
        )
        for label in ("per_tensor", "merged"):
            p0, p1 = parts[label]
            say(
                f"  its parts ({label}), last refit: sender " + ", ".join(f"{k} {ms(v)}" for k, v in p0.items())
                + "; receiver " + ", ".join(f"{k} {ms(v)}" for k, v in p1.items())
            )

        # -- Megatron refit over cuda_ipc: the native path, then the Hugging Face one -----------------
        mega: dict[str, Any] = {}
        channels_by_path = {}
        for path in ("native", "hf"):
            for a in (pol, gen):
                a.call("set_native_refit", path == "native")
            spec = ChannelSpec("cuda_ipc", f"megatron-{path}", 2, addr="127.0.0.1", port=free_port(), timeout_s=120)
            channels_by_path[path] = spec
            t0 = time.perf_counter()
            both(pol, gen, "call", ("open_refit_channel", spec), ("open_refit_channel", spec, 1))
            open_s = time.perf_counter() - t0
            agreed = both(pol, gen, "call", ("refit_path", spec), ("refit_path", spec))
            times, spans, skews, first, answer = [], [], [], None, None
            for step in range(1, args.repeats + 2):
                (s0, s1, answer), (r0, r1, _) = both(
                    pol, gen, "timed_at", ("send_weights", spec, step, buckets), ("receive_weights", spec, step, buckets)
                )
                if first is None:
                    first = max(s1 - s0, r1 - r0)
                else:  # as before: the longer side's own time; and on the shared clock, first start to last end
                    times.append(max(s1 - s0, r1 - r0))
                    spans.append(max(s1, r1) - min(s0, r0))
                    skews.append(r0 - s0)
            ran = answer["path"] if isinstance(answer, dict) else "hf"
            assert ran == path == agreed[0][0] == agreed[1][0], (path, ran, agreed)
            mega[path] = {
                "median": statistics.median(times), "first": first, "open": open_s, "times": times,
                "span": statistics.median(spans), "skew": statistics.median(skews),
                "parts": both(pol, gen, "channel_timings", (spec.key,), (spec.key,)),
                **pol.call("channel_state", spec.key),
            }
            if args.small:
                pol_p, gen_p = pol.call("params"), gen.call("params")
                vocab = shape["vocab"]
                exact = all(torch.equal(pol_p[n][:vocab], gen_p[n][:vocab]) for n in pol_p)
                say(f"check ({path}): generation weights == policy weights bit for bit: {exact}")
        for a in (pol, gen):
            a.call("set_native_refit", True)
        export_s = pol.call("export_only")
        native_bytes = sum(s.nbytes for s in pol.call("call", "native_specs"))
        report["megatron_refit"] = {**mega, "export_only": export_s, "native_bytes": native_bytes}
        nat, hf = mega["native"], mega["hf"]
        say(
            f"Megatron refit over cuda_ipc, native path (same layout on both sides, agreed at open: the Megatron "
            f"tensors copied as they are from the policy's parameter buffers into the generation's): "
            f"{ms(nat['median'])} median of {args.repeats} ({nat['median'] / c['one_copy']:.2f}x the one-copy ceiling; "
            f"{ms(min(nat['times']))} to {ms(max(nat['times']))}; "
            f"{gib(native_bytes)}, {native_bytes / nat['median'] / 1e9:.0f} GB/s); first refit {ms(nat['first'])}; "
            f"channel opened in {nat['open'] * 1e3:.0f} ms; {nat['shared']} storages shared (one parameter buffer per "
            f"dtype), nothing staged"
        )
        say(
            f"  on the host's clock, from the first side's start to the last side's end: {ms(nat['span'])} (median; "
            f"the receiver's call began {ms(nat['skew'])} after the sender's: the two calls' dispatch)"
        )

        def say_parts(parts: list[dict[str, float]], walk: str, consume: str) -> None:
            sides = [", ".join(f"{k} {ms(v)}" for k, v in side.items()) for side in parts]
            say(f"  its parts, last refit: sender {sides[0]} (walk = {walk}); receiver {sides[1]} (consume = {consume})")

        say_parts(nat["parts"], "the parameters' views", "copy_views, adjacent copies merged")
        say(
            f"Megatron refit over cuda_ipc, Hugging Face path (native layout not offered: export + load_hf_stream into "
            f"the live model): {ms(hf['median'])} median of {args.repeats} ({ms(min(hf['times']))} to "
            f"{ms(max(hf['times']))}; {nbytes / hf['median'] / 1e9:.0f} GB/s, "
            f"{hf['median'] / c['one_copy']:.2f}x the one-copy ceiling; {hf['median'] / nat['median']:.1f}x the native "
            f"path); first refit {ms(hf['first'])}; {hf['shared'] - 1} parameter storages shared in place + a "
            f"{gib(hf['staging'])} staging buffer (q/k/v, cast norms); export alone {ms(export_s)}"
        )
        say_parts(hf["parts"], "the export + staging", "load_hf_stream")
        both(pol, gen, "raw_close", (channels_by_path["hf"],), (channels_by_path["hf"],))
        spec = channels_by_path["native"]
        refit_s = nat["median"]

        # -- collective on one GPU: gloo (NCCL is tried last) ------------------------------------
        gloo = ChannelSpec("collective", "gloo", 2, addr="127.0.0.1", port=free_port(), backend="gloo", timeout_s=300)
        both(pol, gen, "call", ("open_refit_channel", gloo), ("open_refit_channel", gloo, 1))
        times = []
        for step in range(1, 4):
            (send_s, _), (recv_s, _) = both(pol, gen, "timed", ("send_weights", gloo, step, buckets), ("receive_weights", gloo, step, buckets))
            times.append(max(send_s, recv_s))
        report["collective_gloo"] = statistics.median(times)
        say(
            f"collective over gloo on one GPU (through host memory): {ms(report['collective_gloo'])} median of 3 "
            f"({report['collective_gloo'] / refit_s:.0f}x the cuda_ipc refit)"
        )

        # -- memory: the cycle with and without the handoff ----------------------------------------------------
        train_rows = rows(8, 64, 448, shape["vocab"], seed=1) if not args.small else rows(4, 8, 24, shape["vocab"], 1)
        adv = [1.0, -1.0] * (len(train_rows) // 2)
        prompts = [p for p, _ in rows(32, 16, 0, shape["vocab"], seed=2)]
        gen_tokens = 64 if not args.small else 8

        def phase(name: str, fn: Any) -> dict[str, Any]:
            for a in (pol, gen):
                a.call("reset_peak")
            sampler.reset()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            return {
                "phase": name,
                "seconds": dt,
                "device_peak": sampler.peak() - idle,
                "policy_peak_reserved": pol.call("memory")["max_reserved"],
                "generation_peak_reserved": gen.call("memory")["max_reserved"],
            }

        step_no = [100]

        def refit() -> None:
            step_no[0] += 1
            both(pol, gen, "call", ("send_weights", spec, step_no[0], buckets), ("receive_weights", spec, step_no[0], buckets))

        def train() -> None:
            pol.call("call", "train_step", train_rows, adv, None, 0.2, 1e-6)

        from rlcore.handles import SamplingParams

        def generate() -> None:
            gen.call("call", "generate", prompts, SamplingParams(1, gen_tokens, 1.0, 3))

        # warm-up: every buffer exists once (AdamW state, the engine's first batch)
        train()
        refit()
        generate()
        for a in (pol, gen):
            a.call("empty_cache")
        no_handoff = [phase("train", train), phase("refit", refit), phase("generate", generate)]
        # each side alone: its own peaks in the cycle above (torch's caching allocator)
        pol_alone = max(p["policy_peak_reserved"] for p in no_handoff)
        gen_alone = max(p["generation_peak_reserved"] for p in no_handoff)
        peak_no_handoff = max(p["device_peak"] for p in no_handoff)

        handoff_times: dict[str, list[float]] = {"generation.sleep": [], "generation.wake": [], "policy.sleep": [], "policy.wake": []}

        def timed_handoff(actor: Any, name: str, method: str) -> None:
            handoff_times[f"{name}.{method}"].append(actor.call("call", method)["seconds"])

        with_handoff = []
        for _ in range(2):
            with_handoff = [
                phase("generation.sleep + policy.wake", lambda: (timed_handoff(gen, "generation", "sleep"), timed_handoff(pol, "policy", "wake"))),
                phase("train", train),
                phase("refit", refit),
                phase("policy.sleep + generation.wake", lambda: (timed_handoff(pol, "policy", "sleep"), timed_handoff(gen, "generation", "wake"))),
                phase("generate", generate),
            ]
        peak_handoff = max(p["device_peak"] for p in with_handoff)
        report["memory"] = {
            "idle_used": idle, "no_handoff": no_handoff, "with_handoff": with_handoff,
            "policy_alone_reserved": pol_alone, "generation_alone_reserved": gen_alone,
            "handoff_seconds": handoff_times,
        }
        say(
            f"memory, train step ({len(train_rows)} x {len(train_rows[0][0]) + len(train_rows[0][1])} tokens) + refit + "
            f"generation ({len(prompts)} prompts x {gen_tokens} tokens, KV cache {args.kv_gib:g} GiB), device-wide peak "
            f"above idle: without the handoff {gib(peak_no_handoff)}; with it {gib(peak_handoff)} "
            f"({1 - peak_handoff / peak_no_handoff:.0%} less)"
        )
        say(
            f"  each alone (its allocator's peak reserved in the cycle): policy {gib(pol_alone)}, generation "
            f"{gib(gen_alone)}, sum {gib(pol_alone + gen_alone)}"
        )
        for p in no_handoff + with_handoff:
            say(
                f"  {'with' if p in with_handoff else 'without'} handoff, {p['phase']}: {p['seconds'] * 1e3:.0f} ms, device peak "
                f"{gib(p['device_peak'])} (policy reserved {gib(p['policy_peak_reserved'])}, generation "
                f"{gib(p['generation_peak_reserved'])})"
            )
        steady = {k: v[-1] for k, v in handoff_times.items()}
        say(
            "handoff times, second cycle: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in steady.items())
            + f"; sleep + wake per step {sum(steady.values()) * 1e3:.0f} ms (first cycle: "
            + ", ".join(f"{k} {v[0] * 1e3:.0f} ms" for k, v in handoff_times.items())
            + "; the policy's first sleep allocates its pinned host buffers)"
        )
        report["handoff_steady"] = steady

        # last: a refused NCCL group may leave its processes unusable
        nccl = ChannelSpec("collective", "nccl", 2, addr="127.0.0.1", port=free_port(), backend="nccl", timeout_s=30)
        try:
            both(pol, gen, "call", ("open_refit_channel", nccl), ("open_refit_channel", nccl, 1))
            (send_s, _), (recv_s, _) = both(pol, gen, "timed", ("send_weights", nccl, 1, buckets), ("receive_weights", nccl, 1, buckets))
            say(f"collective over NCCL on one GPU: {ms(max(send_s, recv_s))}")
            report["collective_nccl"] = max(send_s, recv_s)
        except (RemoteError, TimeoutError) as err:
            why = next((ln.strip() for ln in str(err).splitlines() if "uplicate" in ln or "Error" in ln), str(err)[:200])
            say(f"collective over NCCL on one GPU: refused ({why[:240]})")
            report["collective_nccl"] = f"refused: {why[:500]}"
    finally:
        for a in (gen, pol):  # the receiver first: it releases what the sender shared
            a.close()
        sampler.close()
    say(f"wall time of the benchmark: {time.monotonic() - t_start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"lines": lines, **report}, indent=1, default=str))


if __name__ == "__main__":
    main()

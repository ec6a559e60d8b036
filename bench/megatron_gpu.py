"""The Megatron backend on two GPUs, without Ray: TP=2 training over NCCL and GPU -> GPU refit.

Three processes (``torch.multiprocessing``, spawn), driving the backend's plain
worker classes directly, as its Ray actors would:

* processes 0 and 1: :class:`rlcore_megatron.worker.MegatronPolicyWorker`, tensor
  parallel 2 over NCCL, on GPU 0 and GPU 1;
* process 2: :class:`rlcore_megatron.worker.MegatronGenerationWorker` (TP=1,
  megatron-core's static inference engine) on GPU 1, started refit-fed (model
  built from ``config.json``, no weights read).

Refit is the core's collective transport (:mod:`rlcore.refit.channels`): a
private NCCL group of policy rank 0 (GPU 0) and the generation (GPU 1). The
policy's TP ranks gather each tensor over their own NCCL group
(``convert.megatron_to_hf``), rank 0 packs and broadcasts bucket by bucket, the
generation copies its slices into the live model as buckets arrive. Its
throughput is compared with ``channels.ceiling``: one NCCL broadcast of the same
number of bytes between the same two processes over the same group.

Two phases:

1. ``check``: a small float32 model. Policy TP=2 logprobs vs the generation's
   (TP=1) after refit: the refit is exact and TP=2 computes what TP=1 does.
2. ``perf``: a Llama-shaped model (default about 1.1 B parameters, bfloat16, random
   weights from megatron-core's initialisation): TP=2 train-step and logprob
   throughput, refit time and throughput per bucket size vs the ceiling, export
   alone (TP gathers, no send), static-engine generation.

    python bench/megatron_gpu.py                     # 2 GPUs (NCCL)
    python bench/megatron_gpu.py --device cpu --small  # dry run over gloo

On the GPU machines there is no Ray: ``PYTHONPATH=.:plugins/megatron`` and
megatron-core (a 2.6 MB wheel) are all it needs beyond torch. NVLink multicast
stays off (``NCCL_NVLS_ENABLE=0``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

for _key, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("TQDM_DISABLE", "1"),
    ("PYTHONWARNINGS", "ignore"),
):
    os.environ[_key] = _value

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "plugins" / "megatron"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

POLICY, GENERATION = (0, 1), 2
BARRIER_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_config(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
    }


def rows(
    n: int, prompt: int, completion: int, vocab: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (prompt + completion,), generator=g).tolist()
        out.append((ids[:prompt], ids[prompt:]))
    return out


# ---------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------


class Proc:
    def __init__(
        self, index: int, args: argparse.Namespace, ports: dict, queue: Any, barrier: Any
    ) -> None:
        import torch

        self.index, self.args, self.ports, self.queue, self.barrier = (
            index,
            args,
            ports,
            queue,
            barrier,
        )
        self.cuda = args.device == "cuda"
        self.gpu = 0 if index == 0 else 1
        if self.cuda:
            torch.cuda.set_device(self.gpu)
        self.device = f"cuda:{self.gpu}" if self.cuda else "cpu"
        self.backend = "nccl" if self.cuda else "gloo"
        self.worker: Any = None
        self.groups_ready = False

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def wait(self) -> None:
        self.barrier.wait(BARRIER_TIMEOUT_S)

    def put(self, phase: str, **values: Any) -> None:
        self.queue.put({"proc": self.index, "phase": phase, **values})

    def timed(self, fn: Any) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    # -- setup ---------------------------------------------------------------------

    def start(self, model_dir: str, dtype: str) -> None:
        from rlcore_megatron.plugin import MegatronOptions
        from rlcore_megatron.worker import MegatronGenerationWorker, MegatronPolicyWorker

        a = self.args
        if self.worker is not None:  # the previous phase's model: free it, keep the groups
            self.worker.model = None
            self.worker.optimizer = None
            import torch

            if self.cuda:
                torch.cuda.empty_cache()
        if self.index in POLICY:
            w = MegatronPolicyWorker(self.index, 2)
            if not self.groups_ready:
                w.init_process_group("127.0.0.1", self.ports["policy"], self.backend, 600.0)
            options = MegatronOptions(
                tensor_model_parallel_size=2,
                micro_batch_size=a.micro_batch,
                seed=1234,
                timeout_s=600,
            )
            info = w.load(model_dir, dtype, options, self.device, random_init=True)
        else:
            w = MegatronGenerationWorker(0, 1)
            if not self.groups_ready:
                w.init_process_group("127.0.0.1", self.ports["generation"], self.backend, 600.0)
            options = MegatronOptions(
                max_batch_size=a.gen_prompts * a.gen_n,
                max_sequence_length=2048,
                seed=1234,
                timeout_s=600,
            )
            info = w.start(model_dir, dtype, options, self.device)
        if self.worker is not None:  # the refit channel stays open across phases
            w._open_channels = self.worker._open_channels
            w._channel_ranks = getattr(self.worker, "_channel_ranks", {})
        self.groups_ready = True
        self.worker = w
        self.put("start", model=Path(model_dir).name, info=info)

    def open_channel(self) -> None:
        from rlcore.refit.channels import ChannelSpec

        self.spec = ChannelSpec(
            "collective",
            "megatron-gpu-bench",
            2,
            addr="127.0.0.1",
            port=self.ports["channel"],
            backend=self.backend,
            timeout_s=600.0,
        )
        self.wait()
        t = 0.0
        if self.index == 0:
            t = self.timed(lambda: self.worker.open_refit_channel(self.spec))
        elif self.index == GENERATION:
            t = self.timed(lambda: self.worker.open_refit_channel(self.spec, 1))
        self.put("channel", open_s=t)

    def refit(self, step: int, bucket_bytes: int) -> float:
        """One refit policy -> generation; every process times from the same barrier."""
        from rlcore.refit.specs import plan_buckets

        buckets = plan_buckets(self.worker.weight_specs(), bucket_bytes)
        self.wait()
        if self.index in POLICY:
            return self.timed(lambda: self.worker.send_weights(self.spec, step, buckets))
        return self.timed(lambda: self.worker.receive_weights(self.spec, step, buckets))

    # -- phases --------------------------------------------------------------------

    def check_phase(self, model_dir: str) -> None:
        a = self.args
        self.start(model_dir, "float32")
        self.open_channel()
        self.refit(0, 64 << 20)
        probe = rows(8, 24, 16, a.check_vocab, seed=7)
        self.wait()
        lp = self.worker.logprobs(probe)  # policy: both TP ranks take part
        if self.index in (0, GENERATION):
            self.put("check", logprobs=lp)
        # The same GRPO step at TP=2 (policy) and at TP=1 (a reference policy worker in the
        # generation's process, loaded with the weights the generation just received).
        batch = rows(8, 24, 16, a.check_vocab, seed=8)
        adv = [1.0 if i % 2 else -0.5 for i in range(8)]
        ref = None
        if self.index == GENERATION:
            from rlcore_megatron import convert
            from rlcore_megatron.plugin import MegatronOptions
            from rlcore_megatron.worker import MegatronPolicyWorker

            g = self.worker
            ref = MegatronPolicyWorker(0, 1)
            ref.load(
                model_dir,
                "float32",
                MegatronOptions(micro_batch_size=8),
                self.device,
                random_init=True,
            )
            convert.load_hf_stream(
                ref.model, convert.export_hf_state_dict(g.model, g.spec), ref.spec
            )
        self.wait()
        trainer = ref if self.index == GENERATION else self.worker
        out = trainer.train_step(batch, adv, None, 0.2, 1e-3)
        if self.index in (0, GENERATION):
            self.put("check_step", loss=out["loss"], grad_norm=out["grad_norm"])
        self.refit(1, 64 << 20)  # the generation now holds the TP=2-trained weights
        self.wait()
        lp = self.worker.logprobs(probe)
        if self.index in (0, GENERATION):
            self.put("check_after_step", logprobs=lp)
        if ref is not None:
            import torch

            from rlcore_megatron import convert

            trained = dict(convert.export_hf_state_dict(self.worker.model, self.worker.spec))
            diff = max(float((t - trained[n]).abs().max()) for n, t in ref.export_stream())
            self.put("check_ref", logprobs=ref.logprobs(probe), weight_max_diff=diff)
            ref.model = ref.optimizer = None
            if self.cuda:
                torch.cuda.empty_cache()

    def perf_phase(self, model_dir: str) -> None:
        a = self.args
        self.start(model_dir, a.dtype)
        nbytes = sum(s.nbytes for s in self.worker.weight_specs())
        self.put("perf_model", bytes=nbytes, tensors=len(self.worker.weight_specs()))
        # TP=2 forward/backward (the generation process only keeps the barriers).
        batch = rows(a.batch, a.prompt_len, a.completion_len, a.vocab, seed=1)
        adv = [((i % 4) - 1.5) / 1.5 for i in range(a.batch)]
        self.wait()
        if self.index in POLICY:
            w = self.worker
            w.train_step(batch, adv, None, 0.2, 1e-5)  # warm-up
            w.logprobs(batch)
            steps = [
                self.timed(lambda: w.train_step(batch, adv, None, 0.2, 1e-5)) for _ in range(a.reps)
            ]
            fwd = [self.timed(lambda: w.logprobs(batch)) for _ in range(a.reps)]
            self.put(
                "train",
                step_s=steps,
                logprobs_s=fwd,
                tokens=a.batch * (a.prompt_len + a.completion_len),
            )
        # Refit per bucket size: a warm-up, then timed repetitions.
        step = 100
        for mb in a.bucket_mb:
            times = []
            for rep in range(a.reps + 1):
                dt = self.refit(step, int(mb * 2**20))
                step += 1
                if rep:
                    times.append(dt)
            self.put("refit", bucket_mb=mb, seconds=times)
        # Export alone: the TP gathers and the HF mapping, nothing sent.
        self.wait()
        if self.index in POLICY:
            w = self.worker
            times = [self.timed(lambda: [None for _ in w.export_stream()]) for _ in range(a.reps)]
            self.put("export", seconds=times)
        # Ceiling: the same bytes in one NCCL broadcast between the same two processes.
        times = []
        for rep in range(a.reps + 1):
            self.wait()
            dt = 0.0
            if self.index == 0:
                dt = self.worker.refit_ceiling(self.spec, 10_000 + rep, nbytes)
            elif self.index == GENERATION:
                dt = self.worker.refit_ceiling(self.spec, 10_000 + rep, nbytes)
            if rep:
                times.append(dt)
        self.put("ceiling", seconds=times)
        # After all those refits the generation holds the policy's weights: compare.
        probe = rows(8, 64, 32, a.vocab, seed=9)
        self.wait()
        lp = self.worker.logprobs(probe)
        if self.index in (0, GENERATION):
            self.put("perf_check", logprobs=lp)
        if self.index == GENERATION:
            prompts = [p for p, _ in rows(a.gen_prompts, 32, 0, a.vocab, seed=10)]
            g = self.worker
            g.generate(prompts, a.gen_n, 4, 1.0, 0)  # warm-up
            t = self.timed(lambda: g.generate(prompts, a.gen_n, a.gen_tokens, 1.0, 1))
            self.put("generate", seconds=t, samples=a.gen_prompts * a.gen_n, tokens=a.gen_tokens)
        self.wait()


def run_proc(
    index: int, args: argparse.Namespace, ports: dict, dirs: dict, queue: Any, barrier: Any
) -> None:
    proc = None
    try:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 3))
        proc = Proc(index, args, ports, queue, barrier)
        proc.check_phase(dirs["check"])
        if not args.check_only:
            proc.perf_phase(dirs["perf"])
        queue.put({"proc": index, "phase": "done"})
    except BaseException:
        queue.put({"proc": index, "phase": "error", "error": traceback.format_exc()})
        barrier.abort()
        raise
    finally:
        if proc is not None and proc.worker is not None:
            proc.worker.teardown()


# ---------------------------------------------------------------------------
# The parent: start, collect, report
# ---------------------------------------------------------------------------


def mult_prob_error(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    import math

    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return math.exp(statistics.fmean(diffs)), max(diffs)


def report(results: list[dict], args: argparse.Namespace, wall_s: float) -> str:
    import torch

    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["phase"], []).append(r)

    def one(phase: str, proc: int | None = None) -> dict:
        rs = [r for r in by.get(phase, []) if proc is None or r["proc"] == proc]
        return rs[0] if rs else {}

    lines = []
    dev = (
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if args.device == "cuda"
        else "CPU (dry run, gloo)"
    )
    import megatron.core

    lines.append(
        f"device: {dev}; torch {torch.__version__}; megatron-core {getattr(megatron.core, '__version__', '?')}; "
        f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}"
    )
    lines.append(
        "processes: policy TP=2 on GPU0+GPU1, generation TP=1 on GPU1; refit channel GPU0 -> GPU1"
    )
    pol, gen = one("check", 0), one("check", GENERATION)
    if pol and gen:
        e, m = mult_prob_error(pol["logprobs"], gen["logprobs"])
        pol2, gen2 = one("check_after_step", 0), one("check_after_step", GENERATION)
        e2, m2 = mult_prob_error(pol2["logprobs"], gen2["logprobs"])
        lines.append(
            f"check (float32, {args.check_layers} layers, hidden {args.check_hidden}): policy TP=2 vs "
            f"generation TP=1 after refit: token_mult_prob_error {e:.6f} (max |dlogp| {m:.2e}); "
            f"after a TP=2 train step + refit: {e2:.6f} (max {m2:.2e})"
        )
        s2, s1, ref = (
            one("check_step", 0),
            one("check_step", GENERATION),
            one("check_ref", GENERATION),
        )
        if s2 and s1 and ref:
            e3, m3 = mult_prob_error(gen2["logprobs"], ref["logprobs"])
            lines.append(
                f"check: one GRPO step at TP=2 ({'NCCL' if args.device == 'cuda' else 'gloo'}) vs the same "
                f"step at TP=1: loss {s2['loss']:.6f} vs "
                f"{s1['loss']:.6f}, grad norm {s2['grad_norm']:.6f} vs {s1['grad_norm']:.6f}, weights max "
                f"|diff| {ref['weight_max_diff']:.2e} (lr 1e-3), logprobs after: token_mult_prob_error "
                f"{e3:.6f} (max {m3:.2e})"
            )
    model = one("perf_model", 0)
    if model:
        gib = model["bytes"] / 2**30
        lines.append(
            f"perf model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
            f"heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, {args.dtype}: "
            f"{model['bytes'] / (4 if args.dtype == 'float32' else 2) / 1e9:.2f} B params, "
            f"{model['bytes'] / 2**20:,.1f} MiB in {model['tensors']} tensors"
        )
        tr = one("train", 0)
        if tr:
            step, fwd = statistics.median(tr["step_s"]), statistics.median(tr["logprobs_s"])
            lines.append(
                f"TP=2 train step (GRPO loss, fwd+bwd+AdamW), {args.batch} x {args.prompt_len + args.completion_len} "
                f"tokens: {step * 1e3:.1f} ms median of {args.reps} ({tr['tokens'] / step:,.0f} tokens/s); "
                f"logprobs forward: {fwd * 1e3:.1f} ms ({tr['tokens'] / fwd:,.0f} tokens/s)"
            )
        ceiling = (
            statistics.median(one("ceiling", 0)["seconds"]) if one("ceiling", 0) else float("nan")
        )
        ceiling_g = (
            statistics.median(one("ceiling", GENERATION)["seconds"])
            if one("ceiling", GENERATION)
            else float("nan")
        )
        c = max(ceiling, ceiling_g)
        lines.append(
            f"ceiling: one broadcast of the same {gib:.3f} GiB GPU0 -> GPU1 over the refit channel: "
            f"{c * 1e3:.2f} ms ({model['bytes'] / c / 1e9:.0f} GB/s)"
        )
        for mb in args.bucket_mb:
            per_proc = [r for r in by.get("refit", []) if r["bucket_mb"] == mb]
            if not per_proc:
                continue
            reps = list(zip(*(r["seconds"] for r in per_proc), strict=True))
            t = statistics.median(max(x) for x in reps)
            lines.append(
                f"refit, buckets of {mb:g} MiB: {t * 1e3:.1f} ms median of {args.reps} "
                f"({model['bytes'] / t / 1e9:.1f} GB/s, {t / c:.1f}x the ceiling's time)"
            )
        ex = one("export", 0)
        if ex:
            t = statistics.median(ex["seconds"])
            lines.append(
                f"export alone (TP=2 all-gathers + HF mapping, nothing sent): {t * 1e3:.1f} ms "
                f"({model['bytes'] / t / 1e9:.1f} GB/s)"
            )
        pol, gen = one("perf_check", 0), one("perf_check", GENERATION)
        if pol and gen:
            e, m = mult_prob_error(pol["logprobs"], gen["logprobs"])
            lines.append(
                f"after the refits ({args.dtype}): policy TP=2 vs generation TP=1 token_mult_prob_error "
                f"{e:.4f} (max |dlogp| {m:.2e})"
            )
        g = one("generate", GENERATION)
        if g:
            lines.append(
                f"generation (static engine, TP=1): {g['samples']} samples x {g['tokens']} tokens in "
                f"{g['seconds']:.2f}s ({g['samples'] * g['tokens'] / g['seconds']:,.0f} tokens/s)"
            )
        ch = one("channel", 0)
        if ch:
            lines.append(
                f"refit channel (group of 2, {'NCCL' if args.device == 'cuda' else 'gloo'}) opened in {ch['open_s'] * 1e3:.0f} ms"
            )
    lines.append(f"wall time of the benchmark: {wall_s:.0f}s")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny perf model (CPU dry run)")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0, 512.0, 4096.0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gen-prompts", type=int, default=8)
    parser.add_argument("--gen-n", type=int, default=4)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=540.0)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    args.check_layers, args.check_hidden, args.check_vocab = 2, 128, 1000
    if args.small:
        args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab = (
            2,
            128,
            256,
            4,
            2,
            1000,
        )
        args.prompt_len, args.completion_len, args.batch, args.micro_batch = 16, 8, 4, 2
        args.gen_tokens, args.bucket_mb = 8, [0.25, 64.0]
        args.dtype = "float32"

    import torch
    import torch.multiprocessing as mp

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="megatron-gpu-"))
    dirs = {}
    for name, cfg in (
        ("check", llama_config(args.check_layers, args.check_hidden, 256, 4, 2, args.check_vocab)),
        (
            "perf",
            llama_config(args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab),
        ),
    ):
        (work / name).mkdir()
        (work / name / "config.json").write_text(json.dumps(cfg))
        dirs[name] = str(work / name)
    ports = {"policy": free_port(), "generation": free_port(), "channel": free_port()}
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(3)
    t0 = time.monotonic()
    procs = mp.start_processes(
        run_proc,
        args=(args, ports, dirs, queue, barrier),
        nprocs=3,
        join=False,
        start_method="spawn",
    )
    results: list[dict] = []
    done: set[int] = set()
    failed = False
    try:
        while len(done) < 3 and time.monotonic() - t0 < args.timeout_s:
            try:
                r = queue.get(timeout=1.0)
            except Exception:
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs.processes):
                    failed = True
                    break
                continue
            if r["phase"] == "error":
                print(f"process {r['proc']} failed:\n{r['error']}", file=sys.stderr)
                failed = True
                break
            if r["phase"] == "done":
                done.add(r["proc"])
            else:
                results.append(r)
        if len(done) < 3 and not failed:
            print(f"timed out after {args.timeout_s:g}s", file=sys.stderr)
            failed = True
    finally:
        for p in procs.processes:
            p.join(30 if not failed else 1)
            if p.is_alive():
                p.kill()
                p.join(5)
    text = report(results, args, time.monotonic() - t0)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

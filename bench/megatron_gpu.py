"""The Megatron backend on two GPUs, without Ray: TP=2 training over NCCL and GPU -> GPU refit.

Three processes (``torch.multiprocessing``, spawn), driving the backend's plain
worker classes directly, as its Ray actors would:

* processes 0 and 1: :class:`rlcore_megatron.worker.MegatronPolicyWorker`, tensor
  parallel 2 over NCCL, on GPU 0 and GPU 1;
* process 2: :class:`rlcore_megatron.worker.MegatronGenerationWorker` (TP=1,
  megatron-core's dynamic inference engine on CUDA, its static engine on CPU) on
  GPU 1, started refit-fed (model built from ``config.json``, no weights read).

Refit is the core's collective transport (:mod:`rlcore.refit.channels`): a
private NCCL group of policy rank 0 (GPU 0) and the generation (GPU 1). The
policy's TP ranks gather each tensor over their own NCCL group
(``convert.megatron_to_hf``), rank 0 packs and broadcasts bucket by bucket, the
generation copies its slices into the live model as buckets arrive. Its
throughput is compared with ``channels.ceiling``: one NCCL broadcast of the same
number of bytes between the same two processes over the same group.

Two phases:

1. ``check``: a small float32 model. Policy TP=2 logprobs vs the generation's
   (TP=1) after refit: the refit is exact and TP=2 computes what TP=1 does. The
   engines: greedy tokens of the generation's engine vs megatron-core's static
   engine over the same weights, and the policy's logprobs of sampled completions
   vs the engine's (token_mult_prob_error), after the first refit and after a
   train step + refit.
2. ``perf``: a Llama-shaped model (default about 1.1 B parameters, bfloat16, random
   weights from megatron-core's initialisation): TP=2 train-step and logprob
   throughput, refit time and throughput per bucket size vs the ceiling (also
   with the channels' previous, unpipelined implementation, kept here for the
   comparison), export alone (TP gathers, no send), generation throughput of the
   dynamic and the static engine. ``--refit-profile`` adds the refit's pieces
   per bucket size (export + pack, transfer alone, receive + load without the
   export, load alone) and torch.profiler traces of one refit per implementation
   (``--trace-dir``).

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

from rlcore.handles import SamplingParams

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
# The refit channel's previous collective path (before pipelining), for comparison
# ---------------------------------------------------------------------------


def legacy_send_weights(spec: Any, step: int, named: Any, buckets: Any) -> int:
    """``rlcore.refit.channels.send_weights`` (collective) as it was: a fresh buffer per
    bucket (``torch.cat``) and a stream wait on each broadcast before the next export."""
    import torch

    from rlcore.refit.specs import buckets_in_order
    from rlcore.refit.transports import collective as channels

    ch = channels._open[spec.key]
    sent = 0
    for _, tensors in buckets_in_order(named, buckets):
        flat = [
            t.to(ch.device).detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors
        ]
        buf = torch.cat(flat)
        ch.broadcast(buf).wait()
        sent += buf.numel()
    return sent


def legacy_receive_weights(spec: Any, rank: int, step: int, buckets: Any, *, device: Any = None):
    """``rlcore.refit.channels.receive_weights`` (collective) as it was: no bucket in flight
    while the previous one is unpacked and copied."""
    import torch

    from rlcore.refit.transports import collective as channels

    ch = channels._open[spec.key]
    for bucket in buckets:
        buf = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8, device=ch.device)
        ch.broadcast(buf).wait()
        yield from zip((s.name for s in bucket), channels._unpack(buf, bucket), strict=True)


class use_channels:
    """``with use_channels("legacy"):`` swaps the collective path for the old one."""

    def __init__(self, impl: str) -> None:
        self.impl = impl

    def __enter__(self) -> None:
        from rlcore.refit import channels

        self.saved = channels.send_weights, channels.receive_weights
        if self.impl == "legacy":
            channels.send_weights = legacy_send_weights
            channels.receive_weights = legacy_receive_weights

    def __exit__(self, *exc: object) -> None:
        from rlcore.refit import channels

        channels.send_weights, channels.receive_weights = self.saved


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
        from rlcore_megatron.options import MegatronOptions
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
                max_batch_size=max(a.gen_prompts) * a.gen_n,
                max_sequence_length=2048,
                seed=1234,
                timeout_s=600,
                engine=a.engine,
            )
            info = w.start(model_dir, dtype, options, self.device)
        if self.worker is not None:  # the refit channel stays open across phases
            # (the joined channels move to the new worker, whose teardown closes them)
            w._joined_channels().extend(self.worker._joined_channels())
            w._channel_ranks = getattr(self.worker, "_channel_ranks", {})
        self.groups_ready = True
        self.worker = w
        self.static_engine = None
        self.put("start", model=Path(model_dir).name, info=info)

    def static_twin(self) -> Any:
        """megatron-core's static engine over the generation's model (same weights)."""
        if self.static_engine is None:
            from rlcore_megatron.inference import build_static_engine

            g = self.worker
            self.static_engine = build_static_engine(
                g.model,
                g.engine.controller.tokenizer,
                g.spec,
                tp=g.tp_size,
                make_vocab_size_divisible_by=g.divisible,
                max_batch_size=g.options.max_batch_size,
                max_sequence_length=g.options.max_sequence_length,
                seed=g.options.seed + 1,
            )
        return self.static_engine

    def generate_with(self, kind: str, *args: Any) -> Any:
        """``generate`` with the worker's engine (``kind`` = its kind) or the static twin."""
        g = self.worker
        if kind == g.engine_kind:
            return g.generate(*args)
        saved = g.engine, g.engine_kind
        g.engine, g.engine_kind = self.static_twin(), "static"
        try:
            return g.generate(*args)
        finally:
            g.engine, g.engine_kind = saved

    def engine_check(self, tag: str, vocab: int) -> None:
        """Sampled completions from the generation's engine, scored by the policy; greedy
        tokens of the engine vs the static engine over the same weights."""
        path = Path(self.args.work) / f"samples-{tag}.json"
        prompts = [p for p, _ in rows(8, 12, 0, vocab, seed=11)]
        if self.index == GENERATION:
            g = self.worker
            sampled = g.generate(prompts, SamplingParams(2, 16, 1.0, 5))
            out = {
                "engine": g.engine_kind,
                "rows": [
                    (p, s["token_ids"])
                    for p, grp in zip(prompts, sampled, strict=True)
                    for s in grp
                ],
                "gen_lp": [s["logprobs"] for grp in sampled for s in grp],
            }
            for kind in dict.fromkeys((g.engine_kind, "static")):
                greedy = self.generate_with(kind, prompts, SamplingParams(1, 16, 0.0, 0))
                out[f"greedy_{kind}"] = [grp[0]["token_ids"] for grp in greedy]
                out[f"greedy_lp_{kind}"] = [grp[0]["logprobs"] for grp in greedy]
            path.write_text(json.dumps(out))
            self.put("engine_check_gen", tag=tag, **out)
        self.wait()
        if self.index in POLICY:
            data = json.loads(path.read_text())
            lp = self.worker.logprobs([(list(p), list(c)) for p, c in data["rows"]])
            greedy = [(p, c) for p, c in zip(prompts, data["greedy_static"], strict=True) if c]
            lp_greedy = self.worker.logprobs(greedy)
            if self.index == 0:
                self.put("engine_check_policy", tag=tag, logprobs=lp, greedy_logprobs=lp_greedy)
        self.wait()

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
            announce={"auto": None, "on": True, "off": False}[self.args.announce],
        )
        self.wait()
        t = 0.0
        if self.index == 0:
            t = self.timed(lambda: self.worker.open_refit_channel(self.spec))
        elif self.index == GENERATION:
            t = self.timed(lambda: self.worker.open_refit_channel(self.spec, 1))
        self.put("channel", open_s=t)

    def refit(self, step: int, bucket_bytes: int, impl: str = "current") -> float:
        """One refit policy -> generation; every process times from the same barrier."""
        from rlcore.refit.specs import plan_buckets

        buckets = plan_buckets(self.worker.weight_specs(), bucket_bytes)
        self.wait()
        with use_channels(impl):
            if self.index in POLICY:
                return self.timed(lambda: self.worker.send_weights(self.spec, step, buckets))
            return self.timed(lambda: self.worker.receive_weights(self.spec, step, buckets))

    def refit_pieces(self, bucket_bytes: int) -> None:
        """The refit's parts at one bucket size, each timed alone (same barrier, max over procs).

        ``export_pack``: the TP=2 export and packing into two reused buffers, nothing sent;
        ``transfer``: the packed buckets broadcast back to back, nothing else running;
        ``receive_load``: the real receive + load, the sender broadcasting (and announcing)
        pre-packed buckets (no export); ``load``: unpacking and loading buckets already on
        the receiver.
        """
        import torch

        from rlcore.refit.specs import buckets_in_order, plan_buckets
        from rlcore.refit.transports import collective as channels
        from rlcore_megatron import convert

        w = self.worker
        buckets = plan_buckets(w.weight_specs(), bucket_bytes)
        sizes = [sum(s.nbytes for s in b) for b in buckets]
        dev = torch.device(self.device)
        out: dict[str, float] = {}
        # export + pack
        self.wait()
        if self.index in POLICY:

            def export_pack() -> None:
                slots = [torch.empty(max(sizes), dtype=torch.uint8, device=dev) for _ in sizes[:2]]
                # what RefitSenderWorker.send_weights streams (buckets_in_order
                # checks each tensor against the plan, as the send does)
                stream = w.export_stream()
                if self.index == 0:
                    for i, tensors in buckets_in_order(stream, buckets):
                        channels._pack(tensors, slots[i % len(slots)][: sizes[i]])
                for _ in stream:
                    pass

            out["export_pack"] = self.timed(export_pack)
        # pre-packed buckets (sender) and receive buffers (receiver)
        packed = None
        if self.index == 0:
            named = dict(w.export_stream())
            packed = [
                channels._pack(
                    [named[s.name] for s in b], torch.empty(n, dtype=torch.uint8, device=dev)
                )
                for b, n in zip(buckets, sizes, strict=True)
            ]
            del named
        elif self.index == 1:
            for _ in w.export_stream():
                pass
        elif self.index == GENERATION:
            packed = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
        ch = channels._open.get(self.spec.key)

        def transfer(announce: bool = False) -> None:
            works = []
            for b in packed:
                if announce and ch.ready is not None:  # what channels.send_weights tells receivers
                    ch.ready.broadcast(torch.ones(1), 0, ch.timeout).wait()
                works.append(ch.broadcast(b))
            for work in works:
                work.wait()

        self.wait()
        if self.index in (0, GENERATION):
            out["transfer"] = self.timed(transfer)
        # receive + load with the sender not exporting
        self.wait()
        if self.index == 0:
            out["receive_load"] = self.timed(lambda: transfer(announce=True))
        elif self.index == GENERATION:
            out["receive_load"] = self.timed(
                lambda: w.receive_weights(self.spec, 50_000 + bucket_bytes % 997, buckets)
            )
        # load alone, from the buckets received above
        self.wait()
        if self.index == GENERATION:

            def load() -> None:
                stream = (
                    (s.name, t)
                    for b, buf in zip(buckets, packed, strict=True)
                    for s, t in zip(b, channels._unpack(buf, b), strict=True)
                )
                with torch.no_grad():
                    convert.load_hf_stream(
                        w.model,
                        stream,
                        w.spec,
                        tp_rank=w.tp_rank,
                        tp_size=w.tp_size,
                        make_vocab_size_divisible_by=w.divisible,
                    )

            out["load"] = self.timed(load)
        packed = None
        self.put("refit_pieces", bucket_mb=bucket_bytes / 2**20, buckets=len(buckets), **out)

    def refit_trace(self, step: int, bucket_bytes: int, impl: str) -> None:
        """One refit under torch.profiler; each process writes its trace and prints a summary."""
        import gzip
        import shutil

        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=acts) as prof:
            t = self.refit(step, bucket_bytes, impl)
        trace_dir = self.args.trace_dir
        if trace_dir:
            raw = Path(self.args.work) / f"trace-{impl}-p{self.index}.json"
            prof.export_chrome_trace(str(raw))
            with (
                open(raw, "rb") as src,
                gzip.open(Path(trace_dir) / (raw.name + ".gz"), "wb") as dst,
            ):
                shutil.copyfileobj(src, dst)
        key = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60)
        self.put("refit_trace", impl=impl, seconds=t, table=table)

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
        self.engine_check("after-refit", a.check_vocab)
        # The same GRPO step at TP=2 (policy) and at TP=1 (a reference policy worker in the
        # generation's process, loaded with the weights the generation just received).
        batch = rows(8, 24, 16, a.check_vocab, seed=8)
        adv = [1.0 if i % 2 else -0.5 for i in range(8)]
        ref = None
        if self.index == GENERATION:
            from rlcore_megatron import convert
            from rlcore_megatron.options import MegatronOptions
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
        self.engine_check("after-step-refit", a.check_vocab)
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
        # Refit per bucket size: a warm-up, then timed repetitions; the channels' current
        # implementation and (--compare-legacy) the previous one.
        step = 100
        impls = ["current", "legacy"] if a.compare_legacy else ["current"]
        for mb in a.bucket_mb:
            for impl in impls:
                times = []
                for rep in range(a.reps + 1):
                    dt = self.refit(step, int(mb * 2**20), impl)
                    step += 1
                    if rep:
                        times.append(dt)
                self.put("refit", bucket_mb=mb, impl=impl, seconds=times)
        if a.refit_profile:
            for mb in a.bucket_mb:
                self.refit_pieces(int(mb * 2**20))
            for impl in impls:
                self.refit_trace(step, int(min(a.bucket_mb) * 2**20), impl)
                step += 1
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
            g = self.worker
            for n_prompts in a.gen_prompts:
                prompts = [p for p, _ in rows(n_prompts, 32, 0, a.vocab, seed=10)]
                for kind in dict.fromkeys((g.engine_kind, "static")):
                    self.generate_with(kind, prompts, SamplingParams(a.gen_n, 4, 1.0, 0))  # warm-up
                    got: list = []
                    t = self.timed(
                        lambda kind=kind, got=got, prompts=prompts: got.extend(
                            self.generate_with(kind, prompts, SamplingParams(a.gen_n, a.gen_tokens, 1.0, 1))
                        )
                    )
                    self.put(
                        "generate",
                        engine=kind,
                        seconds=t,
                        samples=n_prompts * a.gen_n,
                        tokens=a.gen_tokens,
                        returned=sum(len(s["token_ids"]) for grp in got for s in grp),
                    )
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
    gen_start = one("start", GENERATION)
    engine = gen_start.get("info", {}).get("engine", "?")
    lines.append(
        f"processes: policy TP=2 on GPU0+GPU1, generation TP=1 on GPU1 ({engine} engine); "
        "refit channel GPU0 -> GPU1"
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
    for tag in ("after-refit", "after-step-refit"):
        g = next((r for r in by.get("engine_check_gen", []) if r["tag"] == tag), None)
        p = next((r for r in by.get("engine_check_policy", []) if r["tag"] == tag), None)
        if not (g and p):
            continue
        e, m = mult_prob_error(p["logprobs"], g["gen_lp"])
        kind = g["engine"]
        text = (
            f"check, {tag}: {kind} engine, {len(g['rows'])} sampled completions (T=1): "
            f"policy TP=2 vs engine logprobs token_mult_prob_error {e:.6f} (max |dlogp| {m:.2e})"
        )
        if kind != "static":
            mine, ref = g[f"greedy_{kind}"], g["greedy_static"]
            same = sum(a == b for a, b in zip(mine, ref, strict=True))
            lp = [
                (x, y)
                for a, b, la, lb in zip(
                    mine, ref, g[f"greedy_lp_{kind}"], g["greedy_lp_static"], strict=True
                )
                if a == b
                for x, y in zip(la, lb, strict=True)
            ]
            dmax = max((abs(x - y) for x, y in lp), default=float("nan"))
            text += (
                f"; greedy ({len(ref)} prompts x 16 tokens): {kind} == static engine on "
                f"{same}/{len(ref)} (logprobs max |diff| {dmax:.2e})"
            )
        lines.append(text)
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
            for impl in ("current", "legacy"):
                per_proc = [
                    r for r in by.get("refit", []) if r["bucket_mb"] == mb and r["impl"] == impl
                ]
                if not per_proc:
                    continue
                reps = list(zip(*(r["seconds"] for r in per_proc), strict=True))
                t = statistics.median(max(x) for x in reps)
                label = "" if impl == "current" else " [previous channels code]"
                lines.append(
                    f"refit, buckets of {mb:g} MiB{label}: {t * 1e3:.1f} ms median of {args.reps} "
                    f"({model['bytes'] / t / 1e9:.1f} GB/s, {t / c:.1f}x the ceiling's time)"
                )
        for mb in args.bucket_mb:
            pieces = [r for r in by.get("refit_pieces", []) if r["bucket_mb"] == mb]
            if not pieces:
                continue
            part = {
                k: max(r[k] for r in pieces if k in r)
                for k in ("export_pack", "transfer", "receive_load", "load")
                if any(k in r for r in pieces)
            }
            lines.append(
                f"refit pieces, {mb:g} MiB ({pieces[0]['buckets']} buckets): "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in part.items())
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
        for g in by.get("generate", []):
            lines.append(
                f"generation ({g['engine']} engine, TP=1): {g['samples']} samples x {g['tokens']} "
                f"tokens in {g['seconds']:.2f}s ({g['samples'] * g['tokens'] / g['seconds']:,.0f} "
                f"tokens/s; {g['returned']} tokens returned after end-of-sequence cuts)"
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
    parser.add_argument("--gen-prompts", type=int, nargs="+", default=[8])
    parser.add_argument("--gen-n", type=int, default=4)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=540.0)
    parser.add_argument("--engine", default="auto", help="generation.options.engine")
    parser.add_argument(
        "--compare-legacy", action="store_true", help="also time the previous channels code"
    )
    parser.add_argument("--refit-profile", action="store_true", help="time the refit's pieces")
    parser.add_argument(
        "--announce",
        choices=["auto", "on", "off"],
        default="auto",
        help="ChannelSpec.announce (auto: on over NCCL)",
    )
    parser.add_argument("--trace-dir", help="write torch.profiler traces of one refit here")
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
    args.work = str(work)
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
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
    for r in results:
        if r["phase"] == "refit_trace":
            print(f"--- torch.profiler, one refit ({r['impl']} channels), process {r['proc']}:")
            print(r["table"], flush=True)
    text = report(results, args, time.monotonic() - t0)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A GPU example run through ``rlcore run``, and the figures of its cost, in one go.

Runs ``python -m rlcore run CONFIG`` ``--runs`` times as a user would (embedded Ray cluster,
the example's steps; device memory sampled with ``nvidia-smi`` every 0.1 s), once more with
``placement.memory_handoff=false``, then measures on the same GPU, one at a time:

* **one copy**: one device-to-device copy of the refit's bytes in one process (CUDA
  events, median of 20): what ``refit_over_one_copy`` divides the run's refit by;
* **the floor**: the same backends started bare and concurrently on this GPU, without
  rlcore and without Ray (``bench/first_step.py``'s recipes: the plugin's worker classes
  called in plain processes); ``setup_over_floor`` is the run's setup critical path over it;
* **the engine alone**: the generation backend's engine in a plain process, loaded with
  the same checkpoint, generating the requests of one step (prompts of the run's env, the
  same samples, tokens and temperature) five times; ``generate_tokens_per_s_over_engine_alone``
  is the run's generated tokens per second of its generate phase over that (Megatron
  generation);
* **the roofline**: this GPU's HBM bandwidth (a 4 GiB device copy, read + write) over the
  bytes one decode step must read (every weight once and the mean KV cache in use: prompt
  plus half the completion per sample), times the batch (the step's samples, at most the
  engine's ``max_batch_size``): ``generate_tokens_per_s_over_roofline``;
* **training MFU**: the train phase's tokens (prompt + completion of every sample) per second
  x 6 x parameters over the GPU's dense bf16 peak (989 TFLOP/s on an H100 or H200 SXM;
  attention's own FLOPs left out).

Prints one ``name: value`` line per figure (medians over the runs' steps, or over runs for
per-run figures) and, with ``--write``, appends them with the command to that file.

    source .gpu/setup.sh && python3 bench/gpu_run.py --config examples/gpu/megatron_colocated.yaml --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rlcore.handles import SamplingParams

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_memory_gib() -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout
    return max(float(x) for x in out.split()) / 1024


class MemoryPeak:
    """The device's most used memory while it runs (``nvidia-smi`` every ``period_s``)."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s, self.peak, self._stop = period_s, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, gpu_memory_gib())
            self._stop.wait(self.period_s)

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_once(config: str, overrides: list[str], out: Path) -> tuple[list[dict[str, Any]], float]:
    """One ``rlcore run``: its metrics records and the device's peak memory above idle (GiB)."""
    idle = gpu_memory_gib()
    cmd = [sys.executable, "-m", "rlcore", "run", config, "--out", str(out), *overrides]
    with MemoryPeak() as mem:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, mem.peak - idle


#: Dense bf16 peak FLOP/s by device name (the SXM parts the device tool lends).
BF16_PEAK = {"H100": 989e12, "H200": 989e12}


def hbm_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy (read + write; median of 10)."""
    half = 2 * 1024**3
    return 2 * half / one_copy_s(half, repeats=10)


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Keys and values of one token over every layer, from the checkpoint's config."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size


def one_copy_s(nbytes: int, repeats: int = 20) -> float:
    """One device-to-device copy of ``nbytes`` in this process (median, CUDA events)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times[2:])


def engine_alone(config_path: str, overrides: list[str], repeats: int = 5) -> float:
    """Tokens per second of the Megatron engine alone on one step's requests (a subprocess)."""
    code = f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import gpu_run; gpu_run._engine_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, config_path, str(repeats), *overrides],
        capture_output=True, text=True, env=ENV, timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the engine alone failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def _engine_main() -> None:
    """In a plain process: the generation worker of the plugin, its weights from the
    checkpoint, the requests of one step; prints tokens per second (median of repeats)."""
    import torch.distributed as dist

    from rlcore.config import cache_dir, load_config
    from rlcore.models.tiny import ensure_model
    from rlcore.models.tokenizer import load as load_tokenizer
    from rlcore_megatron import convert
    from rlcore_megatron.handle import _options
    from rlcore_megatron.worker import MegatronGenerationWorker

    config_path, repeats, *overrides = sys.argv[1:]
    config = load_config(config_path, overrides)
    if config.generation.backend != "megatron":
        raise SystemExit("the engine alone is measured for Megatron generation")
    model_dir = str(ensure_model(config.model, cache_dir(config)))
    tokenizer = load_tokenizer(Path(model_dir))
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    worker = MegatronGenerationWorker(0, 1)
    worker.start(model_dir, config.model.dtype, _options(config.generation.options, "generation"), "cuda")
    with convert.HFCheckpoint(model_dir) as ckpt:
        convert.load_hf_weights(worker.model, ckpt.get, worker.spec, make_vocab_size_divisible_by=worker.divisible)
    worker.serving = True
    g = config.grpo
    prompts = [list(tokenizer(text).input_ids) for text in _step_prompts(config)]
    rates = []
    for i in range(int(repeats) + 1):
        t0 = time.monotonic()
        samples = worker.generate(prompts, SamplingParams(g.samples_per_prompt, g.max_new_tokens, g.temperature, i))
        elapsed = time.monotonic() - t0
        if i:  # the first call warms the engine up
            rates.append(sum(len(s["token_ids"]) for group in samples for s in group) / elapsed)
    print(statistics.median(rates))
    os._exit(0)


def _step_prompts(config: Any) -> list[str]:
    """One step's prompts of the run's env: the dataset's first rows, or arithmetic problems."""
    n = config.grpo.prompts_per_step
    if config.env.backend == "dataset":
        from rlcore_dataset.data import load_rows

        column = config.env.options.get("prompt_column", "prompt")
        return [str(row[column]) for row in load_rows(str(REPO / config.env.options["data"]))[:n]]
    from rlcore_arithmetic.task import make_prompts

    return [p.text for p in make_prompts(n, seed=config.grpo.seed)]


def floor_s(config_path: str, overrides: list[str], workdir: Path) -> float:
    """The backends started bare and concurrently on this GPU: the last one's ready time."""
    sys.path.insert(0, str(REPO / "bench"))
    import first_step

    from rlcore.config import cache_dir, load_config
    from rlcore.models.tiny import ensure_model

    config = load_config(config_path, overrides)
    model_dir = str(ensure_model(config.model, cache_dir(config)))
    return max(first_step.measure_floor(config, model_dir, workdir).values())


def decode_and_train_figures(config_path: str, overrides: list[str], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The generate phase against this GPU's roofline, the handoff's share of a step, and the
    train phase's MFU (medians over the steps)."""
    import torch

    from rlcore.config import cache_dir, load_config
    from rlcore.models.tiny import ensure_model

    config = load_config(config_path, overrides)
    model_dir = ensure_model(config.model, cache_dir(config))
    per_token = kv_bytes_per_token(model_dir, config.model.dtype)
    bandwidth = hbm_bandwidth()
    samples = config.grpo.prompts_per_step * config.grpo.samples_per_prompt
    batch = min(samples, int(config.generation.options.get("max_batch_size", samples)))
    weights = steps[0]["refit/bytes"]
    out: dict[str, Any] = {"hbm_copy_gb_per_s": bandwidth / 1e9}
    ratios, rooflines, mfus = [], [], []
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    params = weights / {"bfloat16": 2, "float16": 2, "float32": 4}[config.model.dtype]
    for r in steps:
        prompt_mean = r["generate/prompt_tokens"] / r["train/samples"]
        completion_mean = r["generate/tokens"] / r["train/samples"]
        step_bytes = weights + batch * (prompt_mean + completion_mean / 2) * per_token
        roofline = batch / (step_bytes / bandwidth)
        rooflines.append(roofline)
        ratios.append(r["generate/tokens"] / r["timing/generate_time_s"] / roofline)
        if peak:
            trained = r["generate/prompt_tokens"] + r["generate/tokens"]
            mfus.append(trained / r["timing/train_time_s"] * 6 * params / peak)
    out["roofline_tokens_per_s"] = statistics.median(rooflines)
    out["generate_tokens_per_s_over_roofline"] = statistics.median(ratios)
    out["completion_tokens_mean"] = statistics.median(r["generate/tokens"] / r["train/samples"] for r in steps)
    out["handoff_share_of_step"] = statistics.median(r["timing/handoff_time_s"] / r["timing/step_time_s"] for r in steps)
    out["generate_share_of_step"] = statistics.median(r["timing/generate_time_s"] / r["timing/step_time_s"] for r in steps)
    if mfus:
        out["train_mfu"] = statistics.median(mfus)
        out["train_tokens_per_s"] = statistics.median(
            (r["generate/prompt_tokens"] + r["generate/tokens"]) / r["timing/train_time_s"] for r in steps
        )
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--config", default=str(REPO / "examples" / "gpu" / "megatron_colocated.yaml"))
    parser.add_argument("--runs", type=int, default=2, help="runs with the handoff (one more runs without)")
    parser.add_argument("--write", default=None)
    parser.add_argument("--skip", default="", help="comma list of: floor, engine, nohandoff")
    parser.add_argument("--floors", type=int, default=1, help="floor measurements (median)")
    parser.add_argument("--engine-repeats", type=int, default=5, help="timed calls of the engine alone (median)")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.monotonic()

    def progress(what: str) -> None:  # stderr, flushed: a run cut short by a time limit still says how far it got
        print(f"[gpu_run {time.monotonic() - t_start:.0f} s] {what}", file=sys.stderr, flush=True)

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = [f"setup.cache_dir={tmp}/cache"]
        runs = []
        for i in range(args.runs):
            runs.append(run_once(args.config, [*cache, *args.overrides], Path(tmp) / f"run{i}"))
            steps_done = [r for r in runs[-1][0] if "reward/mean" in r]
            progress(f"run {i + 1}/{args.runs}: {len(steps_done)} steps, median step "
                     f"{statistics.median(r['timing/step_time_s'] for r in steps_done):.2f} s")
        steps = [r for records, _ in runs for r in records if "reward/mean" in r]
        setups = [next(r for r in records if "timing/setup/critical_path_s" in r) for records, _ in runs]
        nbytes = steps[0]["refit/bytes"]
        refit = statistics.median(r["refit/weight_sync_time_s"] for r in steps)
        copy = one_copy_s(nbytes)
        figures["refit_over_one_copy"] = refit / copy
        figures["refit_ms_median"] = refit * 1e3
        figures["one_copy_ms"] = copy * 1e3
        figures["refit_gib"] = nbytes / 2**30
        figures["refit_transport"] = steps[0]["refit/transport"]
        # The first run also made the model in the fresh cache: setups after it are compared.
        later = setups[1:] or setups
        figures["setup_critical_path_s_median"] = statistics.median(s["timing/setup/critical_path_s"] for s in later)
        figures["setup_critical_path_s_each"] = " ".join(f"{s['timing/setup/critical_path_s']:.2f}" for s in setups)
        if "floor" not in skip:
            floors = [floor_s(args.config, [*cache, *args.overrides], Path(tmp) / f"floor{i}") for i in range(args.floors)]
            floor = statistics.median(floors)
            figures["setup_floor_s"] = floor
            figures["setup_floor_s_each"] = " ".join(f"{f:.2f}" for f in floors)
            figures["setup_over_floor"] = figures["setup_critical_path_s_median"] / floor
            progress(f"setup floor {floor:.2f} s")
        gen_rate = statistics.median(r["generate/tokens"] / r["timing/generate_time_s"] for r in steps)
        figures["generate_tokens_per_s"] = gen_rate
        if "engine" not in skip:
            alone = engine_alone(args.config, [*cache, *args.overrides], args.engine_repeats)
            figures["engine_alone_tokens_per_s"] = alone
            figures["generate_tokens_per_s_over_engine_alone"] = gen_rate / alone
            progress(f"engine alone {alone:,.0f} tokens/s")
        figures["refit_check_share_of_step"] = statistics.median(r["timing/refit_check_share"] for r in steps)
        figures.update(decode_and_train_figures(args.config, [*cache, *args.overrides], steps))
        figures["peak_gib_with_handoff"] = statistics.median(peak for _, peak in runs)
        if "nohandoff" not in skip:
            records, peak = run_once(args.config, [*cache, *args.overrides, "placement.memory_handoff=false"], Path(tmp) / "nohandoff")
            figures["peak_gib_without_handoff"] = peak
            rest = [r for r in records if "reward/mean" in r]
            figures["step_s_median_without_handoff"] = statistics.median(r["timing/step_time_s"] for r in rest)
            figures["generate_tokens_per_s_without_handoff"] = statistics.median(
                r["generate/tokens"] / r["timing/generate_time_s"] for r in rest
            )
        figures["step_s_median"] = statistics.median(r["timing/step_time_s"] for r in steps)
        for phase in ("generate", "train", "refit", "handoff", "refit_check"):
            figures[f"{phase}_s_median"] = statistics.median(r[f"timing/{phase}_time_s"] for r in steps)
        firsts = [[r for r in records if "reward/mean" in r] for records, _ in runs]
        figures["reward_first"] = statistics.median(s[0]["reward/mean"] for s in firsts)
        figures["reward_last"] = statistics.median(s[-1]["reward/mean"] for s in firsts)
        figures["reward_max_step_mean"] = statistics.median(max(r["reward/mean"] for r in s) for s in firsts)
        figures["steps_per_run"] = len(firsts[0])
        figures["refit_check_max_mult_prob_error"] = max(r["refit/token_mult_prob_error"] for r in steps)
    lines = [f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in figures.items()]
    header = (
        f"# python3 bench/gpu_run.py {shlex.join(argv)}  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{args.runs} runs{'' if 'nohandoff' in skip else ' + 1 without handoff'}, {time.monotonic() - t_start:.0f} s)"
    )
    print("\n".join([header, *lines]))
    if args.write:
        with open(args.write, "a") as f:
            f.write("\n".join([header, *lines]) + "\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])

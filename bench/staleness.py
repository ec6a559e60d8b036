"""Training throughput of the loop that runs ahead: ``grpo.max_staleness`` 0, 1 and 2, one run.

Runs ``python -m rlcore run CONFIG grpo.max_staleness=K`` for each K (same config, seeds and
steps; the order of the runs rotates per round so drift in the machine's load falls on every
K alike) and reads each run's ``metrics.jsonl``:

* **throughput** = samples (tokens) the policy trained on / wall time from the start of
  step 1 to the end of the last step (setup left out: it is the same for every K);
* the lag of the samples (``staleness/lag_mean``), the trainer's wait for rollouts and
  the producer's wait at the gate (which side was the slower one).

Prints ``train_samples_per_s_staleness_1_over_0: X`` (and 2 over 0) with the figures under
it; ``--write`` appends them with the command to a file; ``--plot`` draws reward against
steps and against wall time for each K.

    python bench/staleness.py --config examples/quickstart.yaml --steps 20 --rounds 2 \\
        --write bench/results/async_cpu.txt --plot bench/results/async_cpu.png
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_once(config: str, k: int, steps: int, extra: list[str], out: Path) -> list[dict[str, Any]]:
    """One ``rlcore run``; its step lines (step >= 1 with a reward)."""
    cmd = [sys.executable, "-m", "rlcore", "run", config, f"grpo.max_staleness={k}", f"grpo.steps={steps}", *extra,
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in lines if m.get("step", 0) >= 1 and "reward/mean" in m]


def figures(lines: list[dict[str, Any]]) -> dict[str, float]:
    """Throughput over the steps' wall time, and where the time went."""
    start = lines[0]["time"] - lines[0]["timing/step_time_s"]
    wall = lines[-1]["time"] - start
    samples = sum(m["train/samples"] for m in lines)
    tokens = sum(m["generate/tokens"] for m in lines)
    return {
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "tokens_per_s": tokens / wall,
        "step_s_median": statistics.median(m["timing/step_time_s"] for m in lines),
        "generate_s_median": statistics.median(m["timing/generate_time_s"] for m in lines),
        "train_s_median": statistics.median(m["timing/train_time_s"] for m in lines),
        "refit_s_median": statistics.median(m["timing/refit_time_s"] for m in lines),
        "wait_for_rollouts_s_median": statistics.median(m.get("timing/wait_for_rollouts_time_s", 0.0) for m in lines),
        "producer_gated_s_median": statistics.median(m.get("timing/producer_gated_s", 0.0) for m in lines),
        "lag_mean": statistics.fmean(m.get("staleness/lag_mean", 0.0) for m in lines),
        "dropped_groups": sum(m.get("staleness/dropped_groups", 0) for m in lines),
        "reward_first_quarter": statistics.fmean(m["reward/mean"] for m in lines[: max(1, len(lines) // 4)]),
        "reward_last_quarter": statistics.fmean(m["reward/mean"] for m in lines[-max(1, len(lines) // 4):]),
    }


def plot(runs: dict[int, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4))
    for k, lines in sorted(runs.items()):
        start = lines[0]["time"] - lines[0]["timing/step_time_s"]
        reward = [m["reward/mean"] for m in lines]
        by_step.plot([m["step"] for m in lines], reward, marker=".", label=f"max_staleness {k}")
        by_time.plot([m["time"] - start for m in lines], reward, marker=".", label=f"max_staleness {k}")
    by_step.set_xlabel("step")
    by_time.set_xlabel("seconds since step 1 began")
    for ax in (by_step, by_time):
        ax.set_ylabel("reward/mean")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each K; figures are medians over rounds")
    ap.add_argument("--ks", default="0,1,2")
    ap.add_argument("--write", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    per_k: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
    last: dict[int, list[dict[str, Any]]] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k in ks[r % len(ks):] + ks[: r % len(ks)]:
                lines = run_once(args.config, k, args.steps, args.overrides, Path(tmp) / f"k{k}-r{r}")
                per_k[k].append(figures(lines))
                last[k] = lines
                print(f"round {r + 1}: max_staleness {k}: {per_k[k][-1]['samples_per_s']:.2f} samples/s", flush=True)
    med = {k: {name: statistics.median(f[name] for f in fs) for name in fs[0]} for k, fs in per_k.items()}
    out = [f"# python bench/staleness.py {shlex.join(sys.argv[1:])}  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
           f"{args.rounds} round(s) of {len(ks)} runs, {time.monotonic() - t0:.0f} s)"]
    base = med.get(0)
    for k in ks:
        if base is not None and k != 0:
            out.append(f"train_samples_per_s_staleness_{k}_over_0: {med[k]['samples_per_s'] / base['samples_per_s']:.3f}")
    for k in ks:
        out += [f"train_samples_per_s_staleness_{k}: {med[k]['samples_per_s']:.3f}",
                f"train_tokens_per_s_staleness_{k}: {med[k]['tokens_per_s']:.2f}"]
    for k in ks:
        out.append(f"# max_staleness {k}: " + ", ".join(f"{n} {v:.3f}" for n, v in med[k].items()))
    text = "\n".join(out)
    print(text)
    if args.write:
        with args.write.open("a") as f:
            f.write(text + "\n")
    if args.plot:
        plot(last, args.plot, f"{Path(args.config).stem}: reward at max_staleness {', '.join(map(str, ks))}")


if __name__ == "__main__":
    main()

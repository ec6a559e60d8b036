"""A lost generation engine, replaced: kill to serving again against the engine's own init.

One run of a config with ``generation.on_worker_loss=replace``; the engine's process
(a Ray actor) is SIGKILLed at three seeded steps, before the step's rollouts or its
refit (the chaos plugin of ``tests/e2e/worker_loss_chaos.py``). For each loss it prints the
seconds from the kill to the core's detection, and from the kill to serving again (the
replacement started through the backend's init hook, refitted from the policy's
current weights, its logprobs checked against the policy's), next to the same run's
``init:generation`` setup time and the replacement's own init; the ratio
kill-to-serving / setup init is the figure of issue 12 (goal: at most 1.5).

    python bench/worker_loss.py                                 # vLLM, quickstart, 40 steps
    python bench/worker_loss.py --config examples/megatron.yaml --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))


def main() -> None:
    from test_worker_loss_e2e import SMALL, chaos_run, kill_plan, summary
    from worker_loss_chaos import Chaos

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "examples" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    chaos = Chaos(kill_plan(args.steps))
    with tempfile.TemporaryDirectory() as tmp:
        records = chaos_run(Path(tmp), args.config, args.steps, chaos, "generation.on_worker_loss=replace")
    steps = [r for r in records if "reward/mean" in r]
    print(f"config {Path(args.config).name}, {args.steps} steps ({' '.join(SMALL)}), "
          f"kills at {sorted(chaos.plan.items())}")
    print(f"steps finished: {len(steps)}/{args.steps}; refit token_mult_prob_error max "
          f"{max(r['refit/token_mult_prob_error'] for r in steps):.6f}")
    print("step  kill->detect  kill->serving  replacement init  setup init  kill->serving / setup init")
    rows = summary(chaos, records)
    for r in rows:
        print(f"{r['step']:>4}  {r['kill_to_detect_s']:>10.2f}s  {r['kill_to_serving_s']:>12.2f}s  "
              f"{r['replace_init_s']:>15.2f}s  {r['setup_init_s']:>9.2f}s  "
              f"{r['kill_to_serving_vs_setup_init']:>10.2f}x")
    ratio = [r["kill_to_serving_s"] / r["replace_init_s"] for r in rows]
    print(f"kill->serving / the replacement's own init: {min(ratio):.2f}-{max(ratio):.2f}x "
          f"(median {statistics.median(ratio):.2f}x)")


if __name__ == "__main__":
    main()

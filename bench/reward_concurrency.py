"""Rewards are not the step's bottleneck by accident: a 1 s reward at 64 samples per step.

The ``dataset`` env scores a step's groups concurrently across ``env.workers`` reward
processes, one call per group. With 8 prompts x 8 samples (64 samples) and a reward that
takes ``--seconds`` per call, the bound concurrency allows is ``ceil(8 / workers) * seconds``;
this measures the reward phase (the pool's calls for one step, after the processes are
started, as in a run) for each worker count and prints it beside that bound. No model is
involved: the reward phase is the env's own time inside a step.

    python bench/reward_concurrency.py --write bench/results/reward_concurrency_cpu.txt
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

from rlcore_dataset.pool import RewardPool
from rlcore_dataset.rewards import RewardSpec
from rlcore_dataset.scoring import GroupInput, score_groups

REWARD = '''
import time

def slow(completions, **kwargs):
    time.sleep({seconds})
    return [1.0] * len(completions)
'''


def measure(workers: int, groups: int, samples: int, seconds: float, repeats: int, spec: str) -> list[float]:
    pool = RewardPool([spec], workers=workers, timeout_s=seconds * 10 + 30)
    pool.start()
    try:
        inputs = [GroupInput(g, f"p{g}", {}, [f"c{j}" for j in range(samples)]) for g in range(groups)]
        times = []
        for _ in range(repeats):
            t0 = time.monotonic()
            score_groups(pool, [RewardSpec(spec)], inputs, on_error="fail")
            times.append(time.monotonic() - t0)
        return times
    finally:
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slow_reward.py"
        path.write_text(REWARD.format(seconds=args.seconds))
        spec = f"{path}:slow"
        lines = [
            f"reward phase of one step: {args.prompts} prompts x {args.samples} samples = "
            f"{args.prompts * args.samples} samples, one {args.seconds:g} s call per group",
            f"{'workers':>7}  {'median s':>8}  {'bound s':>7}  {'median/bound':>12}",
        ]
        for w in (int(x) for x in args.workers.split(",")):
            times = measure(w, args.prompts, args.samples, args.seconds, args.repeats, spec)
            bound = math.ceil(args.prompts / w) * args.seconds
            med = statistics.median(times)
            lines.append(f"{w:>7}  {med:>8.2f}  {bound:>7.2f}  {med / bound:>12.3f}")
    text = "\n".join(lines)
    print(text)
    if args.write:
        args.write.write_text(text + "\n")


if __name__ == "__main__":
    main()

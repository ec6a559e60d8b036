"""Leave-one-out REINFORCE on rlcore, on whatever backends the config selects.

    python examples/loops/loo_reinforce.py [CONFIG] [key=value ...] --steps N [--out DIR]

Each prompt's samples are each other's baseline: a sample's advantage is its reward less
the mean reward of the prompt's other samples (RLOO), not normalised; the policy's step is
rlcore's clipped policy-gradient loss on them (docs/library.md). Each refit is checked
on the next step's own samples before it trains on them (no extra engine call), the last
one on the probe batch. CONFIG defaults to examples/quickstart.yaml.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import rlcore
from rlcore.errors import ConfigError, RlcoreError

QUICKSTART = Path(__file__).resolve().parents[1] / "quickstart.yaml"


def loo_advantages(rewards: list[float]) -> list[float]:
    """Each reward less the mean of the others (zeros for a group of one)."""
    n, total = len(rewards), sum(rewards)
    return [r - (total - r) / (n - 1) if n > 1 else 0.0 for r in rewards]


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, str, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--out", default=None, help="run directory (default: under output_dir)")
    a = p.parse_intermixed_args(argv)
    config = a.args[0] if a.args and "=" not in a.args[0] else str(QUICKSTART)
    return a, config, [x for x in a.args if "=" in x]


def main(argv: list[str] | None = None) -> int:
    args, config, overrides = parse(argv)
    try:
        with rlcore.open(config, overrides, out=args.out, needs_env=True) as s:
            for step in range(1, args.steps + 1):
                groups = s.rollouts(step)  # prompts x samples, scored by the env
                rollouts = [r for g in groups for r in g]
                batch = [(r["prompt_ids"], r["token_ids"]) for r in rollouts]
                advantages = [a for g in groups for a in loo_advantages([r["reward"] for r in g])]
                old = s.policy.logprobs(batch)
                # The last refit, checked on the tokens it sampled, before training on them.
                err = s.check_refit(
                    step - 1, generation_logprobs=[r["logprobs"] for r in rollouts],
                    policy_logprobs=old, sampled_by=step,
                )
                stats = s.train(step, batch, advantages, old)
                report = s.refit(step)
                reward = statistics.fmean(r["reward"] for r in rollouts)
                s.record({
                    "reward/mean": reward, **stats,  # train/loss, train/grad_norm... as rlcore run names them
                    "refit/token_mult_prob_error": err, "refit/checked_step": step - 1,
                    "refit/weight_sync_time_s": report.weight_sync_time_s,
                }, step)
                print(f"step {step:>3}  reward {reward:.3f}  loss {stats['train/loss']:+.4f}  "
                      f"mult_prob_err {err:.4f} (refit {step - 1})", flush=True)
            err = s.check_refit(args.steps)  # the last refit: no step follows, so the probe batch
            s.record({"refit/token_mult_prob_error": err, "refit/checked_step": args.steps},
                     args.steps, step_done=False)
            print(f"refit of step {args.steps} checked (probe): mult_prob_err {err:.4f}")
    except rlcore.RunInterrupted as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    except RlcoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ConfigError) else 3  # bad input, or a failed run
    print(f"run directory: {s.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A two-turn loop on rlcore: the env answers a wrong answer and the model tries again.

    python examples/loops/multi_turn.py [CONFIG] [key=value ...] --steps N [--out DIR]

The model answers each prompt; below full marks the env answers back (" wrong, try again: 3+4=")
and the model takes a second turn on the whole conversation. An episode's reward is its last
turn's score less TURN_COST per extra turn; its advantage is that reward against the prompt's
other episodes (mean and deviation); every model turn trains with it, its prompt the conversation
before it. Needs a prompt-and-score env (env.backend=arithmetic). CONFIG: examples/quickstart.yaml.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import rlcore
from rlcore.errors import ConfigError, RlcoreError
from rlcore.handles import SamplingParams

QUICKSTART = Path(__file__).resolve().parents[1] / "quickstart.yaml"
TURNS, TURN_COST, FEEDBACK = 2, 0.1, " wrong, try again: "


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, str, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--out", default=None, help="run directory (default: under output_dir)")
    a = p.parse_intermixed_args(argv)
    config = a.args[0] if a.args and "=" not in a.args[0] else str(QUICKSTART)
    return a, config, [x for x in a.args if "=" in x]


def episodes(s: rlcore.Session, step: int) -> tuple[list[int], list[list[tuple]], list[float], list[float]]:
    """Each prompt ``samples_per_prompt`` times, up to TURNS model turns each; per episode its
    prompt's index, turns (prompt ids, completion ids, logprobs), reward, first turn's score."""
    g, tok = s.config.grpo, s.tokenizer
    prompts = s.env.sample_prompts(g.prompts_per_step, step)
    owner = [i for i in range(len(prompts)) for _ in range(g.samples_per_prompt)]
    talk = [list(tok(prompts[i].text).input_ids) for i in owner]  # the conversation so far
    turns: list[list[tuple]] = [[] for _ in owner]
    reward, first = [0.0] * len(owner), [0.0] * len(owner)
    waiting = list(range(len(owner)))  # episodes whose model speaks next
    for turn in range(TURNS):
        params = SamplingParams(1, g.max_new_tokens, g.temperature, (g.seed * 1_000_003 + step) * TURNS + turn)
        samples = [x[0] for x in s.generate(step, [talk[e] for e in waiting], params)]
        texts = [[tok.decode(x["token_ids"], skip_special_tokens=True)] for x in samples]
        scores = [row[0] for row in s.env.score([prompts[owner[e]] for e in waiting], texts)]
        answered_back = []
        for e, x, score in zip(waiting, samples, scores, strict=True):
            turns[e].append((list(talk[e]), x["token_ids"], x["logprobs"]))
            reward[e], first[e] = score - TURN_COST * turn, first[e] if turn else score
            if score < 1.0:  # the env answers back; the model speaks again
                talk[e] += x["token_ids"] + tok.encode(FEEDBACK + prompts[owner[e]].text, add_special_tokens=False)
                answered_back.append(e)
        waiting = answered_back
    return owner, turns, reward, first


def main(argv: list[str] | None = None) -> int:
    args, config, overrides = parse(argv)
    try:
        with rlcore.open(config, overrides, out=args.out, needs_env=True) as s:
            for step in range(1, args.steps + 1):
                owner, turns, reward, first = episodes(s, step)
                groups = {i: [r for o, r in zip(owner, reward, strict=True) if o == i] for i in set(owner)}
                stat = {i: (statistics.fmean(r), statistics.pstdev(r)) for i, r in groups.items()}
                adv = [(r - stat[o][0]) / (stat[o][1] + 1e-6) for o, r in zip(owner, reward, strict=True)]
                flat = [(t, a) for ts, a in zip(turns, adv, strict=True) for t in ts]  # every model turn
                batch = [(p, c) for (p, c, _), _ in flat]
                old = s.policy.logprobs(batch)
                err = s.check_refit(step - 1, generation_logprobs=[lp for (_, _, lp), _ in flat],
                                    policy_logprobs=old, sampled_by=step)
                stats = s.train(step, batch, [a for _, a in flat], old)
                s.refit(step)
                m = {"reward/mean": statistics.fmean(reward), "reward/first_turn": statistics.fmean(first),
                     "turns/mean": len(flat) / len(turns), **stats,  # train/loss, train/grad_norm...
                     "refit/token_mult_prob_error": err, "refit/checked_step": step - 1}
                s.record(m, step)
                print(f"step {step:>3}  reward {m['reward/mean']:.3f} (first turn {m['reward/first_turn']:.3f})"
                      f"  turns {m['turns/mean']:.2f}  mult_prob_err {err:.4f}", flush=True)
            err = s.check_refit(args.steps)  # the last refit, on the probe batch
            s.record({"refit/token_mult_prob_error": err, "refit/checked_step": args.steps},
                     args.steps, step_done=False)
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

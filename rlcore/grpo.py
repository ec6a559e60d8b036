"""The small GRPO loop of ``rlcore run``: rollout -> reward -> train step -> refit -> probe.

Pure orchestration in the driver: the handles do the work in their workers.
Policy and generation exchange token ids and per-token logprobs as plain
lists, so nothing here imports torch.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlcore.config import GRPOConfig


@dataclass(frozen=True)
class Sequence_:
    """One sample: prompt token ids and the completion's token ids."""

    prompt: list[int]
    completion: list[int]


def group_advantages(rewards: Sequence[Sequence[float]], eps: float = 1e-6) -> list[list[float]]:
    """GRPO advantages: each reward normalised by its group's mean and standard deviation.

    A group whose rewards are all equal carries no signal and gets zeros.
    """
    out = []
    for group in rewards:
        mean = statistics.fmean(group)
        std = statistics.pstdev(group) if len(group) > 1 else 0.0
        out.append([(r - mean) / (std + eps) if std > eps else 0.0 for r in group])
    return out


def token_mult_prob_error(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """exp of the mean absolute per-token logprob difference (1.0 = identical)."""
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    if not diffs:
        raise ValueError("token_mult_prob_error of an empty batch")
    return math.exp(statistics.fmean(diffs))


def make_probe(tokenizer: Any, prompts: Sequence[str], completions: Sequence[str]) -> list[Sequence_]:
    """A fixed probe batch: token ids of prompt/completion pairs."""
    return [
        Sequence_(tokenizer(p).input_ids, tokenizer(c, add_special_tokens=False).input_ids)
        for p, c in zip(prompts, completions, strict=True)
    ]


def run_grpo(
    *,
    cfg: GRPOConfig,
    tokenizer: Any,
    policy: Any,
    generation: Any,
    env: Any,
    refit: Callable[[int], Any],
    probe: Sequence[Sequence_],
    on_step: Callable[[dict[str, Any]], None],
    trace: Callable[[str, float, float, int], None] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> list[dict[str, Any]]:
    """Run ``cfg.steps`` GRPO steps; call ``on_step`` with each step's metrics.

    The env either makes prompts and scores texts (``sample_prompts`` /
    ``score``), or collects scored rollouts itself through the generation
    endpoint (``collect_rollouts(prompts, samples, step)`` returning, per prompt,
    samples ``{"prompt_ids", "token_ids", "logprobs", "reward"}``).

    ``refit(step)`` copies the policy's weights to the generation engine and
    returns a :class:`rlcore.handles.RefitReport`. ``trace(name, start, end,
    step)`` records phases for the Chrome trace.
    """
    history = []
    probe_batch = [(s.prompt, s.completion) for s in probe]
    for step in range(1, cfg.steps + 1):
        if cancelled():
            break
        t_step = time.monotonic()
        phases: dict[str, float] = {}

        def phase(name: str, t0: float, step: int = step, phases: dict[str, float] = phases) -> None:
            t1 = time.monotonic()
            phases[name] = t1 - t0
            if trace:
                trace(name, t0, t1, step)

        t0 = time.monotonic()
        if hasattr(env, "collect_rollouts"):
            # The env drives the model itself (through the generation endpoint) and scores.
            groups = env.collect_rollouts(cfg.prompts_per_step, cfg.samples_per_prompt, step)
            phase("rollout", t0)
            t0 = time.monotonic()
            rewards = [[c["reward"] for c in g] for g in groups]
        else:
            prompts = env.sample_prompts(cfg.prompts_per_step, step)
            prompt_ids = [tokenizer(p.text).input_ids for p in prompts]
            groups = generation.generate(
                prompt_ids,
                n=cfg.samples_per_prompt,
                max_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                seed=cfg.seed * 1_000_003 + step,
            )
            for pid, g in zip(prompt_ids, groups, strict=True):
                for c in g:
                    c["prompt_ids"] = pid
            phase("rollout", t0)
            t0 = time.monotonic()
            texts = [[tokenizer.decode(c["token_ids"], skip_special_tokens=True) for c in g] for g in groups]
            rewards = env.score(prompts, texts)
        advantages = group_advantages(rewards)
        phase("reward", t0)

        t0 = time.monotonic()
        batch = [(c["prompt_ids"], c["token_ids"]) for g in groups for c in g]
        flat_adv = [a for g in advantages for a in g]
        gen_lp = [c["logprobs"] for g in groups for c in g]
        old_lp = policy.logprobs(batch)
        train = policy.train_step(batch, flat_adv, old_lp, clip_eps=cfg.clip_eps, lr=cfg.learning_rate)
        phase("train", t0)

        t0 = time.monotonic()
        report = refit(step)
        phase("refit", t0)

        t0 = time.monotonic()
        probe_err = token_mult_prob_error(generation.logprobs(probe_batch), policy.logprobs(probe_batch))
        phase("probe", t0)

        flat_rewards = [r for g in rewards for r in g]
        metrics: dict[str, Any] = {
            "step": step,
            "reward/mean": statistics.fmean(flat_rewards),
            "reward/max": max(flat_rewards),
            "reward/exact": statistics.fmean(1.0 if r >= 1.0 else 0.0 for r in flat_rewards),
            "train/loss": train.get("loss"),
            "train/grad_norm": train.get("grad_norm"),
            "train/gen_vs_policy_mult_prob_error": token_mult_prob_error(gen_lp, old_lp),
            "refit/weight_sync_time_s": report.weight_sync_time_s,
            "refit/bytes": report.bytes,
            "refit/throughput_gib_s": report.throughput_gib_s,
            "refit/transport": report.transport,
            "refit/token_mult_prob_error": probe_err,
            "timing/step_time_s": time.monotonic() - t_step,
            **{f"timing/{k}_time_s": v for k, v in phases.items()},
        }
        history.append(metrics)
        on_step(metrics)
    return history

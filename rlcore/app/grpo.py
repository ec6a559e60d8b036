"""The small GRPO loop of ``rlcore run``: rollout -> reward -> train step -> refit -> probe.

Pure orchestration in the driver: the handles do the work in their workers.
Policy and generation exchange token ids and per-token logprobs as plain
lists, so nothing here imports torch. Every backend is reached through its
guarded handle (:mod:`rlcore.guards`), so a result of the wrong shape names the
backend that returned it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlcore.app.recovery import retry_on_generation_loss
from rlcore.config import GRPOConfig
from rlcore.errors import DivergenceError
from rlcore.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.handles import MemoryHandoff, Pair, RolloutRequest

#: Texts the probe batch is cut from: fixed, so every run compares the same tokens.
PROBE_TEXTS = (
    "3+4=7",
    "the quick brown fox jumps over the lazy dog",
    "12*3=36",
    "policy and generation must agree on every token",
    "9-5=4",
    "weights move from the trainer to the engine",
    "an rl step: sample, score, train, refit",
    "7+8=15",
)


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


class Handoff:
    """Colocated policy and generation take turns on the devices (:class:`MemoryHandoff`).

    ``to_generation()`` puts the policy to sleep and wakes the generation (before
    sampling); ``to_policy()`` the reverse (before training). A role whose backend does
    not declare ``memory_handoff`` is ``None`` and skipped; with neither, nothing happens.
    """

    def __init__(self, policy: MemoryHandoff | None = None, generation: MemoryHandoff | None = None) -> None:
        self.policy, self.generation = policy, generation

    def to_generation(self) -> None:
        if self.policy is not None:
            self.policy.sleep()
        if self.generation is not None:
            self.generation.wake()

    def to_policy(self) -> None:
        if self.generation is not None:
            self.generation.sleep()
        if self.policy is not None:
            self.policy.wake()


def probe_batch(tokenizer: Any, n: int) -> list[Pair]:
    """``n`` fixed (prompt, completion) pairs for comparing policy and generation logprobs.

    Cut from :data:`PROBE_TEXTS` (cycled): the prompt is the first half of a text's
    tokens (BOS included if the tokenizer adds one), the completion the rest plus
    EOS. Any env, any model: the comparison needs real token ids, not a task.
    """
    pairs: list[Pair] = []
    for i in range(n):
        ids = list(tokenizer(PROBE_TEXTS[i % len(PROBE_TEXTS)]).input_ids)
        cut = max(1, len(ids) // 2)
        tail = ids[cut:] + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        pairs.append((ids[:cut], tail or ids[-1:]))
    return pairs


def check_divergence(err: float, limit: float | None, *, step: int, policy: str, generation: str) -> None:
    """Raise :class:`DivergenceError` when ``err`` (token_mult_prob_error after the refit of
    ``step``) exceeds ``limit`` (``refit.max_mult_prob_error``; None: never)."""
    if limit is not None and not err <= limit:  # NaN fails too
        raise DivergenceError(
            f"after the refit of step {step}, generation backend '{generation}' and policy backend "
            f"'{policy}' disagree: refit/token_mult_prob_error {err:.4f} > refit.max_mult_prob_error "
            f"{limit:g}. The engine is not computing with the weights the policy trains (a refit "
            "that did not load them, or a logprob convention that differs); the step's metrics "
            "were written. Set refit.max_mult_prob_error=null to run on regardless."
        )


def _step_metrics(
    step: int,
    rewards: list[list[float]],
    train: dict[str, float],
    gen_lp: list[list[float]],
    old_lp: list[list[float]],
    report: Any,
    probe_err: float,
    phases: dict[str, float],
) -> dict[str, Any]:
    """One step's metrics: rewards, train step, generation vs policy, refit, phase times."""
    flat_rewards = [r for g in rewards for r in g]
    return {
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
        **{f"timing/{k}_time_s": v for k, v in phases.items()},
    }


def run_grpo(
    *,
    cfg: GRPOConfig,
    tokenizer: Any,
    policy: GuardedPolicy,
    generation: GuardedGeneration,
    env: GuardedEnv,
    refit: Callable[[int], Any],
    probe: Sequence[Pair],
    on_step: Callable[[dict[str, Any]], None],
    max_mult_prob_error: float | None = None,
    handoff: Handoff | None = None,
    trace: Callable[[str, float, float, int], None] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    on_generation_loss: Callable[[Any, int, str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``cfg.steps`` GRPO steps; call ``on_step`` with each step's metrics.

    Each step asks the env for scored rollouts (:class:`rlcore.handles.RolloutRequest`:
    a prompt-and-score env samples through ``generation``; a Gym env drives the model
    through its endpoint), trains on them, refits, and compares generation and
    policy logprobs on ``probe``. ``refit(step)`` copies the policy's weights to the
    generation engine and returns a :class:`rlcore.handles.RefitReport`. After
    ``on_step`` has the step's metrics, a ``token_mult_prob_error`` above
    ``max_mult_prob_error`` raises :class:`DivergenceError`. With ``handoff``
    (colocated), the generation has the devices while it samples and answers the
    probe, the policy while it trains. ``trace(name, start, end, step)`` records
    phases for the Chrome trace.

    With ``on_generation_loss`` (``generation.on_worker_loss: replace``), a phase that
    loses a generation worker (rollout, refit, probe) calls
    ``on_generation_loss(error, step, phase)``, which puts a new engine with the
    policy's current weights in place, and then runs again with the same request and
    seed (:func:`rlcore.app.recovery.retry_on_generation_loss`).
    """
    handoff = handoff or Handoff()
    history = []
    for step in range(1, cfg.steps + 1):
        if cancelled():
            break
        t_step = time.monotonic()
        phases: dict[str, float] = {}
        recover = (
            None
            if on_generation_loss is None
            else lambda err, name, step=step: on_generation_loss(err, step, name)
        )

        def phase(name: str, t0: float, step: int = step, phases: dict[str, float] = phases) -> None:
            t1 = time.monotonic()
            phases[name] = t1 - t0
            if trace:
                trace(name, t0, t1, step)

        t0 = time.monotonic()
        handoff.to_generation()
        phase("handoff", t0)

        t0 = time.monotonic()
        request = RolloutRequest(
            step=step,
            prompts=cfg.prompts_per_step,
            samples_per_prompt=cfg.samples_per_prompt,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed * 1_000_003 + step,
            generation=generation,
            tokenizer=tokenizer,
        )
        groups = retry_on_generation_loss(
            lambda request=request: env.collect_rollouts(request), recover, "rollout"
        )
        phase("rollout", t0)

        t0 = time.monotonic()
        rewards = [[r["reward"] for r in g] for g in groups]
        advantages = group_advantages(rewards)
        phase("reward", t0)

        t0 = time.monotonic()
        handoff.to_policy()
        batch = [(r["prompt_ids"], r["token_ids"]) for g in groups for r in g]
        flat_adv = [a for g in advantages for a in g]
        gen_lp = [r["logprobs"] for g in groups for r in g]
        old_lp = policy.logprobs(batch)
        train = policy.train_step(batch, flat_adv, old_lp, clip_eps=cfg.clip_eps, lr=cfg.learning_rate)
        phase("train", t0)

        t0 = time.monotonic()
        report = retry_on_generation_loss(lambda step=step: refit(step), recover, "refit")
        phase("refit", t0)

        t0 = time.monotonic()
        handoff.to_generation()
        probe_err = retry_on_generation_loss(
            lambda: token_mult_prob_error(generation.logprobs(probe), policy.logprobs(probe)), recover, "probe"
        )
        phase("probe", t0)

        metrics = _step_metrics(step, rewards, train, gen_lp, old_lp, report, probe_err, phases)
        metrics["timing/step_time_s"] = time.monotonic() - t_step
        history.append(metrics)
        on_step(metrics)
        check_divergence(
            probe_err, max_mult_prob_error, step=step, policy=policy.backend, generation=generation.backend
        )
    return history

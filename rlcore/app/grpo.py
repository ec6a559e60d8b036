"""The small GRPO loop of ``rlcore run``: rollout -> reward -> train step -> refit -> refit check.

Pure orchestration in the driver: the handles do the work in their workers.
Policy and generation exchange token ids and per-token logprobs as plain
lists, so nothing here imports torch. Every backend is reached through its
guarded handle (:mod:`rlcore.guards`), so a result of the wrong shape names the
backend that returned it.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlcore.app.health import check_train_health
from rlcore.app.recovery import retry_on_generation_loss
from rlcore.config import REFIT_CHECKS, GRPOConfig
from rlcore.errors import DivergenceError, ProtocolError
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


def check_divergence(
    err: float, limit: float | None, *, step: int, policy: str, generation: str, sampled_by: int | None = None
) -> None:
    """Raise :class:`DivergenceError` when ``err`` (token_mult_prob_error after the refit of
    ``step``) exceeds ``limit`` (``refit.max_mult_prob_error``; None: never).

    ``sampled_by``: the step whose samples measured ``err`` (``refit.check: sampled``);
    None: the probe batch did."""
    if limit is not None and not err <= limit:  # NaN fails too
        how = (
            "on the probe batch"
            if sampled_by is None
            else f"on the tokens step {sampled_by} sampled (its train step did not run)"
        )
        raise DivergenceError(
            f"after the refit of step {step}, generation backend '{generation}' and policy backend "
            f"'{policy}' disagree {how}: refit/token_mult_prob_error {err:.4f} > "
            f"refit.max_mult_prob_error {limit:g}. The engine is not computing with the weights the "
            "policy trains (a refit that did not load them, or a logprob convention that differs); "
            "the metrics were written. Set refit.max_mult_prob_error=null to run on regardless."
        )


#: The phases every step's metrics line times, as ``timing/<phase>_time_s`` (also the
#: names of the step's spans in the trace). ``handoff`` sums every memory handoff of the
#: step; ``train`` is the policy's logprobs of the samples and its train step.
PHASES = ("generate", "reward", "train", "refit", "handoff", "refit_check")


class _StepClock:
    """One step's phase times: ``with clock("train"): ...`` adds the block's wall time to
    the phase (a phase that runs more than once, like the handoff, adds up) and records
    a span for the trace."""

    def __init__(self, step: int, trace: Callable[[str, float, float, int], None] | None) -> None:
        self.step, self.trace = step, trace
        self.times = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            t1 = time.monotonic()
            self.times[name] += t1 - t0
            if self.trace:
                self.trace(name, t0, t1, self.step)

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}_time_s": v for k, v in self.times.items()}


def _probe_error(generation: GuardedGeneration, policy: GuardedPolicy, probe: Sequence[Pair]) -> float:
    """token_mult_prob_error of the generation's and the policy's logprobs on the probe batch."""
    return token_mult_prob_error(generation.logprobs(probe), policy.logprobs(probe))


def _step_metrics(
    step: int,
    rewards: list[list[float]],
    train: dict[str, float],
    gen_vs_policy: float,
    report: Any,
    check: dict[str, Any],
    tokens: int = 0,
) -> dict[str, Any]:
    """One step's metrics: rewards, generated tokens, train step, generation vs policy,
    refit, refit check."""
    flat_rewards = [r for g in rewards for r in g]
    return {
        "step": step,
        "generate/tokens": tokens,
        "reward/mean": statistics.fmean(flat_rewards),
        "reward/max": max(flat_rewards),
        "reward/exact": statistics.fmean(1.0 if r >= 1.0 else 0.0 for r in flat_rewards),
        "train/loss": train.get("loss"),
        "train/grad_norm": train.get("grad_norm"),
        "train/gen_vs_policy_mult_prob_error": gen_vs_policy,
        "refit/weight_sync_time_s": report.weight_sync_time_s,
        "refit/bytes": report.bytes,
        "refit/throughput_gib_s": report.throughput_gib_s,
        "refit/transport": report.transport,
        **check,
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
    refit_check: str = "probe",
    on_check: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``cfg.steps`` GRPO steps; call ``on_step`` with each step's metrics.

    Each step asks the env for scored rollouts (:class:`rlcore.handles.RolloutRequest`:
    a prompt-and-score env samples through ``generation``; a Gym env drives the model
    through its endpoint), trains on them and refits: ``refit(step)`` copies the policy's
    weights to the generation engine and returns a :class:`rlcore.handles.RefitReport`.
    With ``handoff`` (colocated), the generation has the devices while it samples (and
    answers a probe), the policy while it trains. ``trace(name, start, end, step)``
    records each phase (:data:`PHASES`) for the Chrome trace.

    Every refit is checked: generation and policy logprobs of the same tokens compared
    (``refit/token_mult_prob_error``; above ``max_mult_prob_error`` :class:`DivergenceError`).
    ``refit_check`` says how (``refit.check``; this function's default is ``probe``, the
    loop's behaviour before ``sampled`` existed; ``rlcore run`` passes the config's):

    * ``sampled``: the refit of step t is checked by step t+1 with what that step has
      anyway: the generation's logprobs of its samples (``gen_lp``, returned with the
      rollouts, always at temperature 1: :mod:`rlcore.handles`) against the policy's of
      the same tokens (``old_lp``, computed before its train step). No engine call is
      added; ``refit_check_time_s`` is the comparison. Step 1 checks the refit before the
      loop (``refit:initial``, step 0). So step t's line carries the check of the refit of
      step t-1 (``refit/checked_step``) beside its own refit's figures, and equals its
      ``train/gen_vs_policy_mult_prob_error``. A failed check stops step t before its
      train step, after ``on_check`` has the check's record. The last step's refit has no
      next rollout: it is checked once with the probe batch after the loop, its record
      (``refit/checked_step`` = the last step) given to ``on_check``.
    * ``probe``: after each refit the generation (handed the devices first) and the policy
      compute logprobs of the fixed ``probe`` batch; step t's line carries the check of
      its own refit (``refit/checked_step`` t). ``on_check`` is not called.

    Every step line times :data:`PHASES` (``timing/<phase>_time_s``), the whole step
    (``timing/step_time_s``) and ``timing/refit_check_share`` (refit check / step).

    With ``on_generation_loss`` (``generation.on_worker_loss: replace``), a phase that
    loses a generation worker (rollout, refit, probe) calls
    ``on_generation_loss(error, step, phase)``, which puts a new engine with the
    policy's current weights in place, and then runs again with the same request and
    seed (:func:`rlcore.app.recovery.retry_on_generation_loss`).
    """
    if refit_check not in REFIT_CHECKS:
        raise ValueError(f"refit_check is {refit_check!r}; expected one of {list(REFIT_CHECKS)}")
    sampled = refit_check == "sampled"
    handoff = handoff or Handoff()
    history: list[dict[str, Any]] = []

    def recover_at(step: int) -> Callable[[Any, str], None] | None:
        if on_generation_loss is None:
            return None
        return lambda err, name: on_generation_loss(err, step, name)

    def diverged(err: float, step: int, sampled_by: int | None = None) -> None:
        check_divergence(
            err, max_mult_prob_error, step=step, policy=policy.backend, generation=generation.backend,
            sampled_by=sampled_by,
        )

    step = 0
    try:
        for step in range(1, cfg.steps + 1):
            if cancelled():
                break
            t_step = time.monotonic()
            clock = _StepClock(step, trace)
            recover = recover_at(step)

            with clock("handoff"):
                handoff.to_generation()
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
            with clock("generate"):
                groups = retry_on_generation_loss(
                    lambda request=request: env.collect_rollouts(request), recover, "rollout"
                )
            with clock("reward"):
                rewards = [[r["reward"] for r in g] for g in groups]
                advantages = group_advantages(rewards)
            with clock("handoff"):
                handoff.to_policy()
            batch = [(r["prompt_ids"], r["token_ids"]) for g in groups for r in g]
            flat_adv = [a for g in advantages for a in g]
            gen_lp = [r["logprobs"] for g in groups for r in g]
            hyper = {"clip_eps": cfg.clip_eps, "lr": cfg.learning_rate}
            with clock("train"):
                old_lp = policy.logprobs(batch)
                if not sampled:
                    train = policy.train_step(batch, flat_adv, old_lp, **hyper)
            if sampled:
                # The check sits between the policy's logprobs and its train step (two train
                # spans in the trace): a failed check stops the step before it trains.
                with clock("refit_check"):
                    gen_vs_policy = token_mult_prob_error(gen_lp, old_lp)
                check: dict[str, Any] = {
                    "refit/check": "sampled",
                    "refit/checked_step": step - 1,
                    "refit/token_mult_prob_error": gen_vs_policy,
                }
                if max_mult_prob_error is not None and not gen_vs_policy <= max_mult_prob_error:
                    if on_check is not None:
                        on_check({
                            "step": step, **check, "train/gen_vs_policy_mult_prob_error": gen_vs_policy,
                            **clock.metrics(),
                        })
                    diverged(gen_vs_policy, step - 1, sampled_by=step)
                with clock("train"):
                    train = policy.train_step(batch, flat_adv, old_lp, **hyper)
            else:
                gen_vs_policy = token_mult_prob_error(gen_lp, old_lp)
            # Non-finite weights must not reach the engine, nor the next step train on them.
            check_train_health(train, backend=policy.backend, step=step)
            with clock("refit"):
                report = retry_on_generation_loss(lambda step=step: refit(step), recover, "refit")
            if not sampled:
                with clock("handoff"):
                    handoff.to_generation()
                with clock("refit_check"):
                    probe_err = retry_on_generation_loss(
                        lambda: _probe_error(generation, policy, probe), recover, "probe"
                    )
                check = {"refit/check": "probe", "refit/checked_step": step, "refit/token_mult_prob_error": probe_err}

            tokens = sum(len(completion) for _, completion in batch)
            metrics = _step_metrics(step, rewards, train, gen_vs_policy, report, check, tokens)
            step_time = time.monotonic() - t_step
            metrics.update(clock.metrics())
            metrics["timing/step_time_s"] = step_time
            metrics["timing/refit_check_share"] = clock.times["refit_check"] / step_time if step_time > 0 else 0.0
            history.append(metrics)
            on_step(metrics)
            if not sampled:
                diverged(check["refit/token_mult_prob_error"], step)

    except ProtocolError as err:
        # The guards name backend, role and method; the step is the loop's to say.
        raise ProtocolError(
            f"at step {step}: {err}", backend=err.backend, role=err.role, method=err.method
        ) from err

    if sampled and history and not cancelled():
        # The last refit: no rollout follows, so the probe batch checks it, once per run.
        last = history[-1]["step"]
        clock = _StepClock(last, trace)
        with clock("handoff"):
            handoff.to_generation()
        with clock("refit_check"):
            err = retry_on_generation_loss(lambda: _probe_error(generation, policy, probe), recover_at(last), "probe")
        if on_check is not None:
            on_check({
                "step": last,
                "refit/check": "probe",
                "refit/checked_step": last,
                "refit/token_mult_prob_error": err,
                "timing/handoff_time_s": clock.times["handoff"],
                "timing/refit_check_time_s": clock.times["refit_check"],
            })
        diverged(err, last)
    return history

"""The small GRPO loop of ``rlcore run``: rollout -> reward -> train step -> refit -> refit check.

Written on :class:`rlcore.Session` alone (:func:`run_grpo_on`), as any loop on rlcore is:
the session's handles do the work in their workers, its methods bring the run's services
(memory handoff, a lost generation replaced, training health, the refit check, records,
trace). Policy and generation exchange token ids and per-token logprobs as plain lists,
so nothing here imports torch. :func:`run_grpo` runs the same loop over handles started
otherwise (the loop's tests).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlcore.app.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.app.refit_check import (  # the refit check's helpers, where they were before
    PROBE_TEXTS,
    check_divergence,
    probe_batch,
    token_mult_prob_error,
)
from rlcore.app.session import Handoff, Session
from rlcore.config import REFIT_CHECKS, GRPOConfig, RefitConfig, RunConfig
from rlcore.errors import DivergenceError, ProtocolError
from rlcore.handles import Pair

__all__ = [
    "PHASES", "PROBE_TEXTS", "Handoff", "check_divergence", "group_advantages", "probe_batch",
    "run_grpo", "run_grpo_on", "token_mult_prob_error",
]


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


#: The phases every step's metrics line times, as ``timing/<phase>_time_s`` (also the
#: names of the step's spans in the trace). ``handoff`` sums every memory handoff of the
#: step; ``train`` is the policy's logprobs of the samples and its train step.
PHASES = ("generate", "reward", "train", "refit", "handoff", "refit_check")


class _StepClock:
    """One step's phase times: ``with clock("train"): ...`` adds the block's wall time to
    the phase (a phase that runs more than once, like the handoff, adds up) and records
    a span for the trace."""

    def __init__(self, step: int, session: Session) -> None:
        self.step, self.session = step, session
        self.times = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            t1 = time.monotonic()
            self.times[name] += t1 - t0
            self.session.span(name, t0, t1, step=self.step, lane="grpo")

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}_time_s": v for k, v in self.times.items()}


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


def run_grpo_on(
    s: Session,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_check: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``s.config.grpo.steps`` GRPO steps on the session; returns every step's metrics.

    Each step asks the env for scored rollouts (:meth:`Session.rollouts`), computes group
    advantages, trains (:meth:`Session.train`) and refits (:meth:`Session.refit`). With
    colocated roles the generation has the devices while it samples (and answers a probe),
    the policy while it trains. ``on_step(metrics)`` gets each step's line (default:
    :meth:`Session.record`); each phase (:data:`PHASES`) is a span of the trace.

    Every refit is checked (:meth:`Session.check_refit`): generation and policy logprobs of
    the same tokens compared (``refit/token_mult_prob_error``; above
    ``refit.max_mult_prob_error`` :class:`DivergenceError`). ``refit.check`` says how:

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
      (``refit/checked_step`` = the last step) given to ``on_check`` (default: recorded,
      not as a step done).
    * ``probe``: after each refit the generation (handed the devices first) and the policy
      compute logprobs of the fixed probe batch; step t's line carries the check of its
      own refit (``refit/checked_step`` t), written before a failed check raises.
      ``on_check`` is not called.

    Every step line times :data:`PHASES` (``timing/<phase>_time_s``), the whole step
    (``timing/step_time_s``) and ``timing/refit_check_share`` (refit check / step).

    With ``generation.on_worker_loss: replace``, a phase that loses a generation worker
    (rollout, refit, probe) is run again with the same request and seed once the session
    has put a new engine with the policy's current weights in place.
    """
    cfg, how = s.config.grpo, s.config.refit.check
    if how not in REFIT_CHECKS:
        raise ValueError(f"refit_check is {how!r}; expected one of {list(REFIT_CHECKS)}")
    sampled = how == "sampled"
    record_step = on_step or (lambda m: s.record(m, m["step"]))
    record_check = on_check or (lambda m: s.record(m, m["step"], step_done=False))
    history: list[dict[str, Any]] = []

    step = 0
    try:
        for step in range(1, cfg.steps + 1):
            if s.cancelled:
                break
            t_step = time.monotonic()
            clock = _StepClock(step, s)

            with clock("handoff"):
                s.to_generation()
            with clock("generate"):
                groups = s.rollouts(step)
            with clock("reward"):
                rewards = [[r["reward"] for r in g] for g in groups]
                advantages = group_advantages(rewards)
            with clock("handoff"):
                s.to_policy()
            batch: list[Pair] = [(r["prompt_ids"], r["token_ids"]) for g in groups for r in g]
            flat_adv = [a for g in advantages for a in g]
            gen_lp = [r["logprobs"] for g in groups for r in g]
            with clock("train"):
                old_lp = s.policy.logprobs(batch)
                if not sampled:
                    train = s.train(step, batch, flat_adv, old_lp)
            if sampled:
                # The check sits between the policy's logprobs and its train step (two train
                # spans in the trace): a failed check stops the step before it trains.
                check: dict[str, Any] = {"refit/check": "sampled", "refit/checked_step": step - 1}
                try:
                    with clock("refit_check"):
                        gen_vs_policy = s.check_refit(
                            step - 1, generation_logprobs=gen_lp, policy_logprobs=old_lp, sampled_by=step
                        )
                except DivergenceError as failed:
                    err = failed.mult_prob_error
                    record_check({
                        "step": step, **check, "refit/token_mult_prob_error": err,
                        "train/gen_vs_policy_mult_prob_error": err, **clock.metrics(),
                    })
                    raise
                check["refit/token_mult_prob_error"] = gen_vs_policy
                with clock("train"):
                    train = s.train(step, batch, flat_adv, old_lp)
            else:
                gen_vs_policy = token_mult_prob_error(gen_lp, old_lp)
            with clock("refit"):
                report = s.refit(step)
            failure: DivergenceError | None = None
            if not sampled:
                with clock("handoff"):
                    s.to_generation()
                try:
                    with clock("refit_check"):
                        probe_err = s.check_refit(step)
                except DivergenceError as failed:  # the step's line is written first
                    probe_err, failure = failed.mult_prob_error, failed
                check = {"refit/check": "probe", "refit/checked_step": step, "refit/token_mult_prob_error": probe_err}

            tokens = sum(len(completion) for _, completion in batch)
            metrics = _step_metrics(step, rewards, train, gen_vs_policy, report, check, tokens)
            step_time = time.monotonic() - t_step
            metrics.update(clock.metrics())
            metrics["timing/step_time_s"] = step_time
            metrics["timing/refit_check_share"] = clock.times["refit_check"] / step_time if step_time > 0 else 0.0
            history.append(metrics)
            record_step(metrics)
            if failure is not None:
                raise failure

    except ProtocolError as err:
        # The guards name backend, role and method; the step is the loop's to say.
        raise ProtocolError(
            f"at step {step}: {err}", backend=err.backend, role=err.role, method=err.method
        ) from err

    if sampled and history and not s.cancelled:
        # The last refit: no rollout follows, so the probe batch checks it, once per run.
        last = history[-1]["step"]
        clock = _StepClock(last, s)
        with clock("handoff"):
            s.to_generation()
        failure = None
        try:
            with clock("refit_check"):
                err = s.check_refit(last)
        except DivergenceError as failed:
            err, failure = failed.mult_prob_error, failed
        record_check({
            "step": last,
            "refit/check": "probe",
            "refit/checked_step": last,
            "refit/token_mult_prob_error": err,
            "timing/handoff_time_s": clock.times["handoff"],
            "timing/refit_check_time_s": clock.times["refit_check"],
        })
        if failure is not None:
            raise failure
    return history


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
    """:func:`run_grpo_on` over handles started otherwise: ``refit(step)`` copies the
    weights and returns a :class:`rlcore.handles.RefitReport`, ``trace(name, start, end,
    step)`` records each phase, ``on_generation_loss(error, step, phase)`` replaces a lost
    generation (:class:`rlcore.app.recovery.GenerationRecovery`). ``refit_check`` defaults
    to ``probe``, the loop's behaviour before ``sampled`` existed; ``on_check`` is called
    only when given."""
    if refit_check not in REFIT_CHECKS:
        raise ValueError(f"refit_check is {refit_check!r}; expected one of {list(REFIT_CHECKS)}")
    config = RunConfig(grpo=cfg, refit=RefitConfig(check=refit_check, max_mult_prob_error=max_mult_prob_error))
    session = Session(
        config=config, policy=policy, generation=generation, env=env, tokenizer=tokenizer, probe=probe,
        refit=refit, handoff=handoff, on_generation_loss=on_generation_loss, span=trace, cancelled=cancelled,
    )
    return run_grpo_on(session, on_step=on_step, on_check=on_check or (lambda m: None))

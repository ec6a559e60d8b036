"""The small GRPO loop of ``rlcore run``: rollout -> reward -> train step -> refit -> refit check.

Written on :class:`rlcore.Session` alone (:func:`run_grpo_on`), as any loop on rlcore is:
the session's handles do the work in their workers, its methods bring the run's services
(memory handoff, a lost generation replaced, training health, the refit check, records,
trace). Policy and generation exchange token ids and per-token logprobs as plain lists,
so nothing here imports torch. :func:`run_grpo` runs the same loop over handles started
otherwise (the loop's tests).

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

Every synchronous step also measures the sampler/trainer mismatch on its own samples, the
same two logprobs per token, before it trains (:meth:`Session.check_mismatch`:
``mismatch/kl``, the importance weights' mean and extremes; above ``grpo.max_mismatch`` a
warning, or with ``grpo.on_mismatch: stop`` the end of the run before the step trains).

``grpo.max_staleness`` k >= 1 runs the loop ahead (:meth:`Session.rollout_stream`): a
producer thread generates step t + 1 .. t + k while step t trains, the refit of step t
lands between the engine's calls (or in flight, where the generation declares it), and
step t + 1 + k starts once that refit is checked. So step t trains on samples of weights
up to k versions old (``staleness/lag_mean``, ``staleness/lag_max``; a group with an
older token is dropped whole, ``staleness/dropped_groups``), its clipped loss takes the
ratio against the sampling logprobs (the behaviour policy) instead of a policy forward,
and every refit is checked with the probe (no sample comes from the weights the policy
has when it trains). ``timing/generate_time_s`` is then the producer's call, beside the
train step; ``timing/wait_for_rollouts_time_s`` is what the trainer waited for it, and
``timing/producer_gated_s`` what the producer waited at the bound. k = 0 is the loop above,
unchanged.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlcore.app.dynamic_sampling import has_signal
from rlcore.app.refit_check import (  # the refit check's helpers, where they were before
    PROBE_TEXTS,
    check_divergence,
    probe_batch,
    token_mult_prob_error,
)
from rlcore.app.session import Handoff, Session
from rlcore.app.stream import RolloutStream, StepRollouts
from rlcore.config import REFIT_CHECKS, GRPOConfig, RefitConfig, RunConfig
from rlcore.errors import DivergenceError, ProtocolError
from rlcore.handles import Pair, Rollout

__all__ = [
    "PHASES", "PROBE_TEXTS", "Handoff", "check_divergence", "group_advantages", "probe_batch",
    "run_grpo", "run_grpo_on", "token_mult_prob_error",
]


def group_advantages(
    rewards: Sequence[Sequence[float]], eps: float = 1e-6, failed: Sequence[Sequence[bool]] | None = None
) -> list[list[float]]:
    """GRPO advantages: each reward normalised by its group's mean and standard deviation.

    A group whose rewards are all equal carries no signal and gets zeros. A sample marked
    in ``failed`` (its reward could not be computed: a rollout with ``failed``) is left out
    of its group's mean and deviation and gets 0: it moves nothing.
    """
    out = []
    for i, group in enumerate(rewards):
        ok = [not f for f in failed[i]] if failed is not None else [True] * len(group)
        if not has_signal(group, [not k for k in ok], eps):
            out.append([0.0] * len(group))
            continue
        kept = [r for r, k in zip(group, ok, strict=True) if k]
        mean, std = statistics.fmean(kept), statistics.pstdev(kept)
        out.append([(r - mean) / (std + eps) if k else 0.0 for r, k in zip(group, ok, strict=True)])
    return out


def scored(groups: Sequence[Sequence[Rollout]]) -> tuple[list[list[float]], list[list[bool]]]:
    """The rollouts' rewards and which of them failed (``failed`` set by the env)."""
    return (
        [[r["reward"] for r in g] for g in groups],
        [["failed" in r for r in g] for g in groups],
    )


#: The phases every step's metrics line times, as ``timing/<phase>_time_s`` (also the
#: names of the step's spans in the trace). ``handoff`` sums every memory handoff of the
#: step; ``train`` is the policy's logprobs of the samples and its train step;
#: ``checkpoint`` what the step waited for saves (its own, and one still running from an
#: earlier step before the policy's first call: :mod:`rlcore.app.checkpointing`).
PHASES = ("generate", "reward", "train", "refit", "handoff", "refit_check", "checkpoint")


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
            self.times[name] = self.times.get(name, 0.0) + t1 - t0
            self.session.span(name, t0, t1, step=self.step, lane="grpo")

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}_time_s": v for k, v in self.times.items()}


def _step_metrics(
    step: int,
    got: _Samples,
    train: dict[str, float],
    gen_vs_policy: float | None,
    report: Any,
    check: dict[str, Any],
) -> dict[str, Any]:
    """One step's metrics: rewards, generated tokens, train step, generation vs policy,
    refit, refit check; with the samples' weight ``versions`` (those that carry them),
    their staleness: each sample's lag is the policy's version (step - 1) minus its
    oldest token's version. Samples marked ``failed`` (no reward) are counted in
    ``reward/failed`` and left out of the reward figures (NaN when every one failed)."""
    rewards, failed, versions = got.rewards, got.failed, got.versions
    tokens = sum(len(completion) for _, completion in got.batch)
    prompt_tokens = sum(len(prompt) for prompt, _ in got.batch)
    flags = [f for g in failed for f in g] if failed else [False] * sum(len(g) for g in rewards)
    flat_rewards = [r for r, f in zip((r for g in rewards for r in g), flags, strict=True) if not f]
    lags = [step - 1 - min(v) for v in versions if v]
    staleness = {
        "staleness/lag_mean": statistics.fmean(lags),
        "staleness/lag_max": max(lags),
        "generate/weight_versions": sorted({x for v in versions for x in v}),
    } if lags else {}
    return {
        "step": step,
        "generate/tokens": tokens,
        "generate/prompt_tokens": prompt_tokens,
        "reward/mean": statistics.fmean(flat_rewards) if flat_rewards else math.nan,
        "reward/max": max(flat_rewards) if flat_rewards else math.nan,
        "reward/exact": statistics.fmean(1.0 if r >= 1.0 else 0.0 for r in flat_rewards) if flat_rewards else math.nan,
        "reward/failed": sum(flags),
        "reward/groups": len(rewards),
        # Groups whose rewards are all equal: zero advantage, nothing learned from them.
        "reward/zero_variance_groups": sum(
            1 for i, g in enumerate(rewards) if g and not has_signal(g, failed[i] if failed else None)
        ),
        **train,  # Session.train's train/loss, train/grad_norm...: a library loop's names
        "train/gen_vs_policy_mult_prob_error": gen_vs_policy,
        "refit/weight_sync_time_s": report.weight_sync_time_s,
        "refit/bytes": report.bytes,
        "refit/throughput_gib_s": report.throughput_gib_s,
        "refit/transport": report.transport,
        **staleness,
        **check,
    }


#: A run warns when more than half of its steps so far, after at least this many, had no
#: gradient (:class:`_NoGradientWatch`).
NO_GRADIENT_MIN_STEPS = 4


class _NoGradientWatch:
    """Counts the steps with no gradient: every group's rewards equal
    (``reward/zero_variance_groups`` == ``reward/groups``), so every advantage is zero and
    the train step learns nothing. Once more than half of the steps so far (at least
    :data:`NO_GRADIENT_MIN_STEPS`) had none, the session warns, once, naming the env."""

    def __init__(self, s: Session) -> None:
        self.session = s
        self.steps = self.without = 0
        self.warned = False

    def see(self, metrics: dict[str, Any]) -> None:
        groups = metrics.get("reward/groups")
        if not groups:
            return
        self.steps += 1
        self.without += metrics.get("reward/zero_variance_groups") == groups
        if self.warned or self.steps < NO_GRADIENT_MIN_STEPS or 2 * self.without <= self.steps:
            return
        self.warned = True
        env = self.session.env
        self.session.warn(
            f"{self.without} of the first {self.steps} steps had no gradient (all rewards of every "
            "group equal, reward/zero_variance_groups = reward/groups: every advantage zero): env "
            f"backend '{env.backend if env is not None else '?'}' gives all samples of a prompt one "
            "reward; check that its reward reads the completion, or pick a task the model sometimes "
            "solves (grpo.dynamic_sampling drops such groups)"
        )


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

    Every refit is checked (:meth:`Session.check_refit`), as ``refit.check`` says (the
    module's docstring: ``on_check`` gets the records of checks that are not a step's line).

    Every step line times :data:`PHASES` (``timing/<phase>_time_s``), the whole step
    (``timing/step_time_s``) and ``timing/refit_check_share`` (refit check / step).

    A run where more than half of the steps so far (after :data:`NO_GRADIENT_MIN_STEPS`)
    had no gradient (every group of equal rewards) warns once (:meth:`Session.warn`),
    naming the env backend.

    With ``generation.on_worker_loss: replace``, a phase that loses a generation worker
    (rollout, refit, probe) is run again with the same request and seed once the session
    has put a new engine with the policy's current weights in place.
    """
    how = s.config.refit.check
    if how not in REFIT_CHECKS:
        raise ValueError(f"refit_check is {how!r}; expected one of {list(REFIT_CHECKS)}")
    sampled = how == "sampled"
    record = on_step or (lambda m: s.record(m, m["step"]))
    watch = _NoGradientWatch(s)

    def record_step(metrics: dict[str, Any]) -> None:
        record(metrics)
        watch.see(metrics)

    record_check = on_check or (lambda m: s.record(m, m["step"], step_done=False))
    history: list[dict[str, Any]] = []
    k = s.config.grpo.max_staleness
    try:
        if k > 0:
            _run_ahead(s, k, history, record_step)
            return history
        for step in range(s.first_step, s.config.grpo.steps + 1):
            if s.cancelled:
                break
            metrics, failure = _step(s, step, sampled, record_check)
            _done(history, record_step, metrics, failure)
            s.stop_if_preempted(step)
    except ProtocolError as err:
        # The guards name backend, role and method; the step is the loop's to say.
        raise ProtocolError(
            f"at step {len(history) + 1}: {err}", backend=err.backend, role=err.role, method=err.method
        ) from err
    if sampled and history and not s.cancelled:
        _check_last_refit(s, history[-1]["step"], record_check)
    return history


def _done(
    history: list[dict[str, Any]], record_step: Callable[[dict[str, Any]], None],
    metrics: dict[str, Any], failure: DivergenceError | None,
) -> None:
    """A step's line kept and recorded, then its failed check raised."""
    history.append(metrics)
    record_step(metrics)
    if failure is not None:
        raise failure


def _check_last_refit(s: Session, last: int, record_check: Callable[[dict[str, Any]], None]) -> None:
    """``refit.check: sampled``'s last refit: no rollout follows, so the probe batch checks
    it, once per run; its record goes to ``record_check`` before a failure is raised."""
    clock = _StepClock(last, s)
    check, failure = _probe_check(s, last, clock)
    record_check({
        "step": last, **check,
        "timing/handoff_time_s": clock.times["handoff"],
        "timing/refit_check_time_s": clock.times["refit_check"],
    })
    if failure is not None:
        raise failure


@dataclass
class _Samples:
    """One step's scored rollouts as the train step takes them."""

    rewards: list[list[float]]
    batch: list[Pair]
    advantages: list[float]
    logprobs: list[list[float]]  # the generation's, at temperature 1
    versions: list[list[int]] = field(default_factory=list)  # per token, where rollouts carry them
    failed: list[list[bool]] = field(default_factory=list)  # samples the env could not score


def _sample(s: Session, step: int, clock: _StepClock) -> _Samples:
    """The env's scored rollouts (the generation handed the devices first) and their
    group advantages; the policy has the devices back after."""
    with clock("handoff"):
        s.to_generation()
    with clock("generate"):
        groups = s.rollouts(step)
    s.record_samples(step, groups)
    with clock("reward"):
        rewards, failed = scored(groups)
        advantages = group_advantages(rewards, failed=failed)
    with clock("handoff"):
        s.to_policy()
    return _Samples(
        rewards=rewards,
        failed=failed,
        batch=[(r["prompt_ids"], r["token_ids"]) for g in groups for r in g],
        advantages=[a for g in advantages for a in g],
        logprobs=[r["logprobs"] for g in groups for r in g],
        versions=[r["versions"] for g in groups for r in g if "versions" in r],
    )


def _train_checked_by_samples(
    s: Session, step: int, clock: _StepClock, got: _Samples, record_check: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, float], float, dict[str, Any], dict[str, float]]:
    """``refit.check: sampled``: the refit of step - 1 checked with the samples' logprobs
    against the policy's, between the policy's logprobs and its train step (two train
    spans in the trace), so a failed check stops the step before it trains. Returns the
    train step's metrics, the generation-vs-policy error, the check's record and the
    step's mismatch figures (:meth:`Session.check_mismatch`, also before the train step)."""
    _wait_for_saves(s, clock)
    with clock("train"):
        old_lp = s.policy.logprobs(got.batch)
    check: dict[str, Any] = {"refit/check": "sampled", "refit/checked_step": step - 1}
    try:
        with clock("refit_check"):
            gen_vs_policy = s.check_refit(
                step - 1, generation_logprobs=got.logprobs, policy_logprobs=old_lp, sampled_by=step
            )
    except DivergenceError as failed:
        err = failed.mult_prob_error
        record_check({
            "step": step, **check, "refit/token_mult_prob_error": err,
            "train/gen_vs_policy_mult_prob_error": err, **clock.metrics(),
        })
        raise
    check["refit/token_mult_prob_error"] = gen_vs_policy
    mismatch = s.check_mismatch(step, got.logprobs, old_lp)
    with clock("train"):
        train = s.train(step, got.batch, got.advantages, old_lp, engine_logprobs=got.logprobs)
    return train, gen_vs_policy, check, mismatch


def _wait_for_saves(s: Session, clock: _StepClock) -> None:
    """Before the step's first policy call: a save of an earlier step still running is
    joined, and the wait is the step's ``checkpoint`` phase."""
    if s.checkpointing:
        with clock("checkpoint"):
            s.wait_checkpoint()


def _probe_check(s: Session, step: int, clock: _StepClock) -> tuple[dict[str, Any], DivergenceError | None]:
    """The refit of ``step`` checked with the probe batch (the generation handed the
    devices first): the check's record, and the failure to raise once it is written."""
    with clock("handoff"):
        s.to_generation()
    failure: DivergenceError | None = None
    try:
        with clock("refit_check"):
            err = s.check_refit(step)
    except DivergenceError as failed:
        err, failure = failed.mult_prob_error, failed
    return {"refit/check": "probe", "refit/checked_step": step, "refit/token_mult_prob_error": err}, failure


def _step(
    s: Session, step: int, sampled: bool, record_check: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, Any], DivergenceError | None]:
    """One GRPO step: its metrics line, and a failed probe check to raise once it is written."""
    t_step = time.monotonic()
    clock = _StepClock(step, s)
    got = _sample(s, step, clock)
    if sampled:
        train, gen_vs_policy, check, mismatch = _train_checked_by_samples(s, step, clock, got, record_check)
    else:
        _wait_for_saves(s, clock)
        with clock("train"):
            old_lp = s.policy.logprobs(got.batch)
            mismatch = s.check_mismatch(step, got.logprobs, old_lp)  # a stop comes before the step trains
            train = s.train(step, got.batch, got.advantages, old_lp, engine_logprobs=got.logprobs)
        gen_vs_policy = token_mult_prob_error(got.logprobs, old_lp)
    with clock("refit"):
        report = s.refit(step)
    failure: DivergenceError | None = None
    if not sampled:
        check, failure = _probe_check(s, step, clock)
    if failure is None and s.checkpointing:
        with clock("checkpoint"):
            s.checkpoint(step)
    metrics = {**_step_metrics(step, got, train, gen_vs_policy, report, check), **mismatch, **s.sampling_metrics(step)}
    _add_timing(metrics, clock, t_step, len(got.batch))
    return metrics, failure


def _add_timing(metrics: dict[str, Any], clock: _StepClock, t_step: float, samples: int) -> None:
    """The step's phase times, its wall time, the check's share of it and what the
    policy trained on per second of it."""
    step_time = time.monotonic() - t_step
    metrics.update(clock.metrics())
    metrics["timing/step_time_s"] = step_time
    metrics["timing/refit_check_share"] = clock.times["refit_check"] / step_time if step_time > 0 else 0.0
    metrics["train/samples"] = samples
    metrics["throughput/train_samples_per_s"] = samples / step_time if step_time > 0 else 0.0
    metrics["throughput/train_tokens_per_s"] = metrics["generate/tokens"] / step_time if step_time > 0 else 0.0


# ---------------------------------------------------------------- grpo.max_staleness >= 1


def _run_ahead(
    s: Session, k: int, history: list[dict[str, Any]], record_step: Callable[[dict[str, Any]], None]
) -> None:
    """The loop with rollouts generated up to ``k`` weight versions ahead of the train step
    (:meth:`Session.rollout_stream`): step t trains on what the producer made while earlier
    steps trained; after its refit is checked with the probe batch, step t + 1 + k may be
    generated."""
    with s.rollout_stream(k) as stream:
        for step in range(s.first_step, s.config.grpo.steps + 1):
            if s.cancelled:
                break
            metrics, failure = _step_ahead(s, step, k, stream)
            _done(history, record_step, metrics, failure)
            s.stop_if_preempted(step)
            stream.release(step)


def _sample_versions(groups: list[list[Rollout]], version: int) -> list[list[int]]:
    """Each rollout's token versions: its own (an engine that reports them), else
    ``version``, the weights' when the call began, for every token (a lower bound)."""
    return [list(r.get("versions") or [version] * len(r["token_ids"])) for g in groups for r in g]


def _fresh(got: StepRollouts, policy_version: int, k: int) -> tuple[list[list[Rollout]], list[int], int]:
    """The groups whose every sample is at most ``k`` versions behind the policy, the lag
    of each kept sample (policy version - its oldest token's), and how many groups were
    dropped. A group goes whole: its advantages are normalised within it."""
    kept: list[list[Rollout]] = []
    lags: list[int] = []
    for group in got.groups:
        group_lags = [policy_version - min(r.get("versions") or [got.version]) for r in group]
        if max(group_lags, default=0) <= k:
            kept.append(group)
            lags.extend(group_lags)
    return kept, lags, len(got.groups) - len(kept)


def _step_ahead(
    s: Session, step: int, k: int, stream: RolloutStream
) -> tuple[dict[str, Any], DivergenceError | None]:
    """One step of the loop that runs ahead: its metrics line, and a failed check to raise.

    The ratio of the clipped loss is against the sampling logprobs (the behaviour policy,
    up to ``k`` versions old), so no policy forward of the samples precedes the train step."""
    t_step = time.monotonic()
    clock = _StepClock(step, s)
    with clock("wait_for_rollouts"):
        got = stream.next(step)
        groups, lags, dropped = _fresh(got, step - 1, k)
        if not groups:  # only an env or engine that misreports versions gets here
            got = stream.regenerate(step)
            groups, lags, more = _fresh(got, step - 1, k)
            dropped += more
    s.now = f"step {step}"
    s.record_samples(step, groups, got.version)
    with clock("reward"):
        rewards, failed = scored(groups)
        advantages = [a for g in group_advantages(rewards, failed=failed) for a in g]
    batch: list[Pair] = [(r["prompt_ids"], r["token_ids"]) for g in groups for r in g]
    _wait_for_saves(s, clock)
    with clock("train"):
        sampled = [r["logprobs"] for g in groups for r in g]
        train = s.train(step, batch, advantages, sampled, engine_logprobs=sampled)
    with clock("refit"):
        report = s.refit(step)
    check, failure = _probe_check(s, step, clock)
    if failure is None and s.checkpointing:
        with clock("checkpoint"):
            s.checkpoint(step)
    versions = _sample_versions(groups, got.version)
    samples = _Samples(rewards=rewards, batch=batch, advantages=advantages, logprobs=[], versions=versions, failed=failed)
    metrics = _step_metrics(step, samples, train, None, report, check)
    _add_timing(metrics, clock, t_step, len(batch))
    metrics.update({
        "timing/generate_time_s": got.generate_s,  # the producer's call, beside earlier steps
        "staleness/max_staleness": k,
        "staleness/dropped_groups": dropped,
        "staleness/mixed_version_samples": sum(len(set(v)) > 1 for v in versions),
        "timing/producer_gated_s": stream.take_gated_s(),
        **s.sampling_metrics(step),
    })
    return metrics, failure


def run_grpo(
    *,
    cfg: GRPOConfig,
    on_step: Callable[[dict[str, Any]], None],
    max_mult_prob_error: float | None = None,
    refit_check: str = "probe",
    on_check: Callable[[dict[str, Any]], None] | None = None,
    trace: Callable[[str, float, float, int], None] | None = None,
    **handles: Any,
) -> list[dict[str, Any]]:
    """:func:`run_grpo_on` over handles started otherwise: ``handles`` are those of a
    :class:`Session` made over them (:class:`rlcore.app.session.OverHandles`: ``policy``,
    ``generation``, ``env``, ``tokenizer``, ``probe``, ``refit``, ``handoff``, ``cancelled``,
    ``on_generation_loss``): ``refit(step)`` copies the weights and returns a
    :class:`rlcore.handles.RefitReport`, ``on_generation_loss(error, step, phase)`` replaces
    a lost generation (:class:`rlcore.app.recovery.GenerationRecovery`). ``trace(name,
    start, end, step)`` records each phase. ``refit_check`` defaults to ``probe``, the
    loop's behaviour before ``sampled`` existed; ``on_check`` is called only when given."""
    if refit_check not in REFIT_CHECKS:
        raise ValueError(f"refit_check is {refit_check!r}; expected one of {list(REFIT_CHECKS)}")
    config = RunConfig(grpo=cfg, refit=RefitConfig(check=refit_check, max_mult_prob_error=max_mult_prob_error))
    session = Session(config=config, span=trace, **handles)
    return run_grpo_on(session, on_step=on_step, on_check=on_check or (lambda m: None))

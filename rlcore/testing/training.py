"""What the conformance suite asks of a policy's training: it learns, forgets nothing it
should, reports what it did and exports what it declares.

:class:`rlcore.testing.BackendConformance` runs :func:`check_learning_step`,
:func:`check_step_is_memoryless` and :func:`check_export` on a started policy handle
(through :class:`rlcore.handles.PolicyHandle` and :class:`rlcore.handles.RefitSender`
only), once per dtype the backend declares. Each failure is one
:class:`TrainingFailure` naming the rule, the backend and what was seen; the expected
values come from the contract's own formulas (:func:`grpo_loss`,
:func:`clip_fraction`) applied to the policy's own logprobs, so no second model is
needed.

Imports torch (:func:`check_export`) only when called.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.errors import RlcoreError

Pair = tuple[list[int], list[int]]

#: The batch a learning step is checked on: distinct prompts and completions, so each
#: row's gradient is mostly its own. Ids < 52 (rlcore's tiny tokenizer's vocabulary).
LEARN_BATCH: list[Pair] = [
    ([2, 5, 6], [7, 8, 9]),
    ([2, 11, 12], [13, 14]),
    ([2, 20, 21], [22, 23, 24]),
    ([2, 30, 31], [32, 33]),
]
#: One advantage per row of :data:`LEARN_BATCH` (both signs).
LEARN_ADVANTAGES: list[float] = [1.0, -1.0, 1.0, -1.0]
#: Another batch (uneven lengths, a zero advantage) for the checks at ``lr=0``.
PROBE_BATCH: list[Pair] = [
    ([2, 40, 41, 42], [43, 44, 45, 46]),
    ([2, 15], [16]),
    ([2, 25, 26], [27, 28]),
    ([2, 35], [36, 37, 38]),
]
PROBE_ADVANTAGES: list[float] = [0.8, -0.6, 0.0, -1.1]
#: A batch larger than any default micro-batch (37 rows: 32 + 5, 16 + 16 + 5, ...), rows of
#: 1 to 5 completion tokens, for the whole-batch check (:func:`check_whole_batch`).
WIDE_BATCH: list[Pair] = [
    ([2, 3 + i % 47, 3 + (7 * i) % 47], [3 + (5 * i + j) % 47 for j in range(1 + i % 5)]) for i in range(37)
]
WIDE_ADVANTAGES: list[float] = [((i % 7) - 3) / 3.0 for i in range(37)]
#: Old-logprob shifts that put some ratios far outside the clip range and some far inside.
OLD_SHIFTS: tuple[float, ...] = (-0.4, 0.05, 0.4)
#: The suite's clip range and learning rate of the learning step (large enough that a
#: step moves bfloat16 weights by more than their rounding).
CLIP_EPS = 0.2
LEARN_LR = 2e-3

#: Tolerances per dtype: (absolute on losses and logprob means, relative on grad norms).
TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-3),
    "bfloat16": (3e-2, 3e-2),
    "float16": (1e-2, 1e-2),
}
#: Metrics every train_step returns (:meth:`rlcore.handles.PolicyHandle.train_step`).
METRICS = ("loss", "grad_norm", "clip_fraction", "tokens", "lr")


class TrainingFailure(RlcoreError):
    """A policy broke a rule of training; the message names the rule and what was seen."""


@dataclass(frozen=True)
class StepMetrics:
    """A train_step's metrics, checked against the contract's keys and types."""

    loss: float
    grad_norm: float
    clip_fraction: float
    tokens: float
    lr: float

    @classmethod
    def of(cls, got: Any, who: str) -> StepMetrics:
        if not isinstance(got, dict):
            raise TrainingFailure(f"{who}: train_step() returned {type(got).__name__}, not a dict of metrics")
        missing = [k for k in METRICS if k not in got]
        if missing:
            raise TrainingFailure(
                f"{who}: train_step() metrics lack {missing} (the contract's metrics are "
                f"{list(METRICS)}; rlcore.handles.PolicyHandle.train_step)"
            )
        values = {}
        for k in METRICS:
            try:
                values[k] = float(got[k])
            except (TypeError, ValueError):
                raise TrainingFailure(f"{who}: train_step() metric {k!r} is {got[k]!r}, not a float") from None
        return cls(**values)


def grpo_loss(
    logprobs: Sequence[Sequence[float]],
    old: Sequence[Sequence[float]],
    advantages: Sequence[float],
    clip_eps: float = CLIP_EPS,
) -> float:
    """The contract's loss: ``-mean`` over every token of ``min(r * A, clip(r) * A)``."""
    terms = []
    for row, old_row, a in zip(logprobs, old, advantages, strict=True):
        for lp, o in zip(row, old_row, strict=True):
            r = math.exp(lp - o)
            terms.append(min(r * a, min(max(r, 1 - clip_eps), 1 + clip_eps) * a))
    return -sum(terms) / max(len(terms), 1)


def clip_fraction(
    logprobs: Sequence[Sequence[float]], old: Sequence[Sequence[float]], clip_eps: float = CLIP_EPS
) -> float:
    """Share of tokens whose ratio ``exp(logprob - old)`` left ``[1 - eps, 1 + eps]``."""
    ratios = [math.exp(lp - o) for row, o_row in zip(logprobs, old, strict=True) for lp, o in zip(row, o_row, strict=True)]
    return sum(abs(r - 1) > clip_eps for r in ratios) / max(len(ratios), 1)


def shifted(logprobs: Sequence[Sequence[float]]) -> list[list[float]]:
    """``logprobs`` shifted by :data:`OLD_SHIFTS` in turn (old logprobs of a stale policy)."""
    return [
        [lp + OLD_SHIFTS[(i + j) % len(OLD_SHIFTS)] for j, lp in enumerate(row)]
        for i, row in enumerate(logprobs)
    ]


def _step(policy: Any, who: str, batch: list[Pair], adv: Sequence[float], old: Any, lr: float) -> StepMetrics:
    got = policy.train_step(
        [(list(p), list(c)) for p, c in batch], list(adv), old, clip_eps=CLIP_EPS, lr=lr
    )
    m = StepMetrics.of(got, who)
    for k in ("loss", "grad_norm"):
        if not math.isfinite(getattr(m, k)):
            raise TrainingFailure(f"{who}: train_step() reported {k}={getattr(m, k)} on a finite batch")
    return m


def _logprobs(policy: Any, batch: list[Pair]) -> list[list[float]]:
    return [list(map(float, row)) for row in policy.logprobs([(list(p), list(c)) for p, c in batch])]


def _tokens(batch: list[Pair]) -> int:
    return sum(len(c) for _, c in batch)


def check_metrics(
    m: StepMetrics, who: str, *, loss: float, clip: float, tokens: int, lr: float, dtype: str, what: str
) -> None:
    """The reported metrics of one step are those of the step that was asked for."""
    atol, _ = TOLERANCE[dtype]
    if abs(m.loss - loss) > atol + 1e-3 * abs(loss):
        raise TrainingFailure(
            f"{who}: {what}: train_step() reported loss {m.loss:.6f}, but the contract's loss of "
            f"that batch at the weights before the step is {loss:.6f} (from the policy's own "
            "logprobs): the step optimises something else, or its sign or normalisation differs"
        )
    if m.tokens != tokens:
        raise TrainingFailure(f"{who}: {what}: train_step() reported tokens={m.tokens:g}; the batch has {tokens} completion tokens")
    if m.lr != lr:
        raise TrainingFailure(f"{who}: {what}: train_step() reported lr={m.lr:g}; the step was asked for lr={lr:g}")
    if abs(m.clip_fraction - clip) > 1e-6:
        raise TrainingFailure(
            f"{who}: {what}: train_step() reported clip_fraction={m.clip_fraction:.4f}; "
            f"{clip:.4f} of the tokens have a ratio outside [1 - clip_eps, 1 + clip_eps]"
        )


def check_learning_step(policy: Any, who: str, dtype: str) -> None:
    """One step on :data:`LEARN_BATCH` at :data:`LEARN_LR` (old logprobs = the current ones)
    reports what it did, raises each completion's mean logprob where its advantage is
    positive and lowers it where negative, and lowers the contract's loss on that batch."""
    atol, _ = TOLERANCE[dtype]
    before = _logprobs(policy, LEARN_BATCH)
    loss0 = grpo_loss(before, before, LEARN_ADVANTAGES)
    m = _step(policy, who, LEARN_BATCH, LEARN_ADVANTAGES, before, LEARN_LR)
    check_metrics(m, who, loss=loss0, clip=0.0, tokens=_tokens(LEARN_BATCH), lr=LEARN_LR, dtype=dtype,
                  what=f"a step at lr={LEARN_LR:g}")
    if not m.grad_norm > 0:
        raise TrainingFailure(f"{who}: a step on advantages {LEARN_ADVANTAGES} reported grad_norm={m.grad_norm}")
    after = _logprobs(policy, LEARN_BATCH)
    wrong = []
    for i, (a, b, adv) in enumerate(zip(after, before, LEARN_ADVANTAGES, strict=True)):
        moved = sum(a) / len(a) - sum(b) / len(b)
        if moved * adv <= 0 or abs(moved) <= atol:
            wrong.append(f"row {i} (advantage {adv:+g}) moved {moved:+.5f}")
    if wrong:
        raise TrainingFailure(
            f"{who}: a train step must move each completion's logprob in the direction of its "
            f"advantage (lr={LEARN_LR:g}, dtype {dtype}): {'; '.join(wrong)}. Is the loss's sign "
            "flipped, or are the gradients or the learning rate not applied?"
        )
    loss1 = grpo_loss(after, before, LEARN_ADVANTAGES)
    if not loss1 < loss0 - atol:
        raise TrainingFailure(
            f"{who}: a train step did not lower the loss on its own batch: {loss0:.5f} before, "
            f"{loss1:.5f} after (the contract's loss from the policy's logprobs, dtype {dtype})"
        )


def check_whole_batch(policy: Any, who: str, dtype: str, reference: Any) -> None:
    """At ``lr=0`` and the checkpoint's weights, a batch of 37 rows (more than a default
    micro-batch, and no multiple of one) gives the loss and gradient norm of the whole batch
    as one: what ``reference`` (the suite's single-process policy on the same checkpoint)
    reports. A policy that sums its micro-batches' losses, drops the rows left over after
    the last whole micro-batch, or weighs micro-batches by row instead of by token fails."""
    atol, rtol = TOLERANCE[dtype]
    want = reference.train_step(WIDE_BATCH, WIDE_ADVANTAGES, None, CLIP_EPS, 0.0)
    got = _step(policy, who, WIDE_BATCH, WIDE_ADVANTAGES, None, 0.0)
    off = abs(got.grad_norm - want["grad_norm"]) > rtol * want["grad_norm"] + 1e-7
    # (The reported token count is check_metrics's: its message names that rule.)
    if off or abs(got.loss - want["loss"]) > atol + 1e-3 * abs(want["loss"]):
        raise TrainingFailure(
            f"{who}: a step at lr=0 on a batch of {len(WIDE_BATCH)} rows ({_tokens(WIDE_BATCH)} completion "
            f"tokens) reported loss {got.loss:.6f}, grad_norm {got.grad_norm:.6f}; the "
            f"whole batch taken as one gives loss {want['loss']:.6f}, grad_norm {want['grad_norm']:.6f} "
            f"(dtype {dtype}): are micro-batch losses summed instead of averaged over the batch's tokens, "
            "or rows after the last whole micro-batch dropped?"
        )


def check_step_is_memoryless(policy: Any, who: str, dtype: str) -> None:
    """At ``lr=0`` the weights stay, and from the same weights one batch gives the same
    loss and gradient whatever steps came before (gradients are not carried over); the
    gradient norm scales with the advantages (0 for zero advantages, twice for twice);
    ``clip_fraction`` and ``loss`` with stale old logprobs are the contract's."""
    atol, rtol = TOLERANCE[dtype]
    n = _tokens(PROBE_BATCH)
    first = _step(policy, who, PROBE_BATCH, PROBE_ADVANTAGES, None, 0.0)
    held = _logprobs(policy, LEARN_BATCH)
    on_policy = -sum(a * len(c) for (_, c), a in zip(PROBE_BATCH, PROBE_ADVANTAGES, strict=True)) / n
    check_metrics(first, who, loss=on_policy, clip=0.0, tokens=n, lr=0.0, dtype=dtype,
                  what="an on-policy step at lr=0")
    _step(policy, who, LEARN_BATCH, [-3.0 * a for a in LEARN_ADVANTAGES], None, 0.0)
    again = _step(policy, who, PROBE_BATCH, PROBE_ADVANTAGES, None, 0.0)
    moved = max(abs(x - y) for r, s in zip(_logprobs(policy, LEARN_BATCH), held, strict=True) for x, y in zip(r, s, strict=True))
    if moved > atol:
        raise TrainingFailure(
            f"{who}: steps at lr=0 changed the weights (logprobs moved by up to {moved:.2e}): "
            "train_step must use the lr it is given"
        )
    if abs(again.grad_norm - first.grad_norm) > rtol * first.grad_norm + 1e-7:
        raise TrainingFailure(
            f"{who}: the same batch at the same weights gave grad_norm {first.grad_norm:.6f}, then "
            f"{again.grad_norm:.6f} after another step: gradients of an earlier step carried over "
            "(zero them before each step's backward)"
        )
    doubled = _step(policy, who, PROBE_BATCH, [2 * a for a in PROBE_ADVANTAGES], None, 0.0)
    zero = _step(policy, who, PROBE_BATCH, [0.0] * len(PROBE_BATCH), None, 0.0)
    if abs(doubled.grad_norm - 2 * first.grad_norm) > 2 * rtol * first.grad_norm + 1e-7 or abs(zero.grad_norm) > 1e-6:
        raise TrainingFailure(
            f"{who}: grad_norm must be that of the step's gradient, before clipping: advantages x1 "
            f"gave {first.grad_norm:.6f}, x2 {doubled.grad_norm:.6f} (want twice), x0 "
            f"{zero.grad_norm:.6f} (want 0)"
        )
    current = _logprobs(policy, PROBE_BATCH)
    old = shifted(current)
    stale = _step(policy, who, PROBE_BATCH, PROBE_ADVANTAGES, old, 0.0)
    check_metrics(stale, who, loss=grpo_loss(current, old, PROBE_ADVANTAGES), clip=clip_fraction(current, old),
                  tokens=n, lr=0.0, dtype=dtype, what="a step with stale old logprobs at lr=0")


def check_checkpoint_round_trip(policy: Any, who: str, directory: Path, capture: Any = None) -> None:
    """:class:`rlcore.handles.Checkpointable`: after ``load_checkpoint`` of what
    ``save_checkpoint`` wrote, the next steps give exactly what they gave right after the
    save (weights, optimizer moments and step count all came back), and a save changes
    nothing of the state. Takes one learning step first, so the optimizer has state. With
    ``capture`` (what the policy's refit sends, by name), the first export after the load is
    the loaded weights, not those of before it (a refit after a resume, ``rlcore export``)."""
    _step(policy, who, LEARN_BATCH, LEARN_ADVANTAGES, None, LEARN_LR)
    saved, again = directory / "saved", directory / "again"
    saved.mkdir()
    again.mkdir()
    policy.save_checkpoint(str(saved))
    if not any(saved.iterdir()):
        raise TrainingFailure(f"{who}: save_checkpoint() wrote nothing into {saved}")
    exported = capture() if capture is not None else None
    at_save = _logprobs(policy, PROBE_BATCH)
    before = [_step(policy, who, LEARN_BATCH, LEARN_ADVANTAGES, None, LEARN_LR) for _ in range(2)]
    after_steps = _logprobs(policy, PROBE_BATCH)
    if capture is not None:
        capture()  # an export of the weights after the steps: a stale one must not be reused
    policy.load_checkpoint(str(saved))
    if exported is not None:
        first = capture()
        if _logprobs(policy, PROBE_BATCH) != at_save:
            raise TrainingFailure(
                f"{who}: after load_checkpoint the policy's logprobs are not those at the save: the "
                "weights did not come back"
            )
        _check_export_after_load(who, exported, first)
    policy.save_checkpoint(str(again))  # must leave the state as it is
    replay = [_step(policy, who, LEARN_BATCH, LEARN_ADVANTAGES, None, LEARN_LR) for _ in range(2)]
    for i, (want, got) in enumerate(zip(before, replay, strict=True)):
        if (got.loss, got.grad_norm) != (want.loss, want.grad_norm):
            raise TrainingFailure(
                f"{who}: step {i + 1} after load_checkpoint gave loss {got.loss!r}, grad_norm "
                f"{got.grad_norm!r}; right after the save it gave {want.loss!r}, {want.grad_norm!r}: "
                + ("the weights did not come back" if i == 0 else
                   "the optimizer state (moments, step count) did not come back")
                + " exactly, or save_checkpoint changed the state"
            )
    moved = max(abs(x - y) for r, q in zip(_logprobs(policy, PROBE_BATCH), after_steps, strict=True)
                for x, y in zip(r, q, strict=True))
    if moved != 0.0:
        raise TrainingFailure(
            f"{who}: after load_checkpoint and the same two steps, logprobs differ by up to {moved:.2e} "
            "from the run that never stopped"
        )


def _check_export_after_load(who: str, saved: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """The export right after ``load_checkpoint`` is what the policy exported at the save."""
    import torch

    stale = sorted(n for n in saved if n not in loaded or not torch.equal(saved[n], loaded[n]))
    if stale or set(loaded) != set(saved):
        raise TrainingFailure(
            f"{who}: the first export after load_checkpoint is not the loaded weights: "
            f"{len(stale)} of {len(saved)} differ from the export at the save (e.g. {stale[:3]}); "
            "an export cached from before the load (a refit after a resume, rlcore export) would "
            "send the wrong model"
        )


def check_staged_checkpoint(policy: Any, who: str, directory: Path, *, timeout_s: float = 300.0) -> None:
    """:class:`rlcore.handles.StagedCheckpointable`: what ``stage_checkpoint`` starts writing
    is the state at that call, though the policy trains on at once; ``checkpoint_written``
    returns at once and says True once it is all written; loading it, the next steps give
    exactly what they gave right after the staging."""
    import time

    _step(policy, who, LEARN_BATCH, LEARN_ADVANTAGES, None, LEARN_LR)
    staged = directory / "staged"
    staged.mkdir()
    figures = policy.stage_checkpoint(str(staged))
    if not isinstance(figures, Mapping) or not all(isinstance(v, (int, float)) for v in figures.values()):
        raise TrainingFailure(f"{who}: stage_checkpoint() must return a mapping of figures, got {figures!r}")
    before = [_step(policy, who, LEARN_BATCH, LEARN_ADVANTAGES, None, LEARN_LR) for _ in range(2)]
    after_steps = _logprobs(policy, PROBE_BATCH)
    deadline = time.monotonic() + timeout_s
    while True:
        t0 = time.monotonic()
        done = policy.checkpoint_written()
        if time.monotonic() - t0 > 60.0:  # generous: the point is no wait for the write
            raise TrainingFailure(f"{who}: checkpoint_written() took {time.monotonic() - t0:.0f}s; it must return at once")
        if done:
            break
        if time.monotonic() > deadline:
            raise TrainingFailure(f"{who}: the staged save into {staged} was not written within {timeout_s:g}s")
        time.sleep(0.05)
    if not any(staged.iterdir()):
        raise TrainingFailure(f"{who}: the staged save wrote nothing into {staged}")
    policy.load_checkpoint(str(staged))
    replay = [_step(policy, who, LEARN_BATCH, LEARN_ADVANTAGES, None, LEARN_LR) for _ in range(2)]
    if [(r.loss, r.grad_norm) for r in replay] != [(b.loss, b.grad_norm) for b in before]:
        raise TrainingFailure(
            f"{who}: after loading the staged save, two steps gave {[(r.loss, r.grad_norm) for r in replay]}; "
            f"right after stage_checkpoint they gave {[(b.loss, b.grad_norm) for b in before]}: what was written "
            "is not the state at stage_checkpoint (the steps after it changed what the background write read?)"
        )
    if _logprobs(policy, PROBE_BATCH) != after_steps:
        raise TrainingFailure(f"{who}: after loading the staged save and the same two steps, logprobs differ")


def check_export(
    received: dict[str, Any], specs: Sequence[Any], expected: Sequence[Any], who: str, dtype: str
) -> None:
    """What the policy sent over a refit is what it declares: every weight of the
    checkpoint's Hugging Face state dict (``expected``, in ``dtype``) under its name, with
    its shape, in ``dtype``; and the sender's ``weight_specs()`` say the same."""
    want = {s.name: (tuple(s.shape), s.dtype) for s in expected}
    said = {s.name: (tuple(s.shape), s.dtype) for s in specs}
    got = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in received.items()}
    for label, seen in (("weight_specs()", said), ("the sent tensors", got)):
        missing = sorted(set(want) - set(seen))
        extra = sorted(set(seen) - set(want))
        off = sorted(n for n in set(want) & set(seen) if seen[n] != want[n])
        if missing or extra or off:
            detail = [f"missing {missing[:4]}" if missing else "", f"unexpected {extra[:4]}" if extra else ""]
            detail += [f"'{n}' is {seen[n][0]} {seen[n][1]}, want {want[n][0]} {want[n][1]}" for n in off[:4]]
            raise TrainingFailure(
                f"{who}: in model.dtype={dtype}, {label} must be the checkpoint's Hugging Face "
                f"weights in {dtype}: {'; '.join(d for d in detail if d)}"
            )


#: Weights ``target_modules: [all-linear]`` never adapts: embeddings and norms.
_NEVER_ADAPTED = ("embed_tokens.weight", "norm.weight")


def check_adapters(
    policy: Any, who: str, capture: Any, base: Mapping[str, Any], reference: Any, *, rank: int
) -> None:
    """A policy that trains adapters (``trains_adapters``, ``policy.options.lora`` with
    ``rank`` on every linear layer, contract 2.4) exports merged weights under the base
    names: before any step that is the base model itself (``B`` starts at zero); a
    learning step moves adapted weights only (embeddings and norms stay); and the merged
    export computes what the policy computes (``reference(state)``: a plain model's logprobs
    of :data:`PROBE_BATCH` with ``state`` loaded). ``capture()`` is one refit's tensors."""
    import torch

    first = capture()
    if sorted(first) != sorted(base):
        extra, missing = sorted(set(first) - set(base)), sorted(set(base) - set(first))
        raise TrainingFailure(
            f"{who}: with policy.options.lora (rank {rank}) the refit must carry the base model's weights "
            f"under their names, merged; unexpected {extra[:4]}, missing {missing[:4]}"
        )
    off = [n for n in base if not torch.equal(first[n].cpu().to(base[n].dtype), base[n])]
    if off:
        raise TrainingFailure(
            f"{who}: before any step the merged weights must be the base model's (the adapters' B starts "
            f"at zero); {off[:4]} differ"
        )
    _step(policy, who, LEARN_BATCH, LEARN_ADVANTAGES, None, 0.05)
    after = capture()
    moved = sorted(n for n in base if not torch.equal(after[n].cpu().to(base[n].dtype), base[n]))
    if not moved:
        raise TrainingFailure(f"{who}: a learning step with adapters changed no exported weight")
    frozen = [n for n in moved if n.endswith(_NEVER_ADAPTED)]
    if frozen:
        raise TrainingFailure(
            f"{who}: with adapters only, a step moved {frozen[:4]}, which target_modules=[all-linear] "
            "never adapts: the base weights must stay frozen"
        )
    want = reference(after)
    got = _logprobs(policy, PROBE_BATCH)
    worst = max(abs(x - y) for r, q in zip(got, want, strict=True) for x, y in zip(r, q, strict=True))
    if worst > TOLERANCE["float32"][0]:
        raise TrainingFailure(
            f"{who}: a plain model holding the merged export gives logprobs up to {worst:.2e} away from "
            "the policy's: the export must be base + (alpha / rank) * B @ A of every adapted weight"
        )


def shaped_loss(
    logprobs: Sequence[Sequence[float]],
    old: Sequence[Sequence[float]],
    advantages: Sequence[float],
    shape: Any,
    clip_eps: float = CLIP_EPS,
) -> tuple[float, float]:
    """The contract's loss and clip fraction under :class:`rlcore.handles.LossOptions`
    ``shape`` (contract 2.5), one token at a time: the upper clip ``1 + clip_eps_high``,
    each term times the correction's weight, the aggregation over rows."""
    high = clip_eps if shape.clip_eps_high is None else shape.clip_eps_high
    engine = shape.engine_logprobs or [None] * len(logprobs)
    per_row: list[list[float]] = []
    clipped = tokens = 0
    for row, old_row, e_row, a in zip(logprobs, old, engine, advantages, strict=True):
        terms = []
        for j, (lp, o) in enumerate(zip(row, old_row, strict=True)):
            r = math.exp(lp - o)
            term = min(r * a, min(max(r, 1 - clip_eps), 1 + high) * a)
            if shape.correction != "none":
                rho = math.exp(o - e_row[j])
                term *= min(rho, shape.cap) if shape.correction == "tis" else (rho if rho <= shape.cap else 0.0)
            terms.append(term)
            clipped += r < 1 - clip_eps or r > 1 + high
        tokens += len(terms)
        per_row.append(terms)
    if shape.aggregation == "seq_mean_token_mean":
        loss = -sum(sum(t) / len(t) for t in per_row if t) / len(per_row)
    elif shape.aggregation == "seq_mean_token_sum_norm":
        loss = -sum(sum(t) / shape.norm_tokens for t in per_row) / len(per_row)
    else:
        loss = -sum(sum(t) for t in per_row) / max(tokens, 1)
    return loss, clipped / max(tokens, 1)


def loss_option_cases(features: frozenset[str], logprobs: Sequence[Sequence[float]]) -> dict[str, Any]:
    """One :class:`rlcore.handles.LossOptions` per declared feature and value, the sampling
    logprobs of a correction off the policy's by -0.25/+0.25 in turn."""
    from rlcore.handles import LossOptions

    engine = [[x + (0.25 if (i + j) % 2 else -0.25) for j, x in enumerate(r)] for i, r in enumerate(logprobs)]
    cases: dict[str, Any] = {}
    if "clip_eps_high" in features:
        cases["clip_eps_high=0.4"] = LossOptions(clip_eps_high=0.4)
    if "aggregation" in features:
        cases["seq_mean_token_mean"] = LossOptions(aggregation="seq_mean_token_mean")
        cases["seq_mean_token_sum_norm"] = LossOptions(aggregation="seq_mean_token_sum_norm", norm_tokens=6)
    if "correction" in features:
        for kind in ("tis", "mis"):
            cases[kind] = LossOptions(correction=kind, cap=1.1, engine_logprobs=engine)
    return cases


def check_loss_options(policy: Any, who: str, features: frozenset[str], dtype: str = "float32") -> None:
    """Each feature a policy declares in ``loss_options`` (contract 2.5), at ``lr=0`` on
    :data:`PROBE_BATCH` with stale old logprobs: the reported ``loss`` and ``clip_fraction``
    are :func:`shaped_loss` of its own logprobs, and differ from the plain loss's where the
    feature changes anything (a policy that ignored ``loss=`` fails)."""
    atol, _ = TOLERANCE[dtype]
    current = _logprobs(policy, PROBE_BATCH)
    old = shifted(current)
    batch = [(list(p), list(c)) for p, c in PROBE_BATCH]
    for name, shape in loss_option_cases(features, current).items():
        got = policy.train_step(batch, list(PROBE_ADVANTAGES), old, clip_eps=CLIP_EPS, lr=0.0, loss=shape)
        m = StepMetrics.of(got, who)
        want, clip = shaped_loss(current, old, PROBE_ADVANTAGES, shape)
        if abs(m.loss - want) > atol or abs(m.clip_fraction - clip) > 1e-9:
            plain = grpo_loss(current, old, PROBE_ADVANTAGES)
            raise TrainingFailure(
                f"{who}: train_step(loss=LossOptions({name})) at lr=0 reported loss {m.loss:.6f}, clip_fraction "
                f"{m.clip_fraction:.3f}; the contract's formula gives {want:.6f}, {clip:.3f} (the plain loss: "
                f"{plain:.6f}): apply each feature it declares in loss_options as rlcore.handles.LossOptions says"
            )

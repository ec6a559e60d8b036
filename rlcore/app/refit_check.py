"""The refit check: do the generation and the policy compute with the same weights?

After every refit the generation's logprobs of some tokens are compared with the policy's
of the same tokens (:func:`token_mult_prob_error`, 1.0 when identical). Above
``refit.max_mult_prob_error`` the engine is not computing with the weights the policy
trains, and :func:`check_divergence` stops the run. The tokens are either a step's own
samples (``refit.check: sampled``) or the fixed :func:`probe_batch` (``probe``).
Pure Python on plain lists: nothing here imports torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from rlcore.errors import DivergenceError
from rlcore.handles import Pair

__all__ = ["PROBE_TEXTS", "check_divergence", "probe_batch", "token_mult_prob_error"]

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


def token_mult_prob_error(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """exp of the mean absolute per-token logprob difference (1.0 = identical)."""
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    if not diffs:
        raise ValueError("token_mult_prob_error of an empty batch")
    return math.exp(statistics.fmean(diffs))


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
            "the metrics were written. Set refit.max_mult_prob_error=null to run on regardless.",
            mult_prob_error=err,
            step=step,
        )

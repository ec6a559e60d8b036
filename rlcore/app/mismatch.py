"""How far the generation's token probabilities are from the policy's on a step's own samples
(issue 46 item 4): the sampler/trainer mismatch the field's RL frameworks watch, and a guard.

Every synchronous step computes the policy's logprobs of the tokens the generation sampled
(``old_lp``, before its train step) beside the generation's own (``gen_lp``, returned with the
rollouts at temperature 1). Per token, ``w = p_policy / p_generation = exp(old_lp - gen_lp)`` is
the importance weight that would correct the samples to the policy, and ``(w - 1) - log w`` is
the "k3" estimate of KL(generation || policy) (non-negative per token, unbiased for samples
drawn from the generation; Schulman, "Approximating KL Divergence", 2020). Their token means
and extremes go into each step's metrics (``mismatch/*``). ``grpo.max_mismatch`` bounds the KL
estimate: above it ``grpo.on_mismatch`` warns (the step trains) or stops the run before the
step trains, naming the step, both backends and the figures.

The refit check (:mod:`rlcore.app.refit_check`) asks whether a refit landed; this asks whether
the two engines compute the same distribution on the samples trained on (kernels, precision,
a sampler that is not what it says): in a healthy run both are near their floor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlcore.config import MISMATCH_ACTIONS
from rlcore.errors import MismatchError


def mismatch_stats(generation_logprobs: Sequence[Sequence[float]], policy_logprobs: Sequence[Sequence[float]]) -> dict[str, float]:
    """The mismatch figures of a batch (module doc): ``mismatch/kl`` (token mean of the k3
    estimate), ``mismatch/is_weight_mean``, ``_min``, ``_max`` and ``mismatch/tokens``."""
    weights, kl = [], 0.0
    for gen_row, pol_row in zip(generation_logprobs, policy_logprobs, strict=True):
        for g, p in zip(gen_row, pol_row, strict=True):
            log_w = float(p) - float(g)
            weights.append(math.exp(log_w))
            kl += math.expm1(log_w) - log_w  # (w - 1) - log w, exact near w = 1
    if not weights:
        raise ValueError("mismatch_stats of an empty batch")
    return {
        "mismatch/kl": kl / len(weights),
        "mismatch/is_weight_mean": sum(weights) / len(weights),
        "mismatch/is_weight_min": min(weights),
        "mismatch/is_weight_max": max(weights),
        "mismatch/tokens": float(len(weights)),
    }


def check_mismatch(
    stats: dict[str, float], limit: float | None, action: str, *, step: int, policy: str, generation: str
) -> str | None:
    """Apply ``grpo.max_mismatch``: None when within it (or unset); else the warning's line
    (``action`` warn) or :class:`~rlcore.errors.MismatchError` (``action`` stop)."""
    kl = stats["mismatch/kl"]
    if limit is None or kl <= limit:
        return None
    line = (
        f"step {step}: generation '{generation}' and policy '{policy}' disagree on the step's own samples: "
        f"KL estimate {kl:.4g} > grpo.max_mismatch {limit:g} (importance weights "
        f"{stats['mismatch/is_weight_min']:.3g}..{stats['mismatch/is_weight_max']:.3g}, mean "
        f"{stats['mismatch/is_weight_mean']:.3g}, over {int(stats['mismatch/tokens'])} tokens)"
    )
    if action == "stop":
        raise MismatchError(
            f"{line}; the step was not trained. The engines compute different distributions for the same "
            "weights (kernels, precision, sampling settings); grpo.on_mismatch=warn trains on regardless",
            kl=kl, step=step,
        )
    return line


__all__ = ["MISMATCH_ACTIONS", "check_mismatch", "mismatch_stats"]

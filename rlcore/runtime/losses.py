"""The policy-gradient loss both policy backends train with (torch, imported lazily).

GRPO's clipped objective per completion token: ``min(ratio * A, clip(ratio, 1 - eps,
1 + eps) * A)`` with ``ratio = exp(logprob - old_logprob)`` and ``A`` the row's
advantage. A row without old logprobs is on-policy (ratio 1: the REINFORCE gradient).
:func:`rlcore.testing.reference.reference_grpo_step` is the single-process reference
the backends' tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def clipped_pg_loss(
    token_lp: Any,
    mask: Any,
    spans: Sequence[tuple[int, int]],
    advantages: Sequence[float],
    old_rows: Sequence[Sequence[float] | None],
    clip_eps: float,
    *,
    adv_dtype: Any = None,
) -> tuple[Any, Any]:
    """Per-token loss (``-objective``, zero where ``mask`` is false) and the number of
    masked tokens whose ratio left the clip range.

    Args:
        token_lp: ``[rows, T]`` logprobs of the completion tokens under the current weights.
        mask: ``[rows, T]`` bool, true at completion tokens.
        spans: per row, the ``[start, end)`` columns of its completion in ``token_lp``.
        advantages: one per row.
        old_rows: per row, the logprobs before the step (``None``: on-policy).
        clip_eps: the ratio's clip range.
        adv_dtype: dtype of the advantages (default: ``token_lp``'s).
    """
    import torch

    adv = torch.tensor(
        [[float(a)] for a in advantages], dtype=adv_dtype or token_lp.dtype, device=token_lp.device
    )
    old = token_lp.detach().clone()
    for i, row in enumerate(old_rows):
        if row is not None:
            start, end = spans[i]
            old[i, start:end] = torch.tensor(row, dtype=old.dtype, device=old.device)
    ratio = torch.exp(torch.where(mask, token_lp - old, torch.zeros_like(token_lp)))
    objective = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    clipped = (((ratio.detach() - 1).abs() > clip_eps) & mask).sum()
    return -objective * mask, clipped

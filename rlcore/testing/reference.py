"""Single-process Hugging Face references for a policy backend's tests.

A distributed policy (FSDP shards, tensor-parallel ranks) must compute what one
process computes with transformers: the same completion logprobs and the same
GRPO step. These are those computations, written plainly (one row at a time,
no padding), for plugin tests to compare against::

    from rlcore.testing.reference import GRPO_BATCH, hf_model, reference_grpo_step

Imports torch and transformers when called, not at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.handles import LossOptions

#: Rows (prompt ids, completion ids): uneven lengths (right padding), an empty
#: completion, a one-token prompt. Ids < 52 (rlcore's tiny tokenizer's vocabulary).
GRPO_BATCH: list[tuple[list[int], list[int]]] = [
    ([2, 5, 6], [7, 8, 9, 10]),
    ([2, 11], [12]),
    ([2, 3, 4, 5, 6, 7], [8, 9]),
    ([2], []),
    ([2, 30, 31], [32, 33, 34]),
]
#: One advantage per row of :data:`GRPO_BATCH` (signs and a zero).
GRPO_ADVANTAGES: list[float] = [1.0, -0.5, 0.7, 0.0, -1.2]


def hf_model(model_dir: str | Path, state: dict | None = None) -> Any:
    """The checkpoint as a float32 transformers model in eval mode (``state`` loaded over it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def reference_logprobs(model: Any, batch: list) -> list[list[float]]:
    """Logprob of each completion token given everything before it, one row at a time
    (:func:`rlcore.runtime.losses.model_logprobs`)."""
    from rlcore.runtime.losses import model_logprobs

    return model_logprobs(model, batch)


def perturbed_old(logprobs: list[list[float]]) -> list[list[float]]:
    """Old logprobs off by -0.3, +0.05 or +0.3: some ratios leave the clip range, some not."""
    shifts = (-0.3, 0.05, 0.3)
    return [
        [lp + shifts[(i + j) % 3] for j, lp in enumerate(row)] for i, row in enumerate(logprobs)
    ]


def reference_grpo_step(
    model: Any,
    batch: list,
    advantages: list[float],
    old: list[list[float]],
    *,
    lr: float,
    clip_eps: float = 0.2,
    max_grad_norm: float = 1.0,
    loss: LossOptions | None = None,
) -> dict[str, Any]:
    """One GRPO step: ``-mean`` over every completion token of the batch of
    ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``, global grad-norm clipping,
    AdamW (no weight decay). Returns the metrics of the ``train_step`` contract
    (``loss``, ``grad_norm`` before clipping, ``clip_fraction``: tokens whose ratio left
    ``[1 - eps, 1 + eps]``, ``tokens``, ``lr``) and the new ``state``.

    ``loss`` (:class:`rlcore.handles.LossOptions`), written from the papers' formulas one
    sample at a time: the upper clip ``1 + clip_eps_high`` (DAPO); each token's term times
    ``min(rho, cap)`` (tis) or ``rho if rho <= cap else 0`` (mis), ``rho = exp(old -
    engine)``; the mean over samples of each sample's token mean (seq_mean_token_mean) or
    token sum over ``norm_tokens`` (seq_mean_token_sum_norm, Dr. GRPO)."""
    import torch

    shape = loss or LossOptions()
    high = clip_eps if shape.clip_eps_high is None else shape.clip_eps_high
    engine = shape.engine_logprobs or [None] * len(batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    terms, clipped = [], 0
    for (p, c), a, o, e in zip(batch, advantages, old, engine, strict=True):
        if not c:
            continue
        logp = model(input_ids=torch.tensor([p + c])).logits[0, :-1].float().log_softmax(-1)
        lp = logp[len(p) - 1 : len(p) - 1 + len(c)].gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        ratio = torch.exp(lp - torch.tensor(o))
        term = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + high) * a)
        if shape.correction != "none":
            rho = torch.exp(torch.tensor(o) - torch.tensor(e))
            cap = torch.tensor(shape.cap)
            term = term * (torch.minimum(rho, cap) if shape.correction == "tis" else torch.where(rho <= cap, rho, 0.0))
        terms.append(term)
        clipped += int(((ratio < 1 - clip_eps) | (ratio > 1 + high)).sum())
    tokens = sum(len(c) for _, c in batch)
    if not terms:
        total = torch.zeros((), requires_grad=True)
    elif shape.aggregation == "seq_mean_token_mean":
        total = -torch.stack([t.mean() for t in terms]).sum() / len(batch)
    elif shape.aggregation == "seq_mean_token_sum_norm":
        total = -torch.stack([t.sum() / shape.norm_tokens for t in terms]).sum() / len(batch)
    else:
        total = -torch.cat(terms).mean()
    total.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    return {
        "loss": total.item(),
        "grad_norm": norm.item(),
        "clip_fraction": clipped / max(tokens, 1),
        "tokens": float(tokens),
        "lr": float(lr),
        "state": model.state_dict(),
    }


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest absolute difference of two ragged lists (their shapes must match)."""
    assert [len(r) for r in a] == [len(r) for r in b], "ragged shapes differ"
    return max(
        (abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)),
        default=0.0,
    )

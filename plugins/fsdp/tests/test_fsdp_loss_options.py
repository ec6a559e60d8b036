"""The loss's shape (contract 2.5, :class:`rlcore.handles.LossOptions`) on the fsdp policy,
one rank in this process: each option's step equals the reference computation written
from its paper's formula (:func:`rlcore.testing.reference.reference_grpo_step`), and
differs from the plain GRPO step (so a policy that ignored it would fail)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlcore.handles import LossOptions
from rlcore.testing.policy_checks import check_train_step, reference_step
from rlcore.testing.reference import GRPO_ADVANTAGES, GRPO_BATCH, hf_model, perturbed_old
from rlcore_fsdp.worker import FSDPWorker


def engine_of(current: list[list[float]]) -> list[list[float]]:
    """Sampling logprobs off the policy's by +-0.25 (a sampler/trainer mismatch)."""
    return [[x + (0.25 if (i + j) % 2 else -0.25) for j, x in enumerate(row)] for i, row in enumerate(current)]


CASES: dict[str, Callable[[list[list[float]]], LossOptions]] = {
    # perturbed_old puts ratios at 0.74, 0.95 and 1.35: 1.35 is clipped at 1.2, not at 1.4.
    "clip_higher": lambda cur: LossOptions(clip_eps_high=0.4),
    "seq_mean_token_mean": lambda cur: LossOptions(aggregation="seq_mean_token_mean"),
    "seq_mean_token_sum_norm": lambda cur: LossOptions(aggregation="seq_mean_token_sum_norm", norm_tokens=8),
    "tis": lambda cur: LossOptions(correction="tis", cap=1.1, engine_logprobs=engine_of(cur)),
    "mis": lambda cur: LossOptions(correction="mis", cap=1.1, engine_logprobs=engine_of(cur)),
}


@pytest.fixture
def fresh_worker(model_dir: Path, one_rank: Any) -> Iterator[FSDPWorker]:
    with one_rank(model_dir) as w:
        yield w


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_loss_option_is_its_papers_formula(case: str, fresh_worker: FSDPWorker, model_dir: Path) -> None:
    make = CASES[case]
    current = fresh_worker.logprobs(GRPO_BATCH)
    # Weights within 5e-5 (the plain step's test: 1e-5): AdamW's first step moves a weight by
    # lr * g / (|g| + 1e-8), so a gradient of ~1e-9 turns float32 rounding into ~1e-5.
    got = check_train_step(fresh_worker, model_dir, weight_atol=5e-5, loss=make)
    plain = reference_step(hf_model(model_dir), GRPO_BATCH, GRPO_ADVANTAGES, perturbed_old(current))
    assert (got["loss"], got["grad_norm"], got["clip_fraction"]) != pytest.approx(
        (plain["loss"], plain["grad_norm"], plain["clip_fraction"]), rel=1e-4
    ), f"{case} gave the plain loss's step"


def test_a_correction_without_engine_logprobs_or_mismatched_rows_is_refused(fresh_worker: FSDPWorker) -> None:
    with pytest.raises(ValueError, match="needs engine_logprobs"):
        LossOptions(correction="tis")
    short: Any = [[-1.0]] * len(GRPO_BATCH)
    with pytest.raises(ValueError, match="engine_logprobs row 0 has 1 logprobs for 4 tokens"):
        fresh_worker.train_step(GRPO_BATCH, GRPO_ADVANTAGES, None, 0.2, 0.0,
                                LossOptions(correction="mis", engine_logprobs=short))

"""The conformance check of micro-batching (:func:`rlcore.testing.training.check_whole_batch`)
tells a policy whose step is the whole batch's from ones that sum their micro-batches' losses
or drop the rows after the last whole micro-batch (both seen in backends written from the docs).

The policies are the reference policy's worker in this process behind stand-in handles that
split the batch into micro-batches of 16 rows."""

from __future__ import annotations

from typing import Any

import pytest

from rlcore.config import ModelConfig
from rlcore.models.tiny import ensure_model
from rlcore.testing import training
from rlcore.testing.peers import ReferencePolicyWorker

MICRO = 16


class MicroBatched:
    """``fault``: None (the whole batch's step), ``summed`` (each micro-batch's loss and
    gradient added up) or ``dropped`` (rows after the last whole micro-batch left out)."""

    def __init__(self, model_dir: str, fault: str | None) -> None:
        self.worker = ReferencePolicyWorker(0, 1, model_dir)
        self.fault = fault

    def logprobs(self, batch: Any) -> Any:
        return self.worker.logprobs(batch)

    def train_step(self, batch: Any, advantages: Any, old: Any = None, **kw: float) -> dict[str, float]:
        step = self.worker.train_step
        if self.fault is None:
            return step(batch, advantages, old, kw["clip_eps"], kw["lr"])
        if self.fault == "dropped":
            keep = len(batch) // MICRO * MICRO
            return step(batch[:keep], advantages[:keep], old, kw["clip_eps"], kw["lr"])
        parts = [step(batch[i : i + MICRO], advantages[i : i + MICRO], old, kw["clip_eps"], kw["lr"])
                 for i in range(0, len(batch), MICRO)]
        return {**parts[0], "loss": sum(p["loss"] for p in parts), "grad_norm": sum(p["grad_norm"] for p in parts),
                "tokens": sum(p["tokens"] for p in parts)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(ensure_model(ModelConfig(), tmp_path_factory.mktemp("cache")))


def test_the_whole_batch_passes(model_dir: str) -> None:
    training.check_whole_batch(MicroBatched(model_dir, None), "ok", "float32", ReferencePolicyWorker(0, 1, model_dir))


@pytest.mark.parametrize("fault", ["summed", "dropped"])
def test_summed_or_dropped_micro_batches_fail_naming_the_cause(model_dir: str, fault: str) -> None:
    with pytest.raises(training.TrainingFailure, match="micro-batch losses summed .* or rows after the last whole"):
        training.check_whole_batch(MicroBatched(model_dir, fault), fault, "float32", ReferencePolicyWorker(0, 1, model_dir))

"""The conformance check of staged saves (:func:`rlcore.testing.training.check_staged_checkpoint`,
contract 2.3) tells a policy that writes the state it had at ``stage_checkpoint`` from one whose
background write reads the live state, which the steps after the staging have changed.

The policy is the reference policy's worker in this process, behind two stand-in handles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.config import ModelConfig
from rlcore.models.tiny import ensure_model
from rlcore.testing import training
from rlcore.testing.peers import ReferencePolicyWorker


class StagedReference:
    """The reference policy with staged saves: ``stage_checkpoint`` copies the state, and the
    'background' write happens when ``checkpoint_written`` is first asked. ``live``: the
    write reads the state as it is then (the fault the check exists for)."""

    def __init__(self, model_dir: str, *, live: bool) -> None:
        self.worker = ReferencePolicyWorker(0, 1, model_dir)
        self.live = live
        self.pending: tuple[str, Any] | None = None

    def logprobs(self, batch: Any) -> Any:
        return self.worker.logprobs(batch)

    def train_step(self, batch: Any, advantages: Any, old: Any = None, **kw: float) -> dict[str, float]:
        return self.worker.train_step(batch, advantages, old, kw["clip_eps"], kw["lr"])

    def save_checkpoint(self, directory: str) -> None:
        self.worker.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.worker.load_checkpoint(directory)

    def stage_checkpoint(self, directory: str) -> dict[str, float]:
        copy = None if self.live else {k: v.clone() for k, v in self.worker.model.state_dict().items()}
        self.pending = (directory, (copy, torch.get_rng_state()))
        return {"host_bytes": float(sum(v.numel() * v.element_size() for v in (copy or {}).values()))}

    def checkpoint_written(self) -> bool:
        if self.pending is not None:
            directory, (copy, rng) = self.pending
            model = copy if copy is not None else self.worker.model.state_dict()
            torch.save({"model": model, "rng": rng}, f"{directory}/policy.pt")
            self.pending = None
        return True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(ensure_model(ModelConfig(), tmp_path_factory.mktemp("cache")))


def test_a_policy_that_writes_what_it_staged_passes(model_dir: str, tmp_path: Path) -> None:
    training.check_staged_checkpoint(StagedReference(model_dir, live=False), "reference", tmp_path)


def test_a_policy_whose_background_write_reads_the_live_state_fails_naming_it(model_dir: str, tmp_path: Path) -> None:
    with pytest.raises(training.TrainingFailure, match="not the state at stage_checkpoint"):
        training.check_staged_checkpoint(StagedReference(model_dir, live=True), "reference", tmp_path)

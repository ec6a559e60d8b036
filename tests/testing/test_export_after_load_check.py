"""The conformance check of a checkpoint round trip (:func:`rlcore.testing.training.check_checkpoint_round_trip`)
tells a policy whose first export after ``load_checkpoint`` is the loaded weights from one that
sends an export cached from before the load (what a refit after a resume, or ``rlcore export``,
would then carry).

The policy is the reference policy's worker in this process; the capture stands in for the
core's refit: its ``state_dict``, or a copy kept from the last export (the fault)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlcore.config import ModelConfig
from rlcore.models.tiny import ensure_model
from rlcore.testing import training
from rlcore.testing.peers import ReferencePolicyWorker


class Reference:
    """The reference policy behind a stand-in handle; ``stale``: its export keeps the
    weights it exported before the last ``load_checkpoint``."""

    def __init__(self, model_dir: str, *, stale: bool) -> None:
        self.worker = ReferencePolicyWorker(0, 1, model_dir)
        self.stale = stale
        self.cached: dict[str, Any] | None = None
        self.loaded = False

    def logprobs(self, batch: Any) -> Any:
        return self.worker.logprobs(batch)

    def train_step(self, batch: Any, advantages: Any, old: Any = None, **kw: float) -> dict[str, float]:
        self.loaded = False
        return self.worker.train_step(batch, advantages, old, kw["clip_eps"], kw["lr"])

    def save_checkpoint(self, directory: str) -> None:
        self.worker.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.worker.load_checkpoint(directory)
        self.loaded = True

    def export(self) -> dict[str, Any]:
        if self.stale and self.loaded and self.cached is not None:
            return self.cached
        self.cached = {k: v.detach().clone() for k, v in self.worker.model.state_dict().items()}
        return self.cached


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(ensure_model(ModelConfig(), tmp_path_factory.mktemp("cache")))


def test_a_policy_that_exports_the_loaded_weights_passes(model_dir: str, tmp_path: Path) -> None:
    policy = Reference(model_dir, stale=False)
    training.check_checkpoint_round_trip(policy, "reference", tmp_path, capture=policy.export)


def test_a_policy_whose_export_after_a_load_is_stale_fails_naming_it(model_dir: str, tmp_path: Path) -> None:
    policy = Reference(model_dir, stale=True)
    with pytest.raises(training.TrainingFailure, match="first export after load_checkpoint is not the loaded weights"):
        training.check_checkpoint_round_trip(policy, "reference", tmp_path, capture=policy.export)

"""A failed refit check says whose bug it is: a policy whose export disagrees with its own
forward pass, or an engine that did not apply the weights (issue 26 item 4)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlcore.app.diagnose import FailedCheck, diagnose_divergence, verdict
from rlcore.testing.peers import (
    ReferenceGeneration,
    ReferenceGenerationWorker,
    ReferencePolicy,
    ReferencePolicyWorker,
)

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
PROBE = [([2, 5, 6, 7], [8, 9, 10, 3]), ([2, 11, 12], [13, 14, 3])]


def test_verdict_names_the_side_that_disagrees_with_the_export() -> None:
    names = {"policy": "pol", "generation": "gen"}
    assert "generation backend 'gen' did not apply the weights" in verdict(1.0, 1.3, 1.05, **names)
    assert "policy backend 'pol' exports weights that disagree" in verdict(1.3, 1.0, 1.05, **names)
    assert "neither side" in verdict(1.3, 1.2, 1.05, **names)
    assert "depends on the batch" in verdict(1.0, 1.01, 1.05, **names)


class SkewedExportWorker(ReferencePolicyWorker):
    """A policy whose export is not its model: every weight sent is shifted (a bug of the
    kind 'the export reads a stale or transformed copy')."""

    def export_stream(self) -> Any:
        return ((n, t + 0.05) for n, t in super().export_stream())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A Ray cluster, the tiny model, an honest and a skewed policy, and an engine."""
    import ray

    from rlcore.config import ClusterConfig, ModelConfig
    from rlcore.models.tiny import ensure_model
    from rlcore.runtime.cluster import Cluster
    from rlcore.runtime.worker_group import WorkerGroup

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = Cluster(ClusterConfig(num_cpus=2)).start()
    model = str(ensure_model(ModelConfig(), tmp_path_factory.mktemp("cache")))
    handles: dict[str, Any] = {"model": model}
    try:
        for key, worker, handle in (
            ("honest", ReferencePolicyWorker, ReferencePolicy),
            ("skewed", SkewedExportWorker, ReferencePolicy),
            ("engine", ReferenceGenerationWorker, ReferenceGeneration),
        ):
            group = WorkerGroup(worker, 1, name=f"diagnose-{key}", args=(model, False),
                                num_cpus=0.25, dist_backend=None)
            handles[key] = handle(group, group.call("weight_specs", what="specs")[0])
        yield handles
    finally:
        for key in ("honest", "skewed", "engine"):
            if key in handles:
                handles[key].shutdown()
        cluster.shutdown()


def _diagnose(policy: Any, engine: Any, model: str, tmp_path: Path) -> str:
    from rlcore.config import load_config
    from rlcore.errors import CancelToken
    from rlcore.refit.sessions import RefitSessions
    from rlcore.setup.runner import refit_context

    config = load_config(QUICKSTART, [f"setup.cache_dir={tmp_path}", "refit.timeout_s=30"])
    return diagnose_divergence(
        FailedCheck(PROBE, policy.logprobs, engine.logprobs, limit=1.05, names=("pol", "gen")),
        policy=policy,
        make_context=lambda t: refit_context(config, step=0, transport=t, cancel=CancelToken(),
                                             sessions=RefitSessions()),
        transport="disk",
        model_dir=model,
    )


def _refit(policy: Any, engine: Any, tmp_path: Path) -> None:
    from rlcore.config import load_config
    from rlcore.errors import CancelToken
    from rlcore.refit.sessions import RefitSessions
    from rlcore.refit.sync import refit
    from rlcore.setup.runner import refit_context

    config = load_config(QUICKSTART, [f"setup.cache_dir={tmp_path}", "refit.timeout_s=30"])
    sessions = RefitSessions()
    refit(policy, engine, refit_context(config, step=1, transport="disk", cancel=CancelToken(), sessions=sessions))
    sessions.close()


def _train(policy: Any) -> None:
    batch = [(list(p), list(c)) for p, c in PROBE]
    policy.train_step(batch, [1.0, -1.0], None, clip_eps=0.2, lr=0.05)


@pytest.mark.slow
def test_an_engine_that_kept_its_old_weights_is_named(models: dict[str, Any], tmp_path: Path) -> None:
    _train(models["honest"])  # the engine never gets these weights
    line = _diagnose(models["honest"], models["engine"], models["model"], tmp_path)
    assert "generation backend 'gen' did not apply the weights it was sent" in line, line


@pytest.mark.slow
def test_a_policy_whose_export_is_not_its_model_is_named(models: dict[str, Any], tmp_path: Path) -> None:
    _refit(models["skewed"], models["engine"], tmp_path)  # the engine holds what was sent
    line = _diagnose(models["skewed"], models["engine"], models["model"], tmp_path)
    assert "policy backend 'pol' exports weights that disagree with its own forward pass" in line, line

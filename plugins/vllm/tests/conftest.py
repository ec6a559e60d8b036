"""Session fixtures of the vllm backend's tests: a tiny model, a Ray cluster, a fake policy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlcore.testing.fixtures import tiny_model_dir

    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    from rlcore.config import ClusterConfig
    from rlcore.runtime.cluster import Cluster

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cluster = Cluster(ClusterConfig(num_cpus=2)).start()
    yield
    cluster.shutdown()


@pytest.fixture(scope="session")
def policy(ray_cluster: None, tiny_model: Path) -> Iterator[object]:
    """A fake policy (test-only RefitSender) holding the tiny model's weights."""
    from vllm_helpers import FakePolicy

    fake = FakePolicy(tiny_model)
    yield fake
    fake.shutdown()

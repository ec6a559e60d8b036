"""Fixtures of the sglang backend's tests: a tiny model, a Ray cluster, one shared server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlcore.testing.fixtures import tiny_model_dir

    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from rlcore.config import ClusterConfig
    from rlcore.runtime.cluster import Cluster

    cluster = Cluster(ClusterConfig(num_cpus=2)).start()
    yield
    cluster.shutdown()


@pytest.fixture(scope="module")
def server(
    ray_cluster: None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One refit-fed SGLang server (through the real init hook), shared by a module's tests;
    its handle's ``endpoint`` is rlcore's in front of it (SGLang's own is ``endpoints[0]``)."""
    from sglang_helpers import start

    gen = start(tiny_model, tmp_path_factory.mktemp("sglang-server"), endpoint="rlcore")
    yield gen
    gen.shutdown()

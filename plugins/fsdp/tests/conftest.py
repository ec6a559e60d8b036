"""Fixtures the fsdp backend's test modules share: the tiny model, one rank in this process,
a Ray cluster and the init context of a 2-rank policy (module-scoped: each module starts
its own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from rlcore.context import InitContext


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlcore.testing.fixtures import tiny_model_dir

    return tiny_model_dir(tmp_path_factory)


@contextmanager
def _one_rank(model_dir: Path, **options: Any) -> Iterator[Any]:
    """An :class:`rlcore_fsdp.worker.FSDPWorker` of world size 1 in this process (gloo),
    the tiny model loaded with 2-row micro-batches and ``options`` (``FSDPOptions``)."""
    from rlcore.runtime.addresses import free_port
    from rlcore_fsdp.options import FSDPOptions
    from rlcore_fsdp.worker import FSDPWorker

    w = FSDPWorker(0, 1)
    w.init_process_group("127.0.0.1", free_port(), "gloo", 60.0)
    try:
        w.load(str(model_dir), "float32", FSDPOptions(**{"micro_batch_size": 2, **options}))
        yield w
    finally:
        w.teardown()


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[Any]:
    """One rank in this process (:func:`_one_rank`), shared by a module."""
    with _one_rank(model_dir) as w:
        yield w


@pytest.fixture(scope="session")
def one_rank() -> Callable[..., AbstractContextManager[Any]]:
    """``with one_rank(model_dir, **options) as w``: a rank of its own (:func:`_one_rank`)."""
    return _one_rank


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    from rlcore.testing.policy_checks import running_cluster

    with running_cluster(num_cpus=2):
        yield


def _policy_context(tmp: Path, *overrides: str) -> InitContext:
    """The init context of a 2-rank fsdp policy on the tiny model, cached under ``tmp``."""
    from rlcore.config import cache_dir, load_config
    from rlcore.declarations import Role
    from rlcore.testing import fixtures
    from rlcore_fsdp.options import FSDPOptions

    cfg = load_config(
        None,
        [
            "policy.backend=fsdp",
            "generation.backend=x",
            "policy.workers=2",
            f"setup.cache_dir={tmp}",
            *overrides,
        ],
    )
    return fixtures.init_context(
        Role.POLICY,
        "fsdp",
        cfg,
        FSDPOptions,
        run_dir=tmp / "run",
        cache_dir=cache_dir(cfg),
        deadline_s=120.0,
    )


@pytest.fixture(scope="session")
def policy_context() -> Callable[..., InitContext]:
    """``policy_context(tmp, *overrides)``: a 2-rank policy's init context (config
    overrides as on the command line)."""
    return _policy_context

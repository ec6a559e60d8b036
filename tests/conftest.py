"""Shared fixtures: a leak check for threads and child processes, waiting by polling."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from rlcore.testing.harness import LeakCheck as _LeakCheck
from rlcore.testing.waits import wait_for


class LeakCheck(_LeakCheck):
    """:class:`rlcore.testing.LeakCheck` with an assertion for the core's tests."""

    def assert_clean(self, timeout_s: float = 3.0) -> None:
        """Nothing new may be alive once ``timeout_s`` has passed."""
        left = self.problems(timeout_s)
        assert not left, f"left behind: {left}"


@pytest.fixture(name="wait_for")
def wait_for_fixture() -> Callable[..., bool]:
    """:func:`wait_for` as a fixture (test modules do not import conftest)."""
    return wait_for


@pytest.fixture
def leaks() -> Iterator[LeakCheck]:
    """Yields a :class:`LeakCheck`; the test may call ``assert_clean`` itself, and it is
    checked again after the test."""
    check = LeakCheck()
    yield check
    check.assert_clean()


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything tries to start Ray or a worker group (a check ran too late)."""

    def trap(*_a: object, **_k: object) -> None:
        raise AssertionError("Cluster.start or a WorkerGroup was reached: a check ran after the cluster start")

    monkeypatch.setattr("rlcore.runtime.cluster.Cluster.start", trap)
    monkeypatch.setattr("rlcore.runtime.worker_group.WorkerGroup.__init__", trap)

"""Shared fixtures: a leak check for threads and child processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest


def wait_for(condition: Callable[[], object], timeout_s: float = 5.0, step_s: float = 0.01) -> bool:
    """Poll ``condition`` until it is truthy or ``timeout_s`` passes; return the last outcome."""
    end = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(step_s)


class LeakCheck:
    """Threads and child processes present at the start of a test, to compare against."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.threads = set(threading.enumerate())
        self.children = {p.pid for p in self._proc.children(recursive=True)}

    def new_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in self.threads and t.is_alive()]

    def new_children(self) -> list[int]:
        import psutil

        out = []
        for p in self._proc.children(recursive=True):
            if p.pid in self.children:
                continue
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def assert_clean(self, timeout_s: float = 3.0) -> None:
        """Nothing new may be alive once ``timeout_s`` has passed."""
        wait_for(lambda: not self.new_threads() and not self.new_children(), timeout_s)
        threads = [t.name for t in self.new_threads()]
        children = self.new_children()
        assert not threads, f"threads left behind: {threads}"
        assert not children, f"child processes left behind: {children}"


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

    monkeypatch.setattr("rlcore.cluster.Cluster.start", trap)
    monkeypatch.setattr("rlcore.workers.WorkerGroup.__init__", trap)

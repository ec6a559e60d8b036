"""The lifecycle every worker-group handle shares (rlcore.runtime.group_handle)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rlcore.errors import RlcoreError
from rlcore.runtime.group_handle import GroupHandle


class Group:
    name = "fake-group"
    world_size = 2

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def pids(self) -> list[int]:
        return [11, 12]

    def shutdown(self) -> None:
        self.order.append("group")


class Handle(GroupHandle):
    def __init__(self, order: list[str], fail_release: bool = False) -> None:
        super().__init__(Group(order), backend="fake", role="generation")
        self.order = order
        self.fail_release = fail_release

    def _release(self) -> None:
        self.order.append("release")
        if self.fail_release:
            raise OSError("front would not stop")


def test_shutdown_from_many_threads_releases_once_then_the_group() -> None:
    order: list[str] = []
    h = Handle(order)
    assert h.pids() == [11, 12] and h.world_size == 2
    start = threading.Barrier(8)

    def stop() -> None:
        start.wait(timeout=30)
        h.shutdown()

    threads = [threading.Thread(target=stop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert order == ["release", "group"]
    with pytest.raises(RlcoreError, match="fake-group: the fake generation handle was shut down"):
        h.pids()


def test_a_failing_release_still_shuts_the_workers_down() -> None:
    order: list[str] = []
    h: Any = Handle(order, fail_release=True)
    with pytest.raises(OSError, match="would not stop"):
        h.shutdown()
    assert order == ["release", "group"]
    h.shutdown()  # a second call does nothing more
    assert order == ["release", "group"]

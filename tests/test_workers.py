"""Worker groups on a real embedded Ray cluster: start, call, failures named, deadlines, teardown."""

from __future__ import annotations

import os
import sys
import time

import pytest

from rlcore.config import ClusterConfig
from rlcore.errors import Cancelled, DeadlineExceeded
from rlcore.waiting import CancelToken, Deadline
from rlcore.workers import DistributedWorker, WorkerError, WorkerGroup

ray = pytest.importorskip("ray")


class EchoWorker(DistributedWorker):
    def where(self) -> tuple[int, int, int]:
        import torch.distributed as dist

        return self.rank, dist.get_world_size(), os.getpid()

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t.item())

    def boom(self) -> None:
        raise ValueError(f"rank {self.rank} exploded")

    def sleep(self, s: float) -> None:
        time.sleep(s)


@pytest.fixture(scope="module")
def cluster():
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test classes travel by value
    from rlcore.cluster import Cluster

    c = Cluster(ClusterConfig(num_cpus=2)).start()
    yield c
    c.shutdown()


def test_group_forms_a_process_group_and_tears_down(cluster) -> None:
    group = WorkerGroup(EchoWorker, 2, name="echo", num_cpus=0.5)
    try:
        where = group.call("where")
        assert [w[:2] for w in where] == [(0, 2), (1, 2)]
        assert group.call("all_reduce", 1.5) == [3.0, 3.0]
        pids = [w[2] for w in where]
    finally:
        group.shutdown()
    import psutil

    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "worker processes survived shutdown"
        time.sleep(0.2)


def test_errors_name_group_and_cause(cluster) -> None:
    group = WorkerGroup(EchoWorker, 1, name="echo-err", num_cpus=0.5, dist_backend=None)
    try:
        with pytest.raises(WorkerError, match=r"echo-err: boom: echo-err rank 0 failed: ValueError: rank 0 exploded"):
            group.call("boom")
        with pytest.raises(DeadlineExceeded, match="echo-err"):
            group.call("sleep", 5, deadline=Deadline(0.5, "t"))
        ray.kill(group.actors[0], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="echo-err: .*echo-err rank 0 died"):
            group.call("where", deadline=Deadline(30, "t"))
        assert time.monotonic() - t0 < 20
    finally:
        group.shutdown()


def test_cancel_is_observed(cluster) -> None:
    cancel = CancelToken()
    group = WorkerGroup(EchoWorker, 1, name="echo-cancel", num_cpus=0.5, dist_backend=None, cancel=cancel)
    try:
        refs = group.call_async("sleep", 10)
        cancel.cancel("test")
        t0 = time.monotonic()
        with pytest.raises(Cancelled):
            group.get(refs, what="sleep")
        assert time.monotonic() - t0 < 2
    finally:
        group.shutdown()


def test_group_larger_than_cluster_fails_fast(cluster) -> None:
    with pytest.raises(WorkerError, match="cluster.num_cpus"):
        WorkerGroup(EchoWorker, 3, name="too-big", num_cpus=1.0)


def test_ray_get_of_nothing_never_touches_ray(monkeypatch) -> None:
    """Handles that work in the driver return no refs; waiting on them must not start Ray."""
    import types

    from rlcore.workers import ray_get

    fake = types.ModuleType("ray")
    fake.wait = lambda *a, **k: (_ for _ in ()).throw(AssertionError("ray used"))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert ray_get([], what="nothing") == []

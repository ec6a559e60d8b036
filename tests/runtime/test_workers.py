"""Worker groups on a real embedded Ray cluster: start, call, failures named, deadlines, teardown."""

from __future__ import annotations

import os
import sys
import time

import pytest

from rlcore.config import ClusterConfig
from rlcore.errors import Cancelled, CancelToken, Deadline, DeadlineExceeded, WorkerError
from rlcore.runtime import resources
from rlcore.runtime.resources import actor_runtime_env
from rlcore.runtime.worker_group import DistributedWorker, GroupSpec, WorkerGroup
from rlcore.testing.waits import wait_for

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

    def niceness(self) -> int:
        return os.nice(0)

    def environment(self, *names: str) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in names}

    def own_runtime_env(self) -> dict:
        import ray

        return dict(ray.get_runtime_context().runtime_env or {})

    def listening(self) -> list[str]:
        """Addresses this worker process listens on (TCP)."""
        import psutil

        return sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN})


class StubbornWorker(DistributedWorker):
    """Hangs in teardown and leaves a child that ignores SIGTERM."""

    def spawn_child(self) -> int:
        import subprocess

        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        self.child = subprocess.Popen([sys.executable, "-c", code])
        return self.child.pid

    def teardown(self) -> None:
        time.sleep(600)


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def cluster():
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test classes travel by value
    from rlcore.runtime.cluster import Cluster

    c = Cluster(ClusterConfig(num_cpus=2)).start()
    yield c
    c.shutdown()


def _idle_workers() -> set[int]:
    """Pids of the embedded cluster's workers that no actor or task holds yet."""
    from rlcore.runtime.cluster import _ray_processes

    idle = set()
    for p in _ray_processes():
        try:
            if "ray::IDLE" in " ".join(p.cmdline()):
                idle.add(p.pid)
        except Exception:  # noqa: BLE001 - gone meanwhile
            continue
    return idle


def test_actors_run_in_the_workers_ray_started_ahead(cluster) -> None:
    """The first test of the module: the cluster's workers started ahead of time are still idle.

    The run's variables reach the workers through the raylet, not as a runtime_env, so an
    actor that asks for no other variable runs in one of them (no fresh process, none
    ended); a variable the workers lack still reaches the actor, as its own runtime_env."""
    assert wait_for(lambda: len(_idle_workers()) >= 2, timeout_s=120), "Ray started no workers ahead"
    ahead = _idle_workers()
    run_env = dict(resources.WORKER_ENV)
    assert run_env["TOKENIZERS_PARALLELISM"] == "false" and run_env["OMP_NUM_THREADS"]
    group = WorkerGroup(EchoWorker, 2, name="echo-ahead", num_cpus=0.5, env=run_env, dist_backend=None)
    try:
        assert set(group.pids()) <= ahead
        assert group.call("environment", *run_env) == [run_env] * 2
        assert group.call("own_runtime_env") == [{}, {}]
    finally:
        group.shutdown()
    extra = {**run_env, "RLCORE_TEST_VARIABLE": "on"}
    assert actor_runtime_env(extra) == {"env_vars": {"RLCORE_TEST_VARIABLE": "on"}}
    assert actor_runtime_env(run_env) is None and actor_runtime_env(None) is None
    group = WorkerGroup(EchoWorker, 1, name="echo-extra", num_cpus=0.5, env=extra, dist_backend=None)
    try:
        assert group.call("environment", *extra) == [extra]
    finally:
        group.shutdown()


def test_cluster_start_leaves_the_drivers_environment_as_it_was(monkeypatch) -> None:
    """The workers' variables are in the driver's environment only while Ray starts."""
    from rlcore.runtime.cluster import _worker_environment

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("RLCORE_TEST_VARIABLE", raising=False)
    saved = dict(resources.WORKER_ENV)
    try:
        with _worker_environment({"OMP_NUM_THREADS": "1", "RLCORE_TEST_VARIABLE": "on"}):
            assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["RLCORE_TEST_VARIABLE"] == "on"
        assert os.environ["OMP_NUM_THREADS"] == "7" and "RLCORE_TEST_VARIABLE" not in os.environ
        assert resources.WORKER_ENV == {"OMP_NUM_THREADS": "1", "RLCORE_TEST_VARIABLE": "on"}
    finally:
        resources.WORKER_ENV.clear()
        resources.WORKER_ENV.update(saved)


def test_group_forms_a_process_group_and_tears_down(cluster) -> None:
    group = WorkerGroup(EchoWorker, 2, name="echo", num_cpus=0.5)
    try:
        where = group.call("where")
        assert [w[:2] for w in where] == [(0, 2), (1, 2)]
        assert group.call("all_reduce", 1.5) == [3.0, 3.0]
        assert group.spec == GroupSpec(EchoWorker, 2, "echo", num_cpus=0.5)
        pids = [w[2] for w in where]
    finally:
        group.shutdown()
    # shutdown() returns only once the processes have exited: no waiting here.
    assert not [p for p in pids if _running(p)], "worker processes survived shutdown"


def test_the_embedded_cluster_retries_local_connects_quickly(cluster) -> None:
    """Ray's default retry of a local socket connect is once a second: a raylet whose
    object store was not listening at the first try made ``ray.init`` a second longer."""
    import ray

    from rlcore.runtime.cluster import LOCAL_CONNECT_RETRY

    config = ray._private.state.state.get_system_config()  # what the cluster's processes run with
    assert {k: config.get(k) for k in LOCAL_CONNECT_RETRY} == {
        "raylet_client_connect_timeout_milliseconds": 50,
        "raylet_client_num_connect_attempts": 200,
    }


def test_workers_of_the_embedded_cluster_run_at_the_drivers_priority(cluster) -> None:
    """Ray's default niceness for workers (15) starves them beside ordinary busy processes."""
    group = WorkerGroup(EchoWorker, 2, name="echo-nice", num_cpus=0.5)
    try:
        assert group.call("niceness") == [os.nice(0)] * 2
    finally:
        group.shutdown()


def test_rendezvous_and_gloo_listen_on_loopback_only(cluster) -> None:
    """On the embedded single-host cluster no worker-group port is reachable from another host."""
    group = WorkerGroup(EchoWorker, 2, name="echo-lo", num_cpus=0.5)
    try:
        assert group.call("all_reduce", 1.0) == [2.0, 2.0]
        for rank, addrs in enumerate(group.call("listening")):
            assert addrs, f"rank {rank} listens on nothing: the check would be vacuous"
            assert set(addrs) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, (rank, addrs)
    finally:
        group.shutdown()


def test_tcp_store_binds_loopback_for_a_loopback_host() -> None:
    import psutil

    from rlcore.runtime.addresses import free_port
    from rlcore.runtime.rendezvous import tcp_store

    port = free_port()
    store = tcp_store("127.0.0.1", port, 1, True, 10.0)
    store.set("k", "v")
    mine = {c.laddr.ip for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert mine == {"127.0.0.1"}  # torch alone would listen on "::" (every interface)
    del store


def test_a_rendezvous_port_listens_before_its_store_exists() -> None:
    """A rank told the address may connect before rank 0 builds the store: the port must
    already accept (a refused connect makes torch's client back off for ~0.5 s), and the
    store must then serve on that very socket."""
    import socket
    import threading

    import psutil

    from rlcore.runtime.rendezvous import listen_ahead, tcp_store

    port = listen_ahead("127.0.0.1")
    assert listen_ahead("127.0.0.1") != port  # each address gets its own held port
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # accepted by the backlog: no store exists yet
    client: dict[str, object] = {}

    def join() -> None:  # a client store that comes first waits for the master
        client["store"] = tcp_store("127.0.0.1", port, 2, False, 30.0)

    early = threading.Thread(target=join)
    early.start()
    master = tcp_store("127.0.0.1", port, 2, True, 30.0)
    early.join(30.0)
    assert not early.is_alive()
    master.set("k", "v")
    assert client["store"].get("k") == b"v"  # type: ignore[attr-defined]
    listening = {c.laddr.ip for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening == {"127.0.0.1"}  # the held socket, bound to the host asked for


def test_shutdown_returns_after_stragglers_are_killed(cluster) -> None:
    group = WorkerGroup(StubbornWorker, 2, name="stubborn", num_cpus=0.5, dist_backend=None)
    pids = group.pids()
    children = group.call("spawn_child")
    assert all(_running(p) for p in [*pids, *children])
    group.shutdown(graceful_s=0.5, exit_s=5.0)
    left = [p for p in [*pids, *children] if _running(p)]
    assert not left, f"still running after shutdown() returned: {left}"
    assert group.actors == []
    group.shutdown()  # idempotent


def test_errors_name_group_and_cause(cluster) -> None:
    group = WorkerGroup(EchoWorker, 1, name="echo-err", num_cpus=0.5, dist_backend=None)
    try:
        with pytest.raises(WorkerError, match=r"echo-err: boom: echo-err rank 0 failed: ValueError: rank 0 exploded"):
            group.call("boom")
        with pytest.raises(DeadlineExceeded, match="echo-err"):
            group.call("sleep", 5, deadline=Deadline(0.5, "t"))
        ray.kill(group.actors[0], no_restart=True)
        # The death is named before the call's 300 s deadline: a WorkerError, not a DeadlineExceeded.
        with pytest.raises(WorkerError, match="echo-err: .*echo-err rank 0 died"):
            group.call("where", deadline=Deadline(300, "t"))
    finally:
        group.shutdown()


def test_cancel_is_observed(cluster) -> None:
    cancel = CancelToken()
    group = WorkerGroup(EchoWorker, 1, name="echo-cancel", num_cpus=0.5, dist_backend=None, cancel=cancel)
    try:
        refs = group.call_async("sleep", 300)
        cancel.cancel("test")
        with pytest.raises(Cancelled):  # not the sleep's result 300 s later
            group.get(refs, what="sleep")
    finally:
        group.shutdown()


def test_group_larger_than_cluster_fails_fast(cluster) -> None:
    with pytest.raises(WorkerError, match="cluster.num_cpus"):
        WorkerGroup(EchoWorker, 3, name="too-big", num_cpus=1.0)


def test_a_group_spec_keeps_its_own_copy_of_the_arguments() -> None:
    """What a restarted rank is built from is what the group started with, whatever the
    caller does with its arguments afterwards; an unknown keyword is refused."""
    args, kwargs = [1], {"a": 1}
    spec = GroupSpec(EchoWorker, 2, "echo", args=args, kwargs=kwargs)
    args.append(2)
    kwargs["a"] = 2
    assert (spec.args, spec.kwargs, spec.role, spec.dist_backend) == ((1,), {"a": 1}, None, "gloo")
    with pytest.raises(TypeError, match="bogus"):
        GroupSpec(EchoWorker, 1, "echo", bogus=1)  # type: ignore[call-arg]


def test_ray_get_of_nothing_never_touches_ray(monkeypatch) -> None:
    """Handles that work in the driver return no refs; waiting on them must not start Ray."""
    import types

    from rlcore.runtime.waits import ray_get

    fake = types.ModuleType("ray")
    fake.wait = lambda *a, **k: (_ for _ in ()).throw(AssertionError("ray used"))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert ray_get([], what="nothing") == []


def test_shutdown_after_the_cluster_is_gone_starts_no_cluster(monkeypatch) -> None:
    """A group whose cluster was shut down: shutdown() returns without calling Ray."""
    group = WorkerGroup.__new__(WorkerGroup)
    group.name, group.actors, group._processes = "orphan", [object()], [("node", 1)]
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def started(*_a, **_k):
        raise AssertionError("shutdown() called into Ray after the cluster was gone")

    monkeypatch.setattr(ray, "get_runtime_context", started)
    monkeypatch.setattr(ray, "kill", started)
    group.shutdown()
    assert group.actors == []

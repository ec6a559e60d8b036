"""Refits that land while a generate is in flight, on a real embedded Ray cluster: an
engine class that opts in (``inflight_refit``) gets a refit thread, so the refit-side calls
of :class:`GroupGeneration` run beside a blocked generate; a class that does not keeps
today's order (the refit waits for the call). Blocked and released with events, no sleeps."""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from rlcore.config import ClusterConfig
from rlcore.handles import SamplingParams
from rlcore.runtime.generation_group import EngineArgs, EngineWorker, GroupGeneration
from rlcore.runtime.worker_group import REFIT_GROUP, WorkerGroup

ray = pytest.importorskip("ray")

#: Every wait of this module is bounded by this (a hang fails the test, it never sets the pace).
BOUND_S = 120


class Board:
    """What the engine did, in order, and the event that releases its generate (an async
    Ray actor: its calls run on one event loop and never block each other)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.changed = asyncio.Condition()

    async def add(self, event: str) -> None:
        async with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    async def wait(self, event: str) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: event in self.events)

    def seen(self) -> list[str]:
        return list(self.events)


class Options:
    port = 0
    served_model_name = "policy"


class Blocking(EngineWorker):
    """An engine whose generate blocks until the board says ``go``; its refit-side calls
    only note that they ran."""

    engine = "Blocking"

    def __init__(self, rank: int, world_size: int, args: EngineArgs, *, board: Any) -> None:
        super().__init__(rank, world_size, args)
        self.board = board

    def _note(self, event: str) -> None:
        ray.get(self.board.add.remote(event))

    def _generate(self, prompt_ids: Any, params: SamplingParams, seeds: Any) -> Any:
        self._note("generate started")
        ray.get(self.board.wait.remote("go"))
        self._note("generate ended")
        return [[{"token_ids": [1], "logprobs": [-1.0]}] * params.n for _ in seeds]

    def open_refit_channel(self, spec: Any, rank: int) -> None:
        self._note(f"open {spec} as {rank}")

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> float:
        self._note(f"refit {step}")
        return 0.0


class InFlight(Blocking):
    inflight_refit = True


@pytest.fixture(scope="module")
def cluster() -> Any:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test classes travel by value
    from rlcore.runtime.cluster import Cluster

    c = Cluster(ClusterConfig(num_cpus=2)).start()
    yield c
    c.shutdown()


def _handle(cls: type, board: Any) -> GroupGeneration:
    args = EngineArgs("/m", dtype="float32", refit_fed=True, options=Options())
    group = WorkerGroup(
        cls, 1, name=f"{cls.__name__.lower()}-generation", args=(args,), kwargs={"board": board},
        num_cpus=0.5, dist_backend=None,
    )
    return GroupGeneration(group, [], backend="fake")


def _generate_in_background(pool: ThreadPoolExecutor, handle: GroupGeneration, board: Any) -> Any:
    """A generate call through the handle, blocked in the engine once this returns."""
    running = pool.submit(handle.generate, [[1, 2]], SamplingParams(2, 4, 1.0, 0))
    ray.get(board.wait.remote("generate started"), timeout=BOUND_S)
    return running


def test_an_engine_that_opts_in_takes_a_refit_while_its_generate_is_blocked(cluster: Any) -> None:
    board = ray.remote(num_cpus=0)(Board).remote()
    handle = _handle(InFlight, board)
    try:
        assert handle.group.refit_group == REFIT_GROUP
        with ThreadPoolExecutor(1) as pool:
            running = _generate_in_background(pool, handle, board)
            # Both refit-side calls return while the generate is still blocked.
            ray.get(handle.open_refit_channel("chan"), timeout=BOUND_S)
            assert ray.get(handle.receive_weights("chan", 3, []), timeout=BOUND_S) == [0.0]
            assert not running.done()
            ray.get(board.add.remote("go"))
            # The engine says no token's version: each carries the one the call began with.
            assert running.result(timeout=BOUND_S) == [[{"token_ids": [1], "logprobs": [-1.0], "versions": [0]}] * 2]
        assert ray.get(board.seen.remote()) == [
            "generate started", "open chan as 1", "refit 3", "go", "generate ended",
        ]
    finally:
        handle.shutdown()


def test_an_engine_that_does_not_opt_in_refits_after_its_call(cluster: Any) -> None:
    board = ray.remote(num_cpus=0)(Board).remote()
    handle = _handle(Blocking, board)
    try:
        assert handle.group.refit_group is None
        with ThreadPoolExecutor(1) as pool:
            running = _generate_in_background(pool, handle, board)
            refit = handle.receive_weights("chan", 3, [])  # queued behind the generate
            ray.get(board.add.remote("go"))
            running.result(timeout=BOUND_S)
            assert ray.get(refit, timeout=BOUND_S) == [0.0]
        assert ray.get(board.seen.remote()) == ["generate started", "go", "generate ended", "refit 3"]
    finally:
        handle.shutdown()

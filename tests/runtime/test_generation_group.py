"""The generation-handle base: per-prompt seeds, contiguous shards, refit ranks, closed handles;
the engine-side base: call checks, the stale-weights refusal, where a server binds."""

from __future__ import annotations

from typing import Any

import pytest

from rlcore.config.placement import Network
from rlcore.errors import RefitError, RlcoreError
from rlcore.handles import SamplingParams
from rlcore.runtime.generation_group import (
    EngineArgs,
    EngineWorker,
    GroupGeneration,
    PauseRoutes,
    label_version,
    prompt_seed,
    versions_from_spans,
)


class Remote:
    """``actor.method.remote(*args)`` returns what the engine computes, at once."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


class Engine:
    def __init__(self, index: int, calls: list[tuple[int, str, Any]]) -> None:
        self.generate = Remote(lambda prompts, params, seeds: (calls.append((index, "generate", seeds)) or
                               [[{"token_ids": [index, s], "logprobs": [-0.1, -0.2]}] * params.n for s in seeds]))
        self.logprobs = Remote(lambda batch: [[-float(index)] * len(c) for _, c in batch])
        self.open_refit_channel = Remote(lambda spec, rank: ("open", rank))
        self.version = 0
        self.weight_version = Remote(lambda: self.version)


class Group:
    name = "fake-generation"
    refit_group = None  # engines that take refits only between calls

    def __init__(self, engines: int) -> None:
        self.calls: list[tuple[int, str, Any]] = []
        self.actors = [Engine(i, self.calls) for i in range(engines)]
        self.world_size = engines
        self.waited: list[list[int]] = []  # the engine ranks of each wait's refs

    def get(self, refs: Any, *, what: str, ranks: Any = None) -> Any:
        self.waited.append(list(ranks or []))
        return refs


class Handle(GroupGeneration):
    def __init__(self, engines: int) -> None:
        super().__init__(Group(engines), ["spec"], backend="fake")


def test_prompt_seeds_are_distinct_and_stable() -> None:
    seeds = [prompt_seed(7, i) for i in range(1000)]
    # Engines give sample j of a prompt seed + j: no two prompts' sample streams may meet.
    assert len({s + j for s in seeds for j in range(16)}) == 16 * len(seeds)
    assert prompt_seed(7, 3) == prompt_seed(7, 3) != prompt_seed(8, 3)


def test_prompts_are_sharded_contiguously_and_keep_their_seeds() -> None:
    h = Handle(engines=2)
    out = h.generate([[1]] * 5, SamplingParams(2, 4, 1.0, 7))
    assert [g[0]["token_ids"][0] for g in out] == [0, 0, 0, 1, 1]  # engine of each prompt, in order
    assert [g[0]["token_ids"][1] for g in out] == [prompt_seed(7, i) for i in range(5)]
    assert all(len(g) == 2 for g in out)
    # Seeds do not depend on the number of engines.
    one = Handle(engines=1).generate([[1]] * 5, SamplingParams(2, 4, 1.0, 7))
    assert [g[0]["token_ids"][1] for g in one] == [g[0]["token_ids"][1] for g in out]
    # An engine with no prompt gets no call.
    h3 = Handle(engines=3)
    h3.generate([[1]], SamplingParams(1, 4, 1.0, 0))
    assert [c[0] for c in h3.group.calls] == [0]
    # Each wait says which engine each ref is: a loss names (and replaces) that engine.
    assert h.group.waited == [[0, 1]] and h3.group.waited == [[0]]
    assert h.logprobs([([1], [2, 3])] * 3) == [[-0.0, -0.0]] * 2 + [[-1.0, -1.0]]


def test_engine_i_is_refit_rank_1_plus_i_and_a_closed_handle_refuses() -> None:
    h = Handle(engines=3)
    assert h.open_refit_channel("spec") == [("open", 1), ("open", 2), ("open", 3)]
    assert h.weight_specs() == ["spec"]
    h._closed = True
    with pytest.raises(RlcoreError, match="fake-generation: the fake generation handle was shut down"):
        h.generate([[1]], SamplingParams(1, 1, 1.0, 0))

    assert h.refit_ranks == 3 and h.endpoint is None


class Options:
    port = 0
    served_model_name = "policy"


class Worker(EngineWorker):
    engine = "Fake"

    def _generate(self, prompt_ids: Any, params: SamplingParams, seeds: Any) -> Any:
        return [[{"token_ids": [s], "logprobs": [-0.5]}] * params.n for s in seeds]

    def _logprobs(self, batch: Any) -> Any:
        return [[-1.0] * len(c) for _, c in batch]


def _worker(**kwargs: Any) -> Worker:
    return Worker(1, 2, EngineArgs("/m", dtype="float32", refit_fed=True, options=Options(), **kwargs))


def test_an_engine_checks_its_calls_and_refuses_stale_weights() -> None:
    w = _worker()
    assert w.generate([[1], [2]], SamplingParams(2, 4, 1.0, 0), [5, 6]) == [
        [{"token_ids": [5], "logprobs": [-0.5], "versions": [0]}] * 2,
        [{"token_ids": [6], "logprobs": [-0.5], "versions": [0]}] * 2,
    ]
    assert w.generate([], SamplingParams(2, 4, 1.0, 0), []) == [] and w.logprobs([]) == []
    assert w.logprobs([([1], [2, 3])]) == [[-1.0, -1.0]]
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        w.generate([[1], [2]], SamplingParams(1, 4, 1.0, 0), [5])
    w.stale = "refit step 3 over disk did not complete"
    for call in (lambda: w.generate([], SamplingParams(1, 4, 1.0, 0), []), lambda: w.logprobs([])):
        with pytest.raises(RuntimeError, match=r"^Fake worker 1: refit step 3 over disk did not complete; its "
                           "weights may mix two versions, so it refuses to generate until a refit succeeds$"):
            call()


def test_an_engines_server_binds_its_port_and_the_runs_address() -> None:
    w = _worker()
    bind = w._bind()
    assert bind["host"] == "127.0.0.1" and bind["token"] is None and bind["port"] > 0
    w.options.port, w.network = 8100, Network.spread()
    # Outside Ray this node's address is loopback; the token is the run's.
    assert w._bind() == {"port": 8101, "host": "127.0.0.1", "token": w.network.token}


def test_an_engine_takes_its_device_from_the_handle() -> None:
    assert _worker(cuda=True)._on_cuda() is True and _worker(cuda=False)._on_cuda() is False


def test_a_greedy_call_samples_once_and_copies_it_n_times() -> None:
    asked: list[int] = []

    class Counting(Worker):
        def _generate(self, prompt_ids: Any, params: SamplingParams, seeds: Any) -> Any:
            asked.append(params.n)
            return super()._generate(prompt_ids, params, seeds)

    w = Counting(0, 1, EngineArgs("/m", dtype="float32", refit_fed=True, options=Options()))
    out = w.generate([[1], [2]], SamplingParams(3, 4, 0.0, 0), [5, 6])
    assert asked == [1] and [[s["token_ids"] for s in g] for g in out] == [[[5]] * 3, [[6]] * 3]
    out[0][0]["token_ids"].append(9)  # copies, not one list three times
    assert out[0][1]["token_ids"] == [5]
    w.generate([[1]], SamplingParams(3, 4, 0.5, 0), [5])
    assert asked == [1, 3]


class FakeServer:
    """Records the routes posted to it; ``refuse`` names routes that answer an error."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.posted: list[str] = []
        self.refuse = refuse
        self.up = True

    def post(self, path: str, body: Any = None, *, timeout_s: float = 300.0) -> None:
        from rlcore.runtime.server import ServerError

        self.posted.append(path)
        if path in self.refuse:
            raise ServerError(f"{path} refused", status=500, message="refused")

    def alive(self) -> bool:
        return self.up


ROUTES = PauseRoutes(pause=("/pause", None), resume=("/resume", None), abort=("/abort", {"all": True}))


def _held(w: Worker, *, load: Any = None) -> None:
    """A refit of step 4 through ``_held_for_refit``: ``load()`` is the update (may raise)."""
    with w._held_for_refit(ROUTES, 4, 30.0):
        w.stale = "refit step 4 over collective did not complete"
        if load is not None:
            load()
        w.stale = None


def test_a_refit_holds_the_requests_in_flight_and_always_resumes_them() -> None:
    w = _worker()
    w.server = FakeServer()
    _held(w)
    assert w.server.posted == ["/pause", "/resume"] and w.stale is None and w.refit_aborts == 0

    def half_loaded() -> None:
        raise RefitError("bucket 2 rejected")

    w.server = FakeServer()
    with pytest.raises(RefitError, match="bucket 2 rejected"):
        _held(w, load=half_loaded)
    # Weights may be half-loaded: the held requests are aborted before they resume.
    assert w.server.posted == ["/pause", "/abort", "/resume"] and w.refit_aborts == 1 and w.stale

    w.stale, w.server = None, FakeServer()
    with pytest.raises(RefitError, match="nothing loaded"):
        with w._held_for_refit(ROUTES, 5, 30.0):
            raise RefitError("nothing loaded")  # stale never set: the requests go on
    assert w.server.posted == ["/pause", "/resume"] and w.refit_aborts == 1

    w.server = FakeServer()
    w.server.up = False  # died in the update: nothing to resume
    with pytest.raises(RefitError):
        _held(w, load=half_loaded)
    assert w.server.posted == ["/pause"]


def test_a_refit_whose_resume_fails_leaves_the_engine_refusing_to_generate() -> None:
    w = _worker()
    w.server = FakeServer(refuse=("/resume",))
    with pytest.raises(RefitError, match=r"^Fake worker 1: generation was not resumed after refit step 4: /resume refused$"):
        _held(w)
    with pytest.raises(RuntimeError, match="refuses to generate until a refit succeeds"):
        w.generate([[1]], SamplingParams(1, 4, 1.0, 0), [5])
    # A failed load stays the error raised; the failed resume only marks the engine.
    w.stale, w.server = None, FakeServer(refuse=("/resume",))
    with pytest.raises(RefitError, match="bucket 1"):
        _held(w, load=lambda: (_ for _ in ()).throw(RefitError("bucket 1")))
    assert w.stale is not None and w.stale.startswith("generation was not resumed after refit step 4")


def test_a_call_whose_requests_a_failed_refit_aborted_fails() -> None:
    """The engine answers aborted requests with the tokens it had: no samples to return."""

    class Cut(Worker):
        def _generate(self, prompt_ids: Any, params: SamplingParams, seeds: Any) -> Any:
            with pytest.raises(RefitError):  # the refit, on its own thread in a real actor
                _held(self, load=lambda: (_ for _ in ()).throw(RefitError("half")))
            return super()._generate(prompt_ids, params, seeds)

        _logprobs = _generate  # type: ignore[assignment]

    w = Cut(1, 2, EngineArgs("/m", dtype="float32", refit_fed=True, options=Options()))
    w.server = FakeServer()
    with pytest.raises(RuntimeError, match=r"^Fake worker 1: a refit failed half-way during this call and aborted its requests \(refit step 4"):
        w.generate([[1]], SamplingParams(1, 4, 1.0, 0), [5])
    assert w.server.posted == ["/pause", "/abort", "/resume"]


def test_the_handle_reports_each_engines_weight_version() -> None:
    h = Handle(engines=2)
    h.group.actors[1].version = 3
    assert h.weight_versions() == [0, 3]


def test_engine_labels_and_spans_become_versions_per_token() -> None:
    # rlcore labels the weights of refit t "step-<t>"; the engine's own first label is 0.
    assert [label_version(x) for x in ("step-0", "step-12", "default", "step-x", "")] == [0, 12, 0, 0, 0]
    assert versions_from_spans([("default", 0, 2), ("step-3", 2, 5)], 5) == [0, 0, 3, 3, 3]
    assert versions_from_spans([("step-1", 0, 1)], 1) == [1]
    # Spans that do not cover the tokens exactly once, in order: the engine could not tell.
    assert versions_from_spans([("step-1", 0, 2)], 3) is None
    assert versions_from_spans([("step-1", 1, 3)], 2) is None
    assert versions_from_spans([("step-1", 0, 2), ("step-2", 1, 3)], 3) is None
    assert versions_from_spans([], 2) is None


def test_samples_carry_the_version_loaded_when_the_call_started() -> None:
    class Versioned(Worker):
        def _generate(self, prompt_ids: Any, params: SamplingParams, seeds: Any) -> Any:
            out = super()._generate(prompt_ids, params, seeds)
            self.loaded_version += 1  # a refit landing after the call started changes nothing
            return out

    w = Versioned(0, 1, EngineArgs("/m", dtype="float32", refit_fed=True, options=Options()))
    assert w.weight_version() == 0
    w.loaded_version = 4  # what a successful receive_weights of step 4 sets
    assert w.generate([[1]], SamplingParams(1, 4, 1.0, 0), [5])[0][0]["versions"] == [4]
    assert w.weight_version() == 5

    class Spans(Worker):  # an engine that reports its own versions keeps them
        def _generate(self, prompt_ids: Any, params: SamplingParams, seeds: Any) -> Any:
            return [[{"token_ids": [s, s], "logprobs": [-0.5, -0.5], "versions": [1, 2]}] for s in seeds]

    w = Spans(0, 1, EngineArgs("/m", dtype="float32", refit_fed=True, options=Options()))
    w.loaded_version = 2
    out = w.generate([[1]], SamplingParams(3, 4, 0.0, 0), [5])
    assert [s["versions"] for s in out[0]] == [[1, 2]] * 3
    out[0][0]["versions"].append(9)  # greedy copies own their lists
    assert out[0][1]["versions"] == [1, 2]

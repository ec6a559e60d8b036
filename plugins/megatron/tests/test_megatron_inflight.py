"""The dynamic engine's step loop and in-flight refit logic, on CPU over a stand-in engine.

megatron-core's dynamic engine needs CUDA (the real one: test_megatron_dynamic_gpu.py, where
a refit lands mid-call on the GPU). Here a stand-in with the same surface (add_request,
step_modern, suspend / resume, records that merge) checks what rlcore adds around it: the
hook between two steps, where a refit lands; the requests held across the load and where
each request's new version starts; a load that fails dropping the requests and failing the
call; the order of the samples.
"""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from megatron.core.inference.inference_request import Status

from rlcore_megatron import inference
from rlcore_megatron.worker import MegatronGenerationWorker

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Part:
    def __init__(self, rid: int) -> None:
        self.request_id, self.generated_tokens, self.generated_log_probs, self.status = rid, [], [], Status.ACTIVE_AND_GENERATING_TOKENS


class Record:
    def __init__(self, rid: int) -> None:
        self.request_id, self.requests = rid, [Part(rid)]

    def merge(self) -> Any:
        parts = self.requests
        return SimpleNamespace(
            request_id=self.request_id, status=parts[-1].status,
            generated_tokens=[t for p in parts for t in p.generated_tokens],
            generated_log_probs=[x for p in parts for x in p.generated_log_probs],
        )


class Engine:
    """Generates one token per step for every request (token = 100 * request + index), each
    request ``length`` tokens long; ``suspend`` checkpoints a new part per request."""

    def __init__(self, length: int = 4) -> None:
        self.length, self.steps, self.events = length, 0, []
        self.context = SimpleNamespace(
            max_sequence_length=64,
            request_metadata_types=[("temperature", None, False), ("termination_id", None, True)],
        )
        self._allocate()
        # As megatron-core's controller: the on-device metadata taken from the context at
        # construction, its own host copy of the rest.
        held = {"termination_id": self.context.request_metadata["termination_id"], "temperature": object()}
        self.controller = SimpleNamespace(tokenizer=SimpleNamespace(eod=2), _request_metadata=held)
        self.reset()

    def _allocate(self) -> None:
        """New metadata tensors, as the context's ``allocate_all_tensors`` makes on resume."""
        self.context.request_metadata = {"temperature": object(), "termination_id": object()}

    def reset(self) -> None:
        self.request_counter, self.requests = itertools.count(), {}
        self.events.append("reset")

    def add_request(self, rid: int, prompt: list[int], params: Any) -> None:
        self.requests[rid] = SimpleNamespace(record=Record(rid))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step_modern(self) -> dict[str, Any]:
        self.steps += 1
        done = []
        for rid, entry in list(self.requests.items()):
            made = sum(len(p.generated_tokens) for p in entry.record.requests)
            part = entry.record.requests[-1]
            part.generated_tokens.append(100 * rid + made)
            part.generated_log_probs.append(-0.5)
            if made + 1 == self.length:
                part.status = Status.COMPLETED
                done.append(self.requests.pop(rid).record)
        return {"finished_request_records": done}

    def suspend(self) -> None:
        self.events.append("suspend")
        for entry in self.requests.values():
            entry.record.requests.append(Part(entry.record.request_id))

    def resume(self) -> None:
        self.events.append("resume")
        self._allocate()


def test_the_step_loop_runs_the_hook_before_every_step_and_keeps_the_prompt_order() -> None:
    engine, seen = Engine(length=3), []
    out = inference.generate_dynamic(engine, [[1, 5], [1, 6]], 2, 3, 1.0, lambda: seen.append(engine.steps))
    assert seen == [0, 1, 2]
    assert [[s.token_ids for s in g] for g in out] == [[[0, 1, 2], [100, 101, 102]], [[200, 201, 202], [300, 301, 302]]]
    assert [s.request_id for g in out for s in g] == [0, 1, 2, 3]


@pytest.mark.parametrize("fails", [False, True])
def test_after_a_hold_the_controller_reads_the_request_metadata_resume_allocated(fails: bool) -> None:
    """megatron-core's ``resume`` allocates the context's metadata anew while its controller
    keeps the on-device tensors it took at construction; compared with that stale
    termination-id tensor, sampled tokens ended samples early (bench/engine_history_gpu.py). After a hold,
    whether its body succeeded or not, the controller reads the context's current ones."""
    engine = Engine()
    host_copy = engine.controller._request_metadata["temperature"]
    with contextlib.suppress(RuntimeError), inference.requests_held(engine):
        if fails:
            raise RuntimeError("half-loaded")
    assert engine.events[-2:] == (["resume", "reset"] if fails else ["suspend", "resume"])
    held = engine.controller._request_metadata
    assert held["termination_id"] is engine.context.request_metadata["termination_id"]
    assert held["temperature"] is host_copy  # the controller's own host copy stays its own


def test_a_refit_in_flight_holds_the_requests_and_marks_where_each_goes_on() -> None:
    engine = Engine(length=4)
    worker = MegatronGenerationWorker(0, 1)
    worker.engine, worker.engine_kind, worker.loaded_version = engine, "dynamic", 10

    def land() -> None:
        if engine.steps == 2 and "suspend" not in engine.events:
            with worker._new_weights(11):
                assert engine.events[-1] == "suspend"
                worker.loaded_version = 11

    groups = inference.generate_dynamic(engine, [[1]], 2, 4, 1.0, land)
    assert engine.events[-2:] == ["suspend", "resume"]
    versions = [worker._versions(s.request_id, len(s.token_ids), 10) for s in groups[0]]
    assert versions == [[10, 10, 11, 11], [10, 10, 11, 11]]
    assert [s.token_ids for s in groups[0]] == [[0, 1, 2, 3], [100, 101, 102, 103]]  # the parts merged


def test_a_load_that_fails_in_flight_drops_the_requests_and_the_call_fails() -> None:
    engine = Engine(length=4)
    worker = MegatronGenerationWorker(0, 1)
    worker.engine, worker.engine_kind = engine, "dynamic"

    def fail() -> None:
        if engine.steps == 1:
            with pytest.raises(OSError, match="half"), worker._new_weights(11):
                raise OSError("half loaded")

    with pytest.raises(RuntimeError, match="finished 0 of 2 requests"):
        inference.generate_dynamic(engine, [[1]], 2, 4, 1.0, fail)
    assert worker.refit_aborts == 1
    held = engine.events[engine.events.index("suspend"):]
    assert held[:3] == ["suspend", "resume", "reset"] and not engine.requests  # resumed, then dropped
    assert worker._landed == {}


def test_between_calls_a_refit_drops_the_engines_state() -> None:
    engine = Engine()
    worker = MegatronGenerationWorker(0, 1)
    worker.engine, worker.engine_kind = engine, "dynamic"
    with worker._new_weights(3):
        pass
    assert engine.events[-1] == "reset" and "suspend" not in engine.events


class _Call:
    def __init__(self, sent: list, method: str, group: str | None = None) -> None:
        self.sent, self.method, self.group = sent, method, group

    def options(self, concurrency_group: str) -> _Call:
        return _Call(self.sent, self.method, concurrency_group)

    def remote(self, *args: Any) -> str:
        self.sent.append((self.method, self.group))
        return "ref"


class _Actor:
    def __init__(self, sent: list) -> None:
        self.sent = sent

    def __getattr__(self, method: str) -> _Call:
        return _Call(self.sent, method)


@pytest.mark.parametrize("inflight", [True, False])
def test_refit_calls_go_to_the_refit_thread_only_where_the_workers_take_refits_in_flight(
    inflight: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handle's side of it: receive_weights, open_refit_channel and weight_version reach
    an in-flight worker's refit thread (a generate in flight does not hold them up); every
    other call, and every call to an ordinary worker, goes to the default thread in order."""
    from rlcore.runtime.worker_group import REFIT_GROUP
    from rlcore_megatron.handle import MegatronGeneration

    sent: list = []
    group = SimpleNamespace(actors=[_Actor(sent)], world_size=1, name="generation",
                            refit_group=REFIT_GROUP if inflight else None,
                            get=lambda refs, what="": [0] * len(refs))
    layout = [{"rank": 0, "dp_rank": 0, "tp_rank": 0}]
    handle = MegatronGeneration(group, device_type="cuda", specs=[], layout=layout)  # type: ignore[arg-type]
    handle._check_open = lambda: None  # type: ignore[method-assign]
    handle._submit("generate", [[1]], None)
    handle.open_refit_channel("spec")
    monkeypatch.setattr("ray.put", lambda value: value)  # no cluster here
    handle.receive_weights("spec", 1, [])
    handle.weight_versions()
    refit = REFIT_GROUP if inflight else None
    assert sent == [("generate", None), ("open_refit_channel", refit), ("receive_weights", refit),
                    ("weight_version", refit)]

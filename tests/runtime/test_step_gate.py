"""rlcore.runtime.step_gate: a job queued while a call drives the engine runs between two of
its steps on the call's thread; with no call, at once on its own thread; a call that drives
may drive again inside (a generate that wakes the engine); a failing job reaches its own
caller and lets the engine go; jobs queued after the last step run before the call returns."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rlcore.runtime.step_gate import StepGate
from rlcore.testing.waits import wait_for


def _thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def _call(gate: StepGate, steps: int, hold_at: int, held: threading.Event, go: threading.Event,
          trace: list[Any]) -> str:
    with gate.driving():
        for i in range(steps):
            gate.between_steps()
            trace.append(("step", i))
            if i == hold_at:
                held.set()
                assert go.wait(60)
    return "done"


def test_a_job_runs_between_two_steps_on_the_calls_thread() -> None:
    gate, held, go, trace = StepGate(), threading.Event(), threading.Event(), []
    call, result = _thread(lambda: _call(gate, 4, 1, held, go, trace))
    assert held.wait(60)
    job, ran = _thread(lambda: gate.run(lambda: (trace.append("job"), threading.current_thread() is call)[1]))
    assert wait_for(lambda: gate.queued == 1, timeout_s=60)  # queued while the call steps
    go.set()
    call.join(60)
    job.join(60)
    assert ran == [True] and result == ["done"]
    assert trace == [("step", 0), ("step", 1), "job", ("step", 2), ("step", 3)]


def test_with_no_call_a_job_runs_at_once_and_a_failure_frees_the_engine() -> None:
    gate = StepGate()
    me = threading.current_thread()
    assert gate.run(lambda: threading.current_thread() is me) is True
    with pytest.raises(ValueError, match="bad load"):
        gate.run(lambda: (_ for _ in ()).throw(ValueError("bad load")))
    with gate.driving():
        pass  # not left held by the failed job


def test_a_call_drives_again_inside_and_runs_its_own_jobs_at_once() -> None:
    gate, order = StepGate(), []
    with gate.driving():
        with gate.driving():  # generate -> wake, both gated
            order.append("inner")
        assert gate.run(lambda: order.append("own job") or "ran") == "ran"  # no deadlock
        order.append("outer")
    assert order == ["inner", "own job", "outer"]
    # Released: another thread drives now.
    t, out = _thread(lambda: gate.run(lambda: "other"))
    t.join(60)
    assert out == ["other"]


def test_a_job_queued_after_the_last_step_runs_before_the_call_returns() -> None:
    gate = StepGate()
    entered, leave, ran = threading.Event(), threading.Event(), []

    def call() -> None:
        with gate.driving():
            entered.set()
            assert leave.wait(60)  # no more steps: only the release is left

    c, _ = _thread(call)
    assert entered.wait(60)
    j, _ = _thread(lambda: gate.run(lambda: ran.append(threading.current_thread() is c)))
    assert wait_for(lambda: gate.queued == 1, timeout_s=60)
    leave.set()
    c.join(60)
    j.join(60)
    assert ran == [True]

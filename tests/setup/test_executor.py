"""The DAG executor: start-on-ready, cancellation, deadlines, teardown, overhead."""

from __future__ import annotations

import threading
import time

import pytest

from rlcore.errors import (
    Cancelled,
    CancelToken,
    Deadline,
    DeadlineExceeded,
    PlanError,
    SetupError,
    wait_until,
)
from rlcore.setup.events import EventBoard
from rlcore.setup.executor import ExecutionResult, TaskRun, TaskSpec, execute


class Boom(RuntimeError):
    pass


class Resource:
    """Something a task starts; records its shutdowns in a shared log."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.log.append(self.name)


def starts(name: str, log: list[str], sleep_s: float = 0.0):
    def run(run: TaskRun) -> Resource:
        if sleep_s:
            run.cancel.sleep(sleep_s)
            run.cancel.raise_if_cancelled(name)
        return Resource(name, log)

    return run


def fails(after_s: float = 0.0, exc: BaseException | None = None):
    def run(run: TaskRun) -> None:
        time.sleep(after_s)
        raise exc or Boom("injected")

    return run


def shut(res: Resource) -> None:
    res.shutdown()


# -- scheduling -----------------------------------------------------------------


def test_dependent_starts_the_moment_its_dependency_ends(leaks) -> None:
    log: list[str] = []
    tasks = [
        TaskSpec("a", [], starts("a", log, 0.1), shut),
        TaskSpec("b", ["a"], starts("b", log), shut),
        TaskSpec("c", ["b"], starts("c", log), shut),
    ]
    res = execute(tasks)
    r = res.records
    assert [x.status for x in r.values()] == ["ok", "ok", "ok"]
    # Order, not latency (a timing claim: the perf tests at the end of this file).
    assert r["a"].end <= r["b"].start and r["b"].end <= r["c"].start
    assert res.completed == ["a", "b", "c"]
    res.shutdown()


def test_independent_tasks_overlap(leaks) -> None:
    # Each task holds until all three have started: only overlapping runs can finish.
    log: list[str] = []
    started = threading.Barrier(3, timeout=60)

    def together(name: str):
        def run(run: TaskRun) -> Resource:
            started.wait()
            return Resource(name, log)

        return run

    res = execute([TaskSpec(n, [], together(n), shut) for n in "abc"])
    r = res.records
    assert max(x.start for x in r.values()) < min(x.end for x in r.values())
    res.shutdown()


def test_diamond_waits_for_all_dependencies(leaks) -> None:
    log: list[str] = []
    tasks = [
        TaskSpec("top", [], starts("top", log), shut),
        TaskSpec("fast", ["top"], starts("fast", log, 0.01), shut),
        TaskSpec("slow", ["top"], starts("slow", log, 0.15), shut),
        TaskSpec("join", ["fast", "slow"], starts("join", log), shut),
    ]
    res = execute(tasks)
    r = res.records
    assert r["join"].start >= r["slow"].end and r["join"].start >= r["fast"].end
    assert set(res.results) == {"top", "fast", "slow", "join"}
    res.shutdown()


def test_success_shutdown_is_reverse_order_and_idempotent(leaks) -> None:
    log: list[str] = []
    tasks = [
        TaskSpec("a", [], starts("a", log), shut),
        TaskSpec("b", ["a"], starts("b", log), shut),
        TaskSpec("c", ["b"], starts("c", log), shut),
    ]
    res = execute(tasks)
    assert res.shutdown() == []
    assert log == ["c", "b", "a"]
    assert res.shutdown() == []
    assert log == ["c", "b", "a"]
    assert res.shut_down == ["c", "b", "a"]


def test_on_event_reports_progress(leaks) -> None:
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def on_event(task: str, what: str) -> None:
        with lock:
            seen.append((task, what))

    tasks = [
        TaskSpec("a", [], lambda r: 1),
        TaskSpec("b", ["a"], fails()),
        TaskSpec("c", ["b"], lambda r: 3),
    ]
    with pytest.raises(SetupError):
        execute(tasks, on_event=on_event)
    assert seen == [
        ("a", "start"),
        ("a", "end"),
        ("b", "start"),
        ("b", "failed"),
        ("c", "not_started"),
    ]


def test_bad_graphs_are_plan_errors() -> None:
    noop = lambda r: None  # noqa: E731
    with pytest.raises(PlanError, match="cycle"):
        execute([TaskSpec("a", ["b"], noop), TaskSpec("b", ["a"], noop)])
    with pytest.raises(PlanError, match="unknown task 'x'"):
        execute([TaskSpec("a", ["x"], noop)])
    with pytest.raises(PlanError, match="twice"):
        execute([TaskSpec("a", [], noop), TaskSpec("a", [], noop)])


# -- failure path ---------------------------------------------------------------


def test_first_failure_cancels_waiters_and_skips_unstarted(leaks) -> None:
    cancel = CancelToken()
    board = EventBoard(cancel)
    woke: dict[str, float] = {}

    def event_waiter(run: TaskRun) -> None:
        try:
            board.wait("never", Deadline(30), waiter="ev")
        finally:
            woke["ev"] = time.monotonic()

    def poll_waiter(run: TaskRun) -> None:
        try:
            wait_until(lambda: None, what="nothing", cancel=run.cancel, deadline=run.deadline)
        finally:
            woke["poll"] = time.monotonic()

    tasks = [
        TaskSpec("bad", [], fails(0.05), label={"backend": "fake", "role": "policy"}),
        TaskSpec("ev", [], event_waiter),
        TaskSpec("poll", [], poll_waiter),
        TaskSpec("after", ["bad"], lambda r: None),
    ]
    with pytest.raises(SetupError) as info:
        execute(tasks, cancel=cancel, on_cancel=lambda reason: board.wake_all())
    err = info.value
    assert err.task == "bad" and err.backend == "fake" and err.role == "policy"
    assert isinstance(err.cause, Boom)
    assert sorted(err.aborted) == ["after", "ev", "poll"]
    recs = err.execution.records
    assert recs["ev"].status == "cancelled"
    assert recs["poll"].status == "cancelled"
    assert recs["after"].status == "not_started"
    assert recs["after"].start is None
    # Woken by the failure, not by their own 30 s / setup deadlines (latency: the perf tests).
    assert woke["ev"] >= recs["bad"].end and woke["poll"] >= recs["bad"].end
    assert "bad (fake) failed" in (cancel.reason or "")


def test_failure_shuts_down_started_in_reverse_completion_order(leaks) -> None:
    # Completion order a, c, b forced by the executor's own "end" events (no sleeps),
    # then "bad" fails.
    log: list[str] = []
    done = {n: threading.Event() for n in "acb"}

    def after(name: str, prev: str | None):
        def run(run: TaskRun) -> Resource:
            if prev is not None:
                assert done[prev].wait(60), f"{prev} never finished"
            return Resource(name, log)

        return run

    def bad(run: TaskRun) -> None:
        assert done["b"].wait(60)
        raise Boom("injected")

    tasks = [
        TaskSpec("a", [], after("a", None), shut),
        TaskSpec("b", [], after("b", "c"), shut),
        TaskSpec("c", ["a"], after("c", None), shut),
        TaskSpec("bad", [], bad),
        TaskSpec("d", ["bad"], starts("d", log), shut),
    ]

    def on_event(task: str, what: str) -> None:
        if what == "end" and task in done:
            done[task].set()

    with pytest.raises(SetupError) as info:
        execute(tasks, on_event=on_event)
    # a ended first, then c, then b: shut down b, c, a.
    assert log == ["b", "c", "a"]
    assert info.value.shut_down == ["b", "c", "a"]
    assert info.value.aborted == ["d"]


def test_root_cause_is_reported_not_the_secondary_cancellation(leaks) -> None:
    def waits_then_raises_other(run: TaskRun) -> None:
        run.cancel.sleep(10)
        raise RuntimeError("peer went away")

    tasks = [
        TaskSpec("victim", [], waits_then_raises_other),
        TaskSpec("culprit", [], fails(0.05, ValueError("the real problem"))),
    ]
    with pytest.raises(SetupError) as info:
        execute(tasks)
    assert info.value.task == "culprit"
    assert isinstance(info.value.cause, ValueError)
    assert "the real problem" in str(info.value)
    assert info.value.execution.records["victim"].status == "failed"


def test_task_deadline_times_out_and_names_the_task(leaks, wait_for) -> None:
    log: list[str] = []
    release = threading.Event()

    def stubborn(run: TaskRun) -> Resource:
        release.wait(60)  # ignores cancel and deadline
        return Resource("stubborn", log)

    tasks = [
        TaskSpec("stubborn", [], stubborn, shut, deadline_s=0.1, label={"backend": "slowpoke"}),
        TaskSpec("other", [], starts("other", log, 0.01), shut),
    ]
    with pytest.raises(SetupError) as info:
        execute(tasks)
    err = info.value
    assert err.task == "stubborn" and err.backend == "slowpoke"
    assert isinstance(err.cause, DeadlineExceeded)
    assert "stubborn" in str(err.cause) and "0.1s" in str(err.cause)
    rec = err.execution.records["stubborn"]
    assert rec.status == "timed_out" and rec.abandoned
    assert log == ["other"]  # returned while the stubborn task still held on
    # It finishes late: what it started is shut down at once, not leaked.
    release.set()
    assert wait_for(lambda: log == ["other", "stubborn"], 2.0)


def test_a_wait_that_hits_its_deadline_is_timed_out(leaks) -> None:
    board = EventBoard(CancelToken())

    def waiter(run: TaskRun) -> None:
        board.wait("never", run.deadline, waiter="waiter")

    with pytest.raises(SetupError) as info:
        execute([TaskSpec("waiter", [], waiter, deadline_s=5)], deadline=Deadline(0.1, "setup"))
    err = info.value
    assert err.execution.records["waiter"].status == "timed_out"
    assert isinstance(err.cause, DeadlineExceeded)


def test_abandoned_after_grace_and_late_result_shut_down(leaks, wait_for) -> None:
    log: list[str] = []
    release = threading.Event()

    def deaf(run: TaskRun) -> Resource:
        release.wait(60)  # never looks at run.cancel
        return Resource("deaf", log)

    tasks = [TaskSpec("deaf", [], deaf, shut), TaskSpec("bad", [], fails(0.02))]
    with pytest.raises(SetupError) as info:
        execute(tasks, grace_s=0.2)
    rec = info.value.execution.records["deaf"]
    assert rec.status == "cancelled" and rec.abandoned
    assert "abandoned" in str(rec.error)
    assert info.value.aborted == ["deaf"]
    assert log == []  # returned while the deaf task still held on
    release.set()
    assert wait_for(lambda: log == ["deaf"], 2.0)


def test_hung_shutdown_is_reported_not_waited_on(leaks) -> None:
    log: list[str] = []
    unblock = threading.Event()

    def hangs(res: Resource) -> None:
        unblock.wait(60)
        log.append("hang over")

    tasks = [
        TaskSpec("first", [], starts("first", log), shut),
        TaskSpec("hangs", ["first"], starts("hangs", log), hangs, label={"backend": "sticky"}),
        TaskSpec("bad", ["hangs"], fails()),
    ]
    with pytest.raises(SetupError) as info:
        execute(tasks, shutdown_timeout_s=0.1)
    err = info.value
    assert err.shut_down == ["first"]
    assert len(err.shutdown_errors) == 1
    assert "hangs (sticky)" in err.shutdown_errors[0] and "did not return" in err.shutdown_errors[0]
    assert log == ["first"]  # the next shutdown still ran
    unblock.set()


def test_raising_shutdown_is_reported_and_others_still_run(leaks) -> None:
    log: list[str] = []

    def raises(res: Resource) -> None:
        raise OSError("port busy")

    tasks = [
        TaskSpec("a", [], starts("a", log), shut),
        TaskSpec("b", ["a"], starts("b", log), raises),
        TaskSpec("bad", ["b"], fails()),
    ]
    with pytest.raises(SetupError) as info:
        execute(tasks)
    assert log == ["a"]
    assert "OSError: port busy" in info.value.shutdown_errors[0]
    assert "shutdown error" in str(info.value)


def test_resource_declared_started_is_shut_down_when_the_task_fails(leaks) -> None:
    log: list[str] = []

    def half_way(run: TaskRun) -> None:
        run.started(Resource("half", log))
        raise Boom("after starting")

    def on_done_fails(res: Resource) -> None:
        raise Boom("on_done")

    tasks = [
        TaskSpec("half", [], half_way, shut),
        TaskSpec("posted", [], starts("posted", log), shut, on_done=on_done_fails),
    ]
    with pytest.raises(SetupError):
        execute(tasks)
    assert sorted(log) == ["half", "posted"]


def test_resource_both_declared_and_returned_is_shut_down_once(leaks) -> None:
    log: list[str] = []

    def both(run: TaskRun) -> Resource:
        res = Resource("both", log)
        run.started(res)
        return res

    tasks = [TaskSpec("both", [], both, shut), TaskSpec("bad", ["both"], fails())]
    with pytest.raises(SetupError):
        execute(tasks)
    assert log == ["both"]


def test_external_cancel_stops_everything(leaks) -> None:
    cancel = CancelToken()
    log: list[str] = []
    tasks = [
        TaskSpec("a", [], starts("a", log), shut),
        TaskSpec("b", ["a"], starts("b", log, 60), shut),
        TaskSpec("c", ["b"], starts("c", log), shut),
    ]
    threading.Timer(0.1, cancel.cancel, args=("user pressed Ctrl-C",)).start()
    with pytest.raises(SetupError) as info:
        execute(tasks, cancel=cancel)
    err = info.value
    assert err.task == "setup" and isinstance(err.cause, Cancelled)
    assert "Ctrl-C" in str(err)
    assert log == ["a"]
    assert sorted(err.aborted) == ["b", "c"]


def test_cancelled_before_start_starts_nothing() -> None:
    cancel = CancelToken()
    cancel.cancel("too late")
    ran: list[str] = []
    with pytest.raises(SetupError):
        execute([TaskSpec("a", [], lambda r: ran.append("a"))], cancel=cancel)
    assert ran == []


# -- timing claims (perf: not in the default suite; `pytest -m perf`) ------------------


@pytest.mark.perf
@pytest.mark.parametrize(
    ("test", "low_s", "high_s"),
    [
        ("test_task_deadline_times_out_and_names_the_task", 0.0, 0.5),
        ("test_abandoned_after_grace_and_late_result_shut_down", 0.2, 0.6),
        ("test_hung_shutdown_is_reported_not_waited_on", 0.0, 0.6),
        ("test_external_cancel_stops_everything", 0.0, 0.5),
        ("test_first_failure_cancels_waiters_and_skips_unstarted", 0.0, 1.0),
    ],
)
def test_failure_paths_take_fractions_of_a_second(test: str, low_s: float, high_s: float) -> None:
    """The failure-path tests above, timed whole: each returns within its bound (the
    bound the executor is built for: deadlines, grace and shutdown timeouts of 0.1-0.2 s)."""
    from conftest import LeakCheck

    from rlcore.testing.waits import wait_for

    fn = globals()[test]
    args = {"leaks": LeakCheck(), "wait_for": wait_for}
    t0 = time.monotonic()
    fn(**{k: v for k, v in args.items() if k in fn.__code__.co_varnames[: fn.__code__.co_argcount]})
    assert low_s <= time.monotonic() - t0 < high_s


@pytest.mark.perf
def test_dependents_start_within_50ms_and_overlap_in_parallel() -> None:
    log: list[str] = []
    res = execute([
        TaskSpec("a", [], starts("a", log, 0.1), shut),
        TaskSpec("b", ["a"], starts("b", log), shut),
        TaskSpec("c", ["b"], starts("c", log), shut),
    ])
    r = res.records
    assert r["b"].start - r["a"].end < 0.05 and r["c"].start - r["b"].end < 0.05
    res.shutdown()
    t0 = time.monotonic()
    res = execute([TaskSpec(n, [], starts(n, log, 0.2), shut) for n in "abc"])
    assert time.monotonic() - t0 < 0.35
    res.shutdown()


@pytest.mark.perf
def test_overhead_per_task_is_small() -> None:
    n = 200
    chain = [TaskSpec(f"t{i}", [f"t{i - 1}"] if i else [], lambda r: None) for i in range(n)]
    best = min(_timed(chain) for _ in range(3))
    assert best / n < 0.002, f"{best / n * 1e3:.3f} ms per chained task"
    wide = [TaskSpec(f"w{i}", [], lambda r: None) for i in range(n)]
    best = min(_timed(wide) for _ in range(3))
    assert best / n < 0.002, f"{best / n * 1e3:.3f} ms per parallel task"


def _timed(tasks: list[TaskSpec]) -> float:
    t0 = time.perf_counter()
    res = execute(tasks)
    assert isinstance(res, ExecutionResult) and res.ok
    return time.perf_counter() - t0

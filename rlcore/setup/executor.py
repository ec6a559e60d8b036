"""A generic, event-driven DAG executor with cancellation, deadlines and teardown.

Each task runs in its own daemon thread and starts the moment its last
dependency finishes: worker threads report completion on a queue, and the
scheduler loop (in the calling thread) blocks on that queue, waking only for a
completion, the nearest deadline, or the end of the cancellation grace period.

The failure path is the point of this module:

* the first failure (an exception, or a task past its deadline) sets the run's
  :class:`~rlcore.errors.CancelToken` with a reason naming the task, and calls
  ``on_cancel`` (so event boards wake their waiters at once);
* tasks not yet started are never started (``not_started``); running tasks are
  expected to observe the token (their waits raise :class:`Cancelled`);
* the executor waits at most ``grace_s`` for them, then abandons the rest. An
  abandoned task's thread is a daemon; if it returns later, whatever it started
  is shut down right there, so no backend is leaked;
* everything that was started is shut down in reverse order of completion, each
  shutdown bounded by ``shutdown_timeout_s`` (a hung shutdown is reported, not
  waited on forever);
* :class:`~rlcore.errors.SetupError` is raised for the root cause, never for a
  secondary :class:`Cancelled`.

There is deliberately no ``ThreadPoolExecutor``: its shutdown joins every
worker, so one stuck task would hang the failure path it is meant to report.

The executor knows nothing about rlcore's roles or backends: a task's ``label``
(``{"backend": ..., "role": ...}``) is only copied into error messages.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlcore.errors import Cancelled, CancelToken, Deadline, DeadlineExceeded, PlanError, SetupError
from rlcore.setup.graph import topological_order

log = logging.getLogger(__name__)

Status = Literal["ok", "failed", "cancelled", "timed_out", "not_started"]

#: How often the scheduler checks a cancel token set from outside (e.g. Ctrl-C
#: handling in the CLI). Completions and deadlines never wait for this tick.
_EXTERNAL_CANCEL_POLL_S = 0.02
#: A task gets this long past its deadline to raise its own DeadlineExceeded (whose
#: message names what it was waiting for) before the executor abandons it.
_DEADLINE_SLACK_S = 0.2


@dataclass
class TaskSpec:
    """One task of the DAG.

    Attributes:
        name: unique task name.
        deps: names of the tasks that must finish (successfully) before this one starts.
        run: the work; receives a :class:`TaskRun` and returns the task's result
            (e.g. a started backend's handle).
        shutdown: releases a result of ``run`` (or a resource passed to
            :meth:`TaskRun.started`). ``None``: the result holds nothing to release.
        deadline_s: seconds the task may run, counted from its start; the overall
            deadline of :func:`execute` applies too. ``None``: only the overall one.
        on_done: called with the result in the task's thread right after ``run``
            returns, before any dependent starts (e.g. to post an event). If it
            raises, the task fails and its result is shut down.
        label: copied into errors and events, e.g. ``{"backend": "vllm", "role": "generation"}``.
    """

    name: str
    deps: Sequence[str]
    run: Callable[[TaskRun], Any]
    shutdown: Callable[[Any], None] | None = None
    deadline_s: float | None = None
    on_done: Callable[[Any], None] | None = None
    label: Mapping[str, Any] = field(default_factory=dict)


class TaskRun:
    """What a running task gets: its name, the run's cancel token, its deadline."""

    __slots__ = ("name", "cancel", "deadline", "_slot")

    def __init__(self, name: str, cancel: CancelToken, deadline: Deadline, slot: _Slot) -> None:
        self.name = name
        self.cancel = cancel
        self.deadline = deadline
        self._slot = slot

    def started(self, resource: Any) -> None:
        """Declare that this task has started ``resource``.

        If the task then raises (or is abandoned), the executor shuts
        ``resource`` down with the task's ``shutdown`` function, exactly once. If
        the task returns normally, its result is taken to own everything it
        started and only the result is shut down later. Use it when something
        between starting a resource and returning it may raise (e.g. a hook
        wrapper that fails after the backend's init returned).
        """
        self._slot.hold(resource)


@dataclass
class TaskRecord:
    """What happened to one task. Times are ``time.monotonic()``; ``*_wall`` are epoch seconds."""

    name: str
    status: Status = "not_started"
    start: float | None = None
    end: float | None = None
    start_wall: float | None = None
    end_wall: float | None = None
    error: BaseException | None = None
    #: True if the executor stopped waiting for the task's thread (deadline or grace).
    abandoned: bool = False
    label: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start


@dataclass
class _Teardown:
    name: str
    label: Mapping[str, Any]
    shutdown: Callable[[Any], None]
    resource: Any


@dataclass
class ExecutionResult:
    """The outcome of :func:`execute`.

    Attributes:
        records: one :class:`TaskRecord` per task, in the order the tasks were given.
        results: what each successful task returned.
        start, end: monotonic time of the first start and of the executor's return.
        start_wall: epoch seconds at ``start`` (for traces).
        completed: tasks in the order they finished successfully.
        shut_down: tasks whose results have been shut down (failure path, or :meth:`shutdown`).
        shutdown_errors: one line per shutdown that raised or hung.
    """

    records: dict[str, TaskRecord]
    results: dict[str, Any]
    start: float
    end: float
    start_wall: float
    completed: list[str] = field(default_factory=list)
    shut_down: list[str] = field(default_factory=list)
    shutdown_errors: list[str] = field(default_factory=list)
    _teardown: list[_Teardown] = field(default_factory=list, repr=False)
    _shutdown_timeout_s: float = field(default=60.0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.records.values())

    def wall(self, t: float) -> float:
        """Epoch seconds of the monotonic time ``t``."""
        return self.start_wall + (t - self.start)

    def replace_started(self, name: str, resource: Any) -> Any:
        """Put ``resource`` in the place of what task ``name`` started (a backend started
        again after it lost a worker): teardown shuts the new one down, in the old one's
        turn. Returns the old resource (``None`` if the task held none)."""
        with self._lock:
            for item in self._teardown:
                if item.name == name:
                    old, item.resource = item.resource, resource
                    self.results[name] = resource
                    return old
        raise KeyError(f"task {name!r} holds nothing to replace (not started, or shut down)")

    def shutdown(self, timeout_s: float | None = None) -> list[str]:
        """Shut down every started result in reverse order of completion.

        Idempotent: a second call does nothing. Each shutdown is bounded by
        ``timeout_s`` (default: the executor's ``shutdown_timeout_s``). Returns
        the errors (raised or hung shutdowns), one line each.
        """
        with self._lock:
            items, self._teardown = self._teardown, []
        if not items:
            return []
        done, errors = shutdown_in_reverse(
            items, self._shutdown_timeout_s if timeout_s is None else timeout_s
        )
        self.shut_down += done
        self.shutdown_errors += errors
        return errors


def _describe(name: str, label: Mapping[str, Any]) -> str:
    backend = label.get("backend")
    return f"{name} ({backend})" if backend else name


def call_bounded(
    fn: Callable[[], Any], timeout_s: float, *, name: str
) -> tuple[bool, BaseException | None]:
    """Run ``fn`` in a daemon thread; wait at most ``timeout_s``.

    Returns ``(finished, error)``; ``finished`` is False if ``fn`` was still
    running at the timeout (its thread is left behind as a daemon).
    """
    box: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            box.append(e)

    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    t.join(max(0.0, timeout_s))
    if t.is_alive():
        return False, None
    return True, (box[0] if box else None)


def shutdown_in_reverse(
    items: Sequence[_Teardown], timeout_s: float
) -> tuple[list[str], list[str]]:
    """Shut down ``items`` last-first, each bounded by ``timeout_s``.

    Returns (names shut down, error lines). A raised or hung shutdown is
    reported and the next one still runs.
    """
    done: list[str] = []
    errors: list[str] = []
    for item in reversed(items):
        who = _describe(item.name, item.label)
        finished, error = call_bounded(
            lambda item=item: item.shutdown(item.resource),
            timeout_s,
            name=f"rlcore-shutdown-{item.name}",
        )
        if not finished:
            errors.append(f"{who}: shutdown did not return within {timeout_s:g}s (abandoned)")
            log.error("shutdown of %s hung for %.3gs; abandoned", who, timeout_s)
        elif error is not None:
            errors.append(f"{who}: shutdown raised {type(error).__name__}: {error}")
            log.error("shutdown of %s raised %r", who, error)
        else:
            done.append(who)
    return done, errors


class _Slot:
    """Runtime state of one task, shared by its worker thread and the scheduler."""

    __slots__ = (
        "spec",
        "record",
        "state",
        "lock",
        "held",
        "claimed",
        "deadline_at",
        "deadline",
        "remaining_deps",
        "dependents",
    )

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.record = TaskRecord(spec.name, label=dict(spec.label))
        self.state = "pending"  # pending | running | finished | abandoned
        self.lock = threading.Lock()
        self.held: list[Any] = []
        self.claimed: list[Any] = []
        self.deadline_at: float | None = None
        self.deadline: Deadline | None = None
        self.remaining_deps = set(spec.deps)
        self.dependents: list[_Slot] = []

    def hold(self, resource: Any) -> None:
        with self.lock:
            late = self.state == "abandoned"
            if not late and not any(r is resource for r in self.held):
                self.held.append(resource)
        if late:
            _dispose_late(self, self.claim([resource]))

    def take_held(self) -> list[Any]:
        with self.lock:
            held, self.held = self.held, []
            return held

    def claim(self, resources: Sequence[Any]) -> list[Any]:
        """The resources not yet handed to a shutdown (by identity), now marked as handed."""
        out = []
        with self.lock:
            for res in resources:
                if res is None or any(c is res for c in self.claimed):
                    continue
                self.claimed.append(res)
                out.append(res)
        return out


def _dispose_late(slot: _Slot, resources: Sequence[Any]) -> None:
    """Shut down what an abandoned task produced after the executor gave up on it."""
    spec = slot.spec
    if spec.shutdown is None:
        return
    for res in resources:
        log.warning(
            "task %s was abandoned but finished later; shutting down what it started",
            _describe(spec.name, spec.label),
        )
        try:
            spec.shutdown(res)
        except BaseException as e:  # noqa: BLE001 - nobody is left to raise to
            log.error("late shutdown of %s raised %r", spec.name, e)


def _validate(tasks: Sequence[TaskSpec]) -> dict[str, _Slot]:
    slots: dict[str, _Slot] = {}
    for spec in tasks:
        if spec.name in slots:
            raise PlanError(f"task '{spec.name}' is given twice")
        slots[spec.name] = _Slot(spec)
    for slot in slots.values():
        for dep in slot.spec.deps:
            if dep not in slots:
                raise PlanError(f"task '{slot.spec.name}' depends on unknown task '{dep}'")
            slots[dep].dependents.append(slot)
    # Every task must be reachable in some topological order (a cycle would wait forever).
    topological_order(slots, {n: s.spec.deps for n, s in slots.items()})
    return slots


class _Executor:
    def __init__(
        self,
        tasks: Sequence[TaskSpec],
        *,
        cancel: CancelToken,
        deadline: Deadline,
        grace_s: float,
        shutdown_timeout_s: float,
        on_event: Callable[[str, str], None] | None,
        on_cancel: Callable[[str], None] | None,
    ) -> None:
        self.slots = _validate(tasks)
        self.cancel = cancel
        self.deadline = deadline
        self.grace_s = grace_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_event = on_event
        self.on_cancel = on_cancel
        self.queue: queue.SimpleQueue[tuple[_Slot, Any, BaseException | None, float]] = (
            queue.SimpleQueue()
        )
        self.running: dict[str, _Slot] = {}
        self.results: dict[str, Any] = {}
        self.completed: list[str] = []
        self.teardown: list[_Teardown] = []
        self.failure: _Slot | None = None
        self.cancel_seen_at: float | None = None
        self.t0 = time.monotonic()
        self.wall0 = time.time()

    # -- events --------------------------------------------------------------

    def emit(self, name: str, what: str) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(name, what)
        except Exception:  # a progress display must never break setup
            log.exception("on_event(%r, %r) raised; ignored", name, what)

    # -- starting and finishing tasks -----------------------------------------

    def start(self, slot: _Slot) -> None:
        spec = slot.spec
        deadline = self.deadline.sooner(spec.deadline_s, f"task '{spec.name}'")
        remaining = deadline.remaining()
        slot.deadline = deadline
        slot.deadline_at = (
            None if remaining is None else time.monotonic() + remaining + _DEADLINE_SLACK_S
        )
        slot.state = "running"
        self.running[spec.name] = slot
        run = TaskRun(spec.name, self.cancel, deadline, slot)
        threading.Thread(
            target=self.work, args=(slot, run), name=f"rlcore-task-{spec.name}", daemon=True
        ).start()

    def work(self, slot: _Slot, run: TaskRun) -> None:
        rec = slot.record
        rec.start = time.monotonic()
        rec.start_wall = self.wall0 + (rec.start - self.t0)
        self.emit(slot.spec.name, "start")
        result: Any = None
        error: BaseException | None = None
        try:
            result = slot.spec.run(run)
            if slot.spec.on_done is not None:
                slot.spec.on_done(result)
        except BaseException as e:  # noqa: BLE001 - reported through the queue
            error = e
        end = time.monotonic()
        with slot.lock:
            abandoned = slot.state == "abandoned"
            if not abandoned:
                slot.state = "finished"
        if abandoned:
            held = slot.take_held() if error is not None else []
            _dispose_late(slot, slot.claim([*held, result]))
            return
        self.queue.put((slot, result, error, end))

    def finish(self, slot: _Slot, result: Any, error: BaseException | None, end: float) -> None:
        spec, rec = slot.spec, slot.record
        del self.running[spec.name]
        rec.end = end
        rec.end_wall = self.wall0 + (end - self.t0)
        # A result owns what the task started; after a failure, what it declared started.
        held = slot.take_held() if error is not None else []
        if spec.shutdown is not None:
            for res in slot.claim([*held, result]):
                self.teardown.append(_Teardown(spec.name, spec.label, spec.shutdown, res))
        if error is None:
            rec.status = "ok"
            self.results[spec.name] = result
            self.completed.append(spec.name)
            self.emit(spec.name, "end")
            if not self.cancel.cancelled:
                for child in slot.dependents:
                    child.remaining_deps.discard(spec.name)
                    if not child.remaining_deps and child.state == "pending":
                        self.start(child)
            return
        rec.error = error
        if isinstance(error, Cancelled):
            rec.status = "cancelled"
        elif isinstance(error, DeadlineExceeded):
            rec.status = "timed_out"
        else:
            rec.status = "failed"
        self.emit(spec.name, rec.status)
        if isinstance(error, Cancelled) and self.cancel.cancelled:
            return  # a consequence of the cancellation, not a cause
        self.fail(slot, error)

    def fail(self, slot: _Slot, error: BaseException) -> None:
        if self.failure is not None or self.cancel.cancelled:
            return
        self.failure = slot
        who = _describe(slot.spec.name, slot.spec.label)
        reason = f"task {who} failed: {type(error).__name__}: {error}"
        log.error("%s; cancelling the other tasks", reason)
        self.cancel.cancel(reason)
        self.observe_cancel()

    def observe_cancel(self) -> None:
        if self.cancel_seen_at is not None or not self.cancel.cancelled:
            return
        self.cancel_seen_at = time.monotonic()
        if self.on_cancel is not None:
            try:
                self.on_cancel(self.cancel.reason or "cancelled")
            except Exception:
                log.exception("on_cancel raised; ignored")

    def abandon(self, slot: _Slot, status: Status, error: BaseException, now: float) -> bool:
        """Stop waiting for a running task. False if it finished meanwhile."""
        with slot.lock:
            if slot.state != "running":
                return False
            slot.state = "abandoned"
        held = slot.claim(slot.take_held())
        del self.running[slot.spec.name]
        rec = slot.record
        rec.status, rec.error, rec.abandoned = status, error, True
        rec.end = now
        rec.end_wall = self.wall0 + (now - self.t0)
        if slot.spec.shutdown is not None:
            for res in held:
                self.teardown.append(
                    _Teardown(slot.spec.name, slot.spec.label, slot.spec.shutdown, res)
                )
        self.emit(slot.spec.name, status)
        return True

    def check_deadlines(self, now: float) -> None:
        for slot in list(self.running.values()):
            if slot.deadline_at is None or now < slot.deadline_at:
                continue
            d = slot.deadline
            assert d is not None
            err = DeadlineExceeded(
                f"task '{slot.spec.name}' did not finish within its deadline "
                f"({d.what}: {d.seconds:g}s)"
            )
            if self.abandon(slot, "timed_out", err, now):
                self.fail(slot, err)

    # -- the loop -------------------------------------------------------------

    def next_wakeup(self, now: float) -> float | None:
        times = [s.deadline_at for s in self.running.values() if s.deadline_at is not None]
        if self.cancel_seen_at is not None:
            times.append(self.cancel_seen_at + self.grace_s)
        else:
            times.append(now + _EXTERNAL_CANCEL_POLL_S)
        return max(0.0, min(times) - now) if times else None

    def loop(self) -> None:
        self.observe_cancel()
        if self.cancel_seen_at is None:
            for slot in self.slots.values():
                if not slot.remaining_deps:
                    self.start(slot)
        while self.running:
            now = time.monotonic()
            try:
                item = self.queue.get(timeout=self.next_wakeup(now))
            except queue.Empty:
                item = None
            if item is not None:
                self.finish(*item)
                # Drain whatever else finished meanwhile without blocking.
                while True:
                    try:
                        self.finish(*self.queue.get_nowait())
                    except queue.Empty:
                        break
            now = time.monotonic()
            self.check_deadlines(now)
            self.observe_cancel()
            if self.cancel_seen_at is not None and now >= self.cancel_seen_at + self.grace_s:
                self.abandon_all(now)

    def abandon_all(self, now: float) -> None:
        for slot in list(self.running.values()):
            err = Cancelled(
                f"task '{slot.spec.name}' did not stop within {self.grace_s:g}s of cancellation "
                f"({self.cancel.reason}); abandoned"
            )
            self.abandon(slot, "cancelled", err, now)

    def result(self) -> ExecutionResult:
        for slot in self.slots.values():
            if slot.state == "pending":
                self.emit(slot.spec.name, "not_started")
        starts = [s.record.start for s in self.slots.values() if s.record.start is not None]
        start = min(starts, default=self.t0)
        return ExecutionResult(
            records={n: s.record for n, s in self.slots.items()},
            results=self.results,
            start=start,
            end=time.monotonic(),
            start_wall=self.wall0 + (start - self.t0),
            completed=self.completed,
            _teardown=self.teardown,
            _shutdown_timeout_s=self.shutdown_timeout_s,
        )

    def error(self, execution: ExecutionResult) -> SetupError:
        if self.failure is not None:
            slot = self.failure
            cause = slot.record.error
            assert cause is not None
            name, label = slot.spec.name, slot.spec.label
        else:
            name, label = "setup", {}
            cause = Cancelled(f"setup cancelled: {self.cancel.reason}")
        aborted = [
            _describe(n, r.label)
            for n, r in execution.records.items()
            if r.status != "ok" and n != name
        ]
        err = SetupError(
            task=name,
            backend=label.get("backend"),
            role=str(label.get("role") or name),
            cause=cause,
            aborted=aborted,
            shut_down=execution.shut_down,
            shutdown_errors=execution.shutdown_errors,
        )
        err.execution = execution  # type: ignore[attr-defined]
        return err


def execute(
    tasks: Sequence[TaskSpec],
    *,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
    grace_s: float = 5.0,
    shutdown_timeout_s: float = 60.0,
    on_event: Callable[[str, str], None] | None = None,
    on_cancel: Callable[[str], None] | None = None,
    interrupt_shutdown_s: float = 5.0,
) -> ExecutionResult:
    """Run ``tasks`` as a DAG, each the moment its dependencies are done.

    Args:
        tasks: the tasks; ``deps`` name other tasks in the list (no cycles).
        cancel: the run's token; set by the executor on the first failure, and
            observed if someone else sets it (within ~20 ms).
        deadline: overall deadline; each task's own ``deadline_s`` applies too. A
            task gets 0.2 s past its deadline to raise its own DeadlineExceeded;
            then it is abandoned and marked ``timed_out``.
        grace_s: how long running tasks get to stop after cancellation before
            they are abandoned.
        shutdown_timeout_s: bound on each shutdown on the failure path (and the
            default for :meth:`ExecutionResult.shutdown`).
        on_event: ``on_event(task, what)`` with ``what`` one of ``start``, ``end``,
            ``failed``, ``cancelled``, ``timed_out``, ``not_started``; called from
            worker threads and the scheduler, must be quick and thread-safe.
        on_cancel: called once with the reason when the token is set (e.g. to
            wake waiters that do not poll the token).
        interrupt_shutdown_s: bound on each shutdown when a ``KeyboardInterrupt``
            (SIGINT, SIGTERM under :class:`rlcore.app.interrupts.SignalGuard`) reaches the
            scheduler: running tasks are abandoned at once (they observe the token),
            started results are shut down, and the interrupt is re-raised carrying the
            :class:`ExecutionResult` as ``.execution`` (for the run's trace).

    Returns:
        The :class:`ExecutionResult`; the caller owns the started results and
        releases them with :meth:`ExecutionResult.shutdown`.

    Raises:
        SetupError: if any task failed or timed out, or the token was set. By
            then started results have been shut down (reverse order of
            completion); the error names the root-cause task, lists the aborted
            ones and carries the :class:`ExecutionResult` as ``.execution``.
        PlanError: duplicate names, unknown dependencies or a cycle.
    """
    cancel = cancel or CancelToken()
    ex = _Executor(
        tasks, cancel=cancel, deadline=deadline or Deadline.never("execution"), grace_s=grace_s,
        shutdown_timeout_s=shutdown_timeout_s, on_event=on_event, on_cancel=on_cancel,
    )
    execution = _scheduled(ex, cancel, min(shutdown_timeout_s, interrupt_shutdown_s))
    if ex.failure is None and not cancel.cancelled:
        return execution
    execution.shutdown()
    raise ex.error(execution)


def _scheduled(ex: _Executor, cancel: CancelToken, interrupt_shutdown_s: float) -> ExecutionResult:
    """``ex``'s scheduling loop to its end. A ``KeyboardInterrupt`` in the scheduler cancels,
    abandons the running tasks, shuts down what started (each bounded by
    ``interrupt_shutdown_s``) and is re-raised carrying the execution."""
    try:
        ex.loop()
    except BaseException as err:
        cancel.cancel(f"interrupted ({type(err).__name__}: {err})")
        ex.observe_cancel()
        ex.abandon_all(time.monotonic())
        execution = ex.result()
        execution.shutdown(interrupt_shutdown_s)
        err.execution = execution  # type: ignore[attr-defined]
        raise
    return ex.result()

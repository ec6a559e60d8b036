"""One engine, two threads: a refit lands between two steps of the call that drives it.

An engine worker that takes refits in flight (``EngineWorker.inflight_refit``) gets its
refit calls on a thread of their own while a generate runs on the default one. Engines
are not thread-safe, so the refit must not touch the engine while the call steps it.
:class:`StepGate` arbitrates:

* a call that runs the engine holds it for its whole length (:meth:`StepGate.driving`),
  and calls :meth:`StepGate.between_steps` between two of the engine's steps;
* another thread's job (:meth:`StepGate.run`) queued while a call drives runs there, on
  the call's thread, before the next step; with no call driving it runs at once on its
  own thread, and calls wait for it.

The worker's refit is such a job: it holds the engine's requests (the engine's own pause),
loads the weights, and lets them go on. Backends wire the engine's step loop to
:meth:`StepGate.between_steps` (vLLM's in-process ``LLM``, megatron-core's dynamic engine).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class StepGate:
    """Arbitrates one engine between the call that steps it and other threads' jobs
    (module doc). A thread that drives may drive again inside (a generate that wakes the
    engine through another gated method)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._driver: str | None = None  # "call" (a call steps the engine) or "job" (a job runs alone)
        self._owner: int | None = None  # the driving call's thread
        self._depth = 0
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []

    def run(self, job: Callable[[], T]) -> T:
        """``job()``'s result: run between two steps of the call that drives the engine, on
        its thread, or at once on this one when no call does (calls then wait for it). A
        call on this thread that drives the engine runs it at once. The wait is bounded by
        the caller's own deadline (a worker's refit call), not here."""
        if self._owner == threading.get_ident():  # only this thread sets or clears it to itself
            return job()
        done: Future[Any] | None = None
        with self._cv:
            self._cv.wait_for(lambda: self._driver != "job")
            if self._driver == "call":
                done = Future()
                self._jobs.append((job, done))
            else:
                self._driver = "job"
        if done is not None:
            return done.result()
        try:
            return job()
        finally:
            with self._cv:
                self._driver = None
                self._cv.notify_all()

    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """Hold the engine for a call; jobs queued meanwhile run at :meth:`between_steps`,
        and those queued after the last step run before the engine is let go."""
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                self._depth += 1
            else:
                self._cv.wait_for(lambda: self._driver is None)
                self._driver, self._owner, self._depth = "call", me, 1
        try:
            yield
        finally:
            with self._cv:
                self._depth -= 1
                outermost = self._depth == 0
            if outermost:
                # The last look for jobs and the release are one, so no job is left behind.
                while self._run_jobs(release_when_none=True):
                    pass

    def between_steps(self) -> bool:
        """Run the jobs queued so far (from the driving call's thread, between two steps);
        whether there were any."""
        return self._run_jobs()

    @property
    def queued(self) -> int:
        """Jobs waiting for the driving call's next step boundary."""
        with self._cv:
            return len(self._jobs)

    def _run_jobs(self, *, release_when_none: bool = False) -> bool:
        with self._cv:
            jobs, self._jobs = self._jobs, []
            if not jobs and release_when_none:
                self._driver, self._owner = None, None
                self._cv.notify_all()
        for job, done in jobs:
            try:
                done.set_result(job())
            except BaseException as err:  # handed to the job's thread
                done.set_exception(err)
        return bool(jobs)

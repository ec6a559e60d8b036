"""Rollouts generated ahead of the train step: the asynchronous loop's producer.

With ``grpo.max_staleness`` k >= 1 the rollouts of step s are generated while the
policy still trains earlier steps, by one producer thread, in step order. The
*gate* bounds how far ahead it runs: step s starts only once the refit of step
s - 1 - k has landed and been checked (:meth:`RolloutStream.release`), so every
sample of step s comes from weights at most k versions older than the policy
that trains on it (version = train steps in the weights; the initial ones are 0).

Why one thread and not asyncio: the handles are synchronous, every core wait
polls a cancel token, and Ray calls release the GIL. Why one producer: a
generation engine serves one call at a time anyway, and step order keeps each
step's seed and prompts what the synchronous loop would use.

Everything that changes the run's workers stays on the trainer's thread: a
producer's failure is handed to :meth:`RolloutStream.next` of its step, which
raises it there, so a lost generation is replaced (and refitted from a policy
that is not training) where the synchronous loop replaces it; the step is then
generated again. A failure of a call that began before the trainer's latest
recovery (its *generation epoch* moved on since: the call met the loss already
recovered from, or the replaced engine's handle shut down under it) is not raised:
the step is generated again at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlcore.errors import Cancelled
from rlcore.handles import Rollout

__all__ = ["RolloutStream", "StepRollouts"]

#: How often a waiting thread looks at cancellation and at the producer's health.
_SLICE_S = 0.2


@dataclass(frozen=True)
class StepRollouts:
    """One step's scored rollouts, as the producer made them.

    Attributes:
        step: the step they are for.
        groups: the env's groups of :class:`~rlcore.handles.Rollout`.
        version: the generation's weight version when the call began: no token of
            these samples is older (a sample's own ``versions`` may say more).
        started, ended: the call's :func:`time.monotonic` bounds.
    """

    step: int
    groups: list[list[Rollout]]
    version: int
    started: float
    ended: float

    @property
    def generate_s(self) -> float:
        return self.ended - self.started


@dataclass(frozen=True)
class _Failed:
    error: BaseException
    epoch: int  # the generation epoch when the failed call began


class RolloutStream:
    """The producer of rollouts ahead of the train step (module doc).

    Args:
        produce: ``produce(step)`` -> the env's groups for ``step``; no retry of its own.
        version: the generation's current weight version.
        epoch: how many generation recoveries the run has made.
        cancelled: whether the run is being stopped.
        max_staleness: k (>= 1): step s waits for the release of version s - 1 - k.
        last_step: the producer stops after it.
        span: ``span(name, start, end, step)`` for the trace (the producer's lane).
        retry: ``retry(fn, step)`` runs ``fn`` and, when it loses a generation worker,
            replaces it and runs ``fn`` again (the session's recovery); ``None``: no retry.
    """

    def __init__(
        self,
        produce: Callable[[int], list[list[Rollout]]],
        *,
        version: Callable[[], int],
        epoch: Callable[[], int],
        cancelled: Callable[[], bool],
        max_staleness: int,
        last_step: int,
        span: Callable[[str, float, float, int], None] | None = None,
        retry: Callable[[Callable[[], StepRollouts], int], StepRollouts] | None = None,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"a rollout stream runs ahead by max_staleness >= 1, got {max_staleness}")
        self._produce, self._version, self._epoch = produce, version, epoch
        self._cancelled, self._span = cancelled, span
        self._retry = retry or (lambda fn, step: fn())
        self.max_staleness, self.last_step = max_staleness, last_step
        self._cond = threading.Condition()
        self._released = version()  # the weights it starts from were checked (setup's refit, or a resume's)
        self._results: dict[int, StepRollouts | _Failed] = {}
        self._run = 0  # producer generation: results of an older one are dropped
        self._thread: threading.Thread | None = None
        self._closed = False
        self._gated_s = 0.0  # the producer's waits at the gate since take_gated_s

    # ---------------------------------------------------------------- the trainer's side

    def release(self, version: int) -> None:
        """The refit of ``version`` has landed and been checked: steps up to
        ``version + 1 + max_staleness`` may be generated."""
        with self._cond:
            self._released = max(self._released, version)
            self._cond.notify_all()

    def next(self, step: int) -> StepRollouts:
        """Step ``step``'s rollouts, once the producer has them (it is started on the first
        call). A generation worker lost by the producer's call is replaced here, on the
        caller's thread (``retry``), and the step generated again; a loss the run has
        recovered from since the call began is not recovered from twice. Any other failure
        of the call is raised.

        The wait is bounded by the producer's own calls (each has its deadline) and ends
        with :class:`~rlcore.errors.Cancelled` when the run is stopped."""
        return self._retry(lambda: self._take(step), step)

    def _take(self, step: int) -> StepRollouts:
        while True:
            got = self._wait_for(step)
            if isinstance(got, StepRollouts):
                return got
            # A call that began before the trainer's last recovery failed on the engine that
            # recovery replaced: the loss itself (WorkerLost), or the old handle shut down
            # under it. Either way it is the old engine's, already dealt with: generate again.
            stale = got.epoch < self._epoch()
            self._restart(step)
            if not stale:
                raise got.error

    def regenerate(self, step: int) -> StepRollouts:
        """Step ``step``'s rollouts generated again from the current weights (what the
        producer had for it and later steps is dropped)."""
        self._restart(step)
        return self.next(step)

    def take_gated_s(self) -> float:
        """Seconds the producer waited at the gate since the last call (it had generated
        as far ahead as ``max_staleness`` allows: the trainer was the slower side)."""
        with self._cond:
            gated, self._gated_s = self._gated_s, 0.0
            return gated

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the producer; its call in flight is not waited for beyond ``timeout_s``
        (the run's cancellation or teardown ends it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def __enter__(self) -> RolloutStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _restart(self, first: int) -> None:
        """Drop every result from ``first`` on and the producer that made them; the next
        :meth:`_wait_for` starts a new one at ``first``."""
        with self._cond:
            self._run += 1
            self._thread = None
            for s in [s for s in self._results if s >= first]:
                del self._results[s]

    def _ensure_producer(self, first: int) -> None:
        with self._cond:
            if self._thread is not None or self._closed:
                return
            run = self._run
            self._thread = threading.Thread(
                target=self._produce_from, args=(first, run), name=f"rlcore-rollouts-{run}", daemon=True
            )
            self._thread.start()

    def _wait_for(self, step: int) -> StepRollouts | _Failed:
        self._ensure_producer(step)
        with self._cond:
            while step not in self._results:
                if self._cancelled():
                    raise Cancelled(f"the run was stopped while step {step} waited for its rollouts")
                if self._closed:
                    raise Cancelled(f"the rollout stream was closed while step {step} waited for its rollouts")
                thread = self._thread
                if thread is not None and not thread.is_alive() and step not in self._results:
                    raise RuntimeError(f"the rollout producer ended without the rollouts of step {step}")
                self._cond.wait(_SLICE_S)
            return self._results.pop(step)

    def _gate_open(self, step: int, run: int) -> bool:
        """Wait until ``step`` may start; False when this producer is to stop."""
        t0 = time.monotonic()
        with self._cond:
            while True:
                if self._closed or run != self._run or self._cancelled():
                    return False
                if self._released >= step - 1 - self.max_staleness:
                    self._gated_s += time.monotonic() - t0
                    return True
                self._cond.wait(_SLICE_S)

    def _post(self, step: int, run: int, result: StepRollouts | _Failed) -> bool:
        with self._cond:
            if run != self._run:
                return False
            self._results[step] = result
            self._cond.notify_all()
            return True

    def _produce_from(self, first: int, run: int) -> None:
        for step in range(first, self.last_step + 1):
            if not self._gate_open(step, run):
                return
            version, epoch, t0 = self._version(), self._epoch(), time.monotonic()
            try:
                groups = self._produce(step)
            except BaseException as err:  # handed to the trainer, which raises it
                self._post(step, run, _Failed(err, epoch))
                return
            t1 = time.monotonic()
            if self._span is not None:
                self._span("generate", t0, t1, step)
            if not self._post(step, run, StepRollouts(step, groups, version, t0, t1)):
                return

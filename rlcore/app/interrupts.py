"""SIGINT and SIGTERM during ``rlcore run``: a bounded, clean stop; a second signal at once.

The CLI wraps a run in :class:`SignalGuard` (so does :func:`rlcore.open` for a loop of its
own, unless a guard is in charge already). The first SIGINT or SIGTERM raises
:class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread, wherever it waits;
:func:`rlcore.open`'s session catches it, cancels the run, shuts everything down (bounded),
writes ``metrics.jsonl`` and ``trace.json`` and raises :class:`RunInterrupted`, whose
:meth:`~RunInterrupted.line` the CLI prints before exiting with ``128 + signal``.

Two things bound the stop however the teardown fares: a second signal, and a watchdog
``hard_s`` seconds after the first. Either kills every process this one started (its
whole process tree) and exits at once with the same code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

#: The signals that stop a run.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    """``SIGINT`` for 2, ``SIGTERM`` for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(KeyboardInterrupt):
    """The first SIGINT/SIGTERM of a run, raised in the main thread by :class:`SignalGuard`.

    Attributes:
        signum: the signal's number.
        at: ``time.monotonic()`` when it arrived.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum
        self.at = time.monotonic()

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a signal, after its teardown. Raised by :func:`rlcore.open` and its session.

    Attributes:
        signum: the signal (SIGINT for a plain ``KeyboardInterrupt``).
        during: what was running (``init:generation``, ``refit:initial``, ``step 3``, ...).
        shut_down: what the teardown stopped, in order.
        problems: shutdowns that raised or hung, processes that had to be SIGKILLed.
        run_dir: the run directory (``metrics.jsonl``, ``trace.json``).
        seconds: from the signal to the end of the teardown.
    """

    def __init__(
        self,
        signum: int,
        during: str,
        shut_down: Sequence[str],
        problems: Sequence[str],
        run_dir: Any,
        seconds: float,
    ) -> None:
        self.signum = signum
        self.during = during
        self.shut_down = list(shut_down)
        self.problems = list(problems)
        self.run_dir = run_dir
        self.seconds = seconds
        super().__init__(self.line())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        """One line: what was interrupted, what was shut down, where the records are."""
        stopped = ", ".join(self.shut_down) or "nothing had started"
        extra = f"; problems: {'; '.join(self.problems)}" if self.problems else ""
        return (
            f"interrupted ({signal_name(self.signum)}) during {self.during}; shut down: {stopped} "
            f"in {self.seconds:.1f}s{extra}; records in {self.run_dir}"
        )


def signum_of(err: BaseException) -> int:
    """The signal behind an interrupt (SIGINT for a plain ``KeyboardInterrupt``)."""
    return int(getattr(err, "signum", signal.SIGINT))


def descendants() -> list[Any]:
    """Every process this one started, transitively (``psutil.Process``)."""
    import psutil

    try:
        return list(psutil.Process().children(recursive=True))
    except psutil.Error:
        return []


def end_leftovers(grace_s: float = 2.0) -> list[str]:
    """After a teardown: SIGTERM what this process still has running (a shutdown that was
    abandoned at its bound), SIGKILL it after ``grace_s``; returns ``name (pid)`` of each."""
    from rlcore.runtime.proc import wait_exited

    procs = descendants()
    names = []
    for p in procs:
        with contextlib.suppress(Exception):
            names.append(f"{p.name()} ({p.pid})")
            p.terminate()
    for p in wait_exited(procs, grace_s):
        with contextlib.suppress(Exception):
            p.kill()
    return names


def kill_tree() -> None:
    """SIGKILL every descendant of this process."""
    for p in descendants():
        with contextlib.suppress(Exception):
            p.kill()


def _guarded() -> bool:
    """Whether a :class:`SignalGuard` has this process's SIGINT now."""
    return active_guard() is not None


def active_guard() -> SignalGuard | None:
    """The :class:`SignalGuard` that has this process's SIGINT now, if any."""
    owner = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    return owner if isinstance(owner, SignalGuard) else None


class SignalGuard:
    """Route SIGINT/SIGTERM of the main thread into a clean stop, bounded by ``hard_s``.

    Use as a context manager around the run (in the main thread; elsewhere it does
    nothing). The first signal raises :class:`Interrupted`; a second one, or ``hard_s``
    seconds without the process having left the guard, SIGKILLs the process tree and
    exits with ``128 + the first signal``, printing one line on stderr. A guard entered
    while another one is in charge (``rlcore run``'s around :func:`rlcore.open`'s) does
    nothing either: the outer one keeps the signals until it is left.
    """

    def __init__(self, hard_s: float = 9.0) -> None:
        self.hard_s = hard_s
        self.first: Interrupted | None = None
        #: A signal held back by :meth:`defer`, not raised yet (the loop takes it at a step's end).
        self.pending: Interrupted | None = None
        self._deferred: dict[int, float] = {}
        self._saved: dict[int, Any] = {}
        self._left = threading.Event()

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread() and not _guarded():
            for sig in STOP_SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._left.set()
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def defer(self, signum: int, grace_s: float) -> None:
        """Hold the first ``signum`` back for up to ``grace_s`` seconds (a preemption's
        SIGTERM, while the loop finishes its step and saves a checkpoint): it only sets
        :attr:`pending`, which the loop takes with :meth:`take_pending`. Past ``grace_s``, or
        at any other signal meanwhile, the stop happens as without deferral."""
        self._deferred[signum] = grace_s

    def undefer(self) -> None:
        """Signals raise at once again (a pending one is left to its grace timer)."""
        self._deferred.clear()

    def take_pending(self) -> Interrupted:
        """The held-back signal as the run's stop: raise what this returns. From here on
        the stop is bounded as any other (``hard_s``)."""
        assert self.pending is not None
        self.first, self.pending = self.pending, None
        self._start_watchdog()
        return self.first

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.first is None and self.pending is None and signum in self._deferred:
            self.pending = Interrupted(signum)
            threading.Thread(
                target=self._grace, args=(self.pending, self._deferred[signum]),
                name="rlcore-interrupt-grace", daemon=True,
            ).start()
            return
        if self.first is None:
            self.first, self.pending = Interrupted(signum), None
            self._start_watchdog()
            raise self.first
        self.force(f"second signal ({signal_name(signum)})")

    def _start_watchdog(self) -> None:
        threading.Thread(target=self._watchdog, name="rlcore-interrupt-watchdog", daemon=True).start()

    def _grace(self, held: Interrupted, grace_s: float) -> None:
        """Past the grace time with the signal still held: deliver it to the main thread."""
        if self._left.wait(grace_s) or self.pending is not held:
            return
        import _thread

        _thread.interrupt_main(held.signum)  # runs _handle in the main thread: raises now

    def _watchdog(self) -> None:
        if not self._left.wait(self.hard_s):
            self.force(f"teardown still running {self.hard_s:g}s after the signal")

    def force(self, why: str) -> None:
        """Kill the process tree and exit now (nothing else runs: no finally, no atexit)."""
        first = self.first
        code = first.exit_code if first is not None else 128 + signal.SIGINT
        kill_tree()
        name = signal_name(code - 128)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            os.write(2, f"interrupted ({name}): {why}; killed every process of the run and exited\n".encode())
        os._exit(code)

"""What a run is doing now: the setup's live table and the phase an interrupt names.

:class:`SetupProgress` is the table of setup tasks (waiting / running / done, with
elapsed times) a run shows while it sets up: live on a terminal, once at the end in a log
(:func:`setup_display`); :class:`SlowTasks` names a task still running past
``setup.slow_task_warn_s``. :class:`RunPhase` keeps, in the words of an interrupt's message,
what the run is doing (``cluster start``, ``init:policy, init:generation``, ``step 3``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table


class SetupProgress:
    """A live table of setup tasks: waiting / running / done, with elapsed times."""

    def __init__(self, names: Sequence[str]) -> None:
        self.state = {n: ("waiting", None, None) for n in names}
        self.t0 = time.monotonic()

    def __call__(self, task: str, what: str) -> None:
        _, start, _ = self.state.get(task, ("waiting", None, None))
        now = time.monotonic()
        if what == "start":
            self.state[task] = ("running", now, None)
        else:
            self.state[task] = (what, start, now)

    def __rich__(self) -> Table:
        table = Table(title="setup", expand=False)
        table.add_column("task")
        table.add_column("state")
        table.add_column("time", justify="right")
        now = time.monotonic()
        style = {"running": "yellow", "end": "green", "ok": "green", "failed": "red"}
        for name, (state, start, end) in self.state.items():
            elapsed = "" if start is None else f"{(end or now) - start:.1f}s"
            label = "done" if state in ("end", "ok") else state
            table.add_row(name, f"[{style.get(state, 'white')}]{label}[/]", elapsed)
        return table


@contextlib.contextmanager
def setup_display(progress: SetupProgress, console: Console) -> Iterator[None]:
    """The live setup table on a terminal; elsewhere (a log) the table once at the end."""
    if console.is_terminal:
        with Live(progress, console=console, refresh_per_second=4, transient=False):
            yield
        return
    try:
        yield
    finally:
        console.print(progress)


class SlowTasks:
    """Says, once per task, that a setup task is still running after ``after_s`` seconds
    (``setup.slow_task_warn_s``): ``init:generation still running after 61 s``.

    Fed the setup's events like :class:`SetupProgress` (``slow(task, what)``); while
    :meth:`watching`, a daemon thread looks every ``min(1, after_s / 4)`` seconds, so a
    line comes at most a quarter of the bound (a second at most) late.
    """

    def __init__(self, after_s: float, say: Callable[[str], None]) -> None:
        self.after_s, self.say = after_s, say
        self._started: dict[str, float] = {}
        self._told: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def __call__(self, task: str, what: str) -> None:
        with self._lock:
            if what == "start":
                self._started[task] = time.monotonic()
            else:
                self._started.pop(task, None)

    def check(self, now: float | None = None) -> list[str]:
        """Say (and return) the lines due at ``now``: each task running past the bound, once."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [(t, now - t0) for t, t0 in self._started.items() if now - t0 >= self.after_s and t not in self._told]
            self._told.update(t for t, _ in due)
        lines = [f"{task} still running after {elapsed:.{0 if elapsed >= 10 else 1}f} s" for task, elapsed in due]
        for line in lines:
            self.say(line)
        return lines

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Look for slow tasks in a daemon thread while the block runs."""
        self._stop.clear()
        thread = threading.Thread(target=self._look, name="rlcore-slow-tasks", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join(timeout=5.0)

    def _look(self) -> None:
        period = min(1.0, self.after_s / 4)
        while not self._stop.wait(period):
            self.check()


class RunPhase:
    """What a run is doing now, in the words of an interrupt's message: ``cluster start``,
    the setup tasks running (``init:policy, init:generation``), ``step 3``, ``teardown``."""

    def __init__(self) -> None:
        self.now = "cluster start"
        self._running: list[str] = []
        self._lock = threading.Lock()

    def watch(
        self, progress: Callable[[str, str], None], say: Callable[[str], None] | None = None
    ) -> Callable[[str, str], None]:
        """``progress`` (a setup event callback) that also keeps :attr:`now` up to date and,
        with ``say``, reports each event as a line (``setup: init:policy running``): the
        live table is drawn only on a terminal, a log needs the lines."""

        def event(task: str, what: str) -> None:
            if say is not None:
                say(f"setup: {task} {_EVENT_WORDS.get(what, what)}")
            with self._lock:
                # Only starts and successful ends move the phase: the events a cancellation
                # sends (cancelled, not_started) must not hide what it interrupted.
                if what == "start":
                    self._running.append(task)
                elif what == "end" and task in self._running:
                    self._running.remove(task)
                if what in ("start", "end"):
                    self.now = ", ".join(self._running) or f"setup (after {task})"
            progress(task, what)

        return event


_EVENT_WORDS = {"start": "running", "end": "done"}

"""The run's ``run.log``: what other libraries print during ``rlcore run``, off the console.

The console of ``rlcore run`` shows rlcore's own lines and errors. What Ray, vLLM, torch
and the other libraries print goes to ``run.log`` in the run directory, named once on the
console when the directory is made (:func:`attach`, called by
:func:`rlcore.app.rundir.make_run_dir`). While :func:`routed_to_run_log` is active (the CLI's
``run``; a library's :func:`rlcore.open` leaves the process's output alone):

* the output of Ray's workers, which Ray forwards to the driver (``log_to_driver``): every
  line, with Ray's ``(Actor pid=N)`` prefix. A worker's Python traceback, a fatal Python
  error and a line logged at ERROR or CRITICAL (:func:`error_lines`) are also printed on
  the console where Ray printed them: a worker that crashes is seen where it crashes.
* Ray's messages about the cluster pushed to the driver (``(raylet) A worker died ...``,
  a task killed for memory): on the console too, as errors.
* ``logging`` records of loggers other than rlcore's (``rlcore.*``, the plugins'
  ``rlcore_*``) below ERROR, Ray's own logger among them (its "Started a local Ray
  instance", its token notice). rlcore's records and every ERROR still reach the console;
  ``run.log`` gets every record.
* Python warnings (:func:`logging.captureWarnings`): a library's ``FutureWarning``.

Not routed: what C code in the driver process writes to its file descriptors (the
quickstart's driver writes nothing there; its workers' C-level lines reach ``run.log``
through Ray). Lines that come before the run directory exists are held and written first;
a run that never gets one (bad input) prints them on stderr at its end, as they would have
been. Ray's forwarding is taken over through Ray's private ``print_to_stdstream`` and its
stream dispatcher; a Ray without them keeps printing as before (logged at debug).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape

log = logging.getLogger(__name__)

__all__ = ["FILE", "RunLog", "attach", "error_lines", "ours", "routed_to_run_log"]

#: The log's name in the run directory (:data:`rlcore.app.rundir.RUN_FILES`).
FILE = "run.log"
#: Lines held until the run directory exists (the oldest go first beyond this).
PENDING_MAX = 10_000
#: Format of ``logging`` records in ``run.log``.
RECORD_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Name of Ray's handler of forwarded worker output (``ray._private.worker.connect``).
RAY_HANDLER = "ray_print_logs"

#: A line that starts a Python traceback (or a chained one's link), or a fatal error.
_BLOCK_START = re.compile(
    r"^(Traceback \(most recent call last\):|Fatal Python error|"
    r"During handling of the above exception|The above exception was the direct cause|"
    r"Current thread 0x|Thread 0x)"
)
#: A line logged at ERROR or CRITICAL (Python's formats, vLLM's ``ERROR 12-07 ...``).
_ERROR_LEVEL = re.compile(r"(^|[\s(\[:|])(ERROR|CRITICAL)([\s:\]|]|$)")


def ours(record: logging.LogRecord) -> bool:
    """A record for the console: rlcore's (``rlcore.*``, ``rlcore_*``), or an error."""
    return record.name.startswith("rlcore") or record.levelno >= logging.ERROR


def _errors(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


class _Errors:
    """Which lines of one worker's output belong on the console (:func:`error_lines`):
    the state of a traceback that may span several of Ray's batches."""

    def __init__(self) -> None:
        self.in_block = False

    def __call__(self, line: str) -> bool:
        if _BLOCK_START.match(line):
            self.in_block = True
            return True
        if self.in_block:
            if line and not line[0].isspace():  # the exception's own line ends the block
                self.in_block = False
            return True
        return bool(_ERROR_LEVEL.search(line[:120]))


def error_lines(lines: Sequence[str], state: _Errors | None = None) -> list[str]:
    """The lines of a worker's output that are errors: a Python traceback or fatal error
    (from its first line through the exception's), and lines logged at ERROR/CRITICAL."""
    keep = state or _Errors()
    return [line for line in lines if keep(line)]


class _ToRunLog(logging.Handler):
    """A ``logging`` handler that writes into a :class:`RunLog`."""

    def __init__(self, run_log: RunLog) -> None:
        super().__init__()
        self.run_log = run_log
        self.setFormatter(logging.Formatter(RECORD_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.run_log.write(self.format(record) + "\n")
        except Exception:  # pragma: no cover - logging's own convention
            self.handleError(record)


class RunLog:
    """``run.log``: lines held until :meth:`attach` names the run directory, then written
    there (each flushed: a killed run's log is whole up to its last line)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.path: Path | None = None
        self._file: TextIO | None = None
        self._pending: collections.deque[str] = collections.deque(maxlen=PENDING_MAX)
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            if self._file is None:
                self._pending.append(text)
                return
            with contextlib.suppress(OSError, ValueError):  # a full disk: the run says so itself
                self._file.write(text)
                self._file.flush()

    def attach(self, run_dir: Path, *, resume: bool = False) -> None:
        """Write to ``run_dir``'s ``run.log`` from now on (appended to when ``resume``)
        and name it on the console. Raises OSError when it cannot be opened."""
        path = run_dir / FILE
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = path.open("a" if resume else "w", encoding="utf-8")
            self.path = path
            if resume:
                self._file.write(f"--- resumed {datetime.now().isoformat(timespec='seconds')}\n")
            self._file.writelines(self._pending)
            self._pending.clear()
            self._file.flush()
        self.console.print(f"other libraries' output (Ray and its workers, warnings): {escape(str(path))}")

    def close(self) -> None:
        """Close the file; lines that never had one go to stderr."""
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None
            elif self._pending:
                sys.stderr.writelines(self._pending)
                sys.stderr.flush()
            self._pending.clear()


class _Routing:
    """What :func:`routed_to_run_log` changed in the process, and how to put it back."""

    def __init__(self, run_log: RunLog) -> None:
        self.run_log = run_log
        self.handler = _ToRunLog(run_log)
        self.undo: list[Callable[[], None]] = []
        self.ray_done = False
        self._errors: dict[Any, _Errors] = collections.defaultdict(_Errors)
        self._ray_print: Callable[..., None] | None = None
        self._autoscaler_events: Callable[[list[str]], Iterable[str]] = lambda lines: ()

    def start(self) -> None:
        """Python's records and warnings; Ray's too when Ray is imported already."""
        root = logging.getLogger()
        streams = {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}
        for h in root.handlers:
            if isinstance(h, logging.StreamHandler) and h.stream in streams:
                h.addFilter(ours)
                self.undo.append(functools.partial(h.removeFilter, ours))
        root.addHandler(self.handler)
        self.undo.append(functools.partial(root.removeHandler, self.handler))
        logging.captureWarnings(True)
        self.undo.append(functools.partial(logging.captureWarnings, False))
        if "ray" in sys.modules:
            self.take_ray()

    def take_ray(self) -> None:
        """Ray's logger and its forwarding of worker output, once (Ray imported here)."""
        if self.ray_done:
            return
        self.ray_done = True
        try:
            import ray  # noqa: F401  (its logger's handlers are set at import)
            from ray._private import worker as ray_worker
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError as err:  # pragma: no cover - Ray not installed or moved
            log.debug("Ray's output is not routed to %s: %s", FILE, err)
            return
        ray_logger = logging.getLogger("ray")
        for h in list(ray_logger.handlers):
            h.addFilter(_errors)
            self.undo.append(functools.partial(h.removeFilter, _errors))
        ray_logger.addHandler(self.handler)
        self.undo.append(functools.partial(ray_logger.removeHandler, self.handler))
        original = getattr(ray_worker, "print_to_stdstream", None)
        if original is None:  # pragma: no cover - a Ray without it
            log.debug("Ray's worker output is not routed to %s: no print_to_stdstream", FILE)
            return
        self._ray_print = original
        self._autoscaler_events = getattr(ray_worker, "filter_autoscaler_events", lambda lines: ())
        # Read by ray.init (the forwarding handler it adds) and by Ray's error listener.
        ray_worker.print_to_stdstream = self.worker_output
        self.undo.append(functools.partial(setattr, ray_worker, "print_to_stdstream", original))
        # Joined before the run directory: the handler ray.init added prints; replaced.
        if any(name == RAY_HANDLER for name, _ in getattr(dispatcher, "handlers", [])):
            dispatcher.remove_handler(RAY_HANDLER)
            dispatcher.add_handler(RAY_HANDLER, functools.partial(self.worker_output, ignore_prefix=False))
        self.undo.append(functools.partial(self._give_back, dispatcher, original))

    def _give_back(self, dispatcher: Any, original: Callable[..., None]) -> None:
        """A Ray still connected at the end forwards through its own printer again."""
        for name, handler in list(dispatcher.handlers):
            if name == RAY_HANDLER and getattr(handler, "func", None) == self.worker_output:
                dispatcher.remove_handler(RAY_HANDLER)
                dispatcher.add_handler(RAY_HANDLER, functools.partial(original, **handler.keywords))

    def worker_output(self, data: dict[str, Any], ignore_prefix: bool = False) -> None:
        """One batch of Ray's forwarded output (a worker's lines, or Ray's own messages):
        into ``run.log``; Ray's messages and the workers' errors printed as Ray would.
        Never raises: it runs on Ray's thread that forwards every line."""
        try:
            self._worker_output(data, ignore_prefix)
        except Exception as err:  # pragma: no cover - a batch of another shape
            log.debug("a batch of Ray's forwarded output not routed: %r", err)

    def _worker_output(self, data: dict[str, Any], ignore_prefix: bool) -> None:
        pid = data.get("pid")
        name = data.get("actor_name") or data.get("task_name")
        ip = data.get("ip")
        where = f", ip={ip}" if ip and ip != data.get("localhost") else ""
        prefix = f"({pid}) " if pid in ("raylet", "autoscaler") else f"({name + ' ' if name else ''}pid={pid}{where}) "
        lines = [str(line) for line in data.get("lines", [])]
        if pid == "autoscaler":  # its monitor's whole log: only its events, as Ray prints
            lines = list(self._autoscaler_events(lines))
        self.run_log.write("".join(f"{prefix}{line}\n" for line in lines))
        if pid == "autoscaler":
            return
        show = lines if pid == "raylet" else error_lines(lines, self._errors[(data.get("ip"), pid)])
        if show and self._ray_print is not None:
            self._ray_print({**data, "lines": show}, ignore_prefix=ignore_prefix)

    def stop(self) -> None:
        for undo in reversed(self.undo):
            with contextlib.suppress(Exception):
                undo()
        self.undo.clear()


_active: _Routing | None = None
_active_lock = threading.Lock()


@contextlib.contextmanager
def routed_to_run_log(console: Console) -> Iterator[RunLog]:
    """Route other libraries' output to the run's ``run.log`` while the block runs (the
    module's docstring says what goes where); the log is named on ``console`` once the run
    directory exists. Everything is put back at the end; one routing at a time."""
    global _active
    run_log = RunLog(console)
    routing = _Routing(run_log)
    with _active_lock:
        if _active is not None:
            raise RuntimeError("other libraries' output is routed to a run.log already")
        _active = routing
    try:
        routing.start()
        yield run_log
    finally:
        with _active_lock:
            _active = None
        routing.stop()
        run_log.close()


def attach(run_dir: Path, *, resume: bool = False) -> None:
    """The run directory exists (:func:`rlcore.app.rundir.make_run_dir`): the routed output
    goes to its ``run.log`` from now on, and Ray's too (imported here if it is not yet: the
    cluster starts next). Nothing happens when no output is routed."""
    routing = _active
    if routing is None:
        return
    routing.take_ray()
    routing.run_log.attach(run_dir, resume=resume)

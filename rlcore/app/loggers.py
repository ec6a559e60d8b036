"""A run's metrics sent on to TensorBoard, Weights & Biases and MLflow, line for line as
``metrics.jsonl`` gets them (``logging.*`` in the config; each an optional extra).

:class:`LoggedWriter` is the run's :class:`~rlcore.app.records.MetricsWriter`: every line it
appends (the setup's at step 0, each step's, a replaced worker's, the reward's trend, an
interrupt's) is then handed to each enabled logger, with the line's ``step`` and ``time``:

- numeric values (int, float, bool as 0/1) go to every logger under the line's key, at its
  ``step`` (TensorBoard's ``global_step``, MLflow's ``step``, and W&B's ``step`` metric,
  which every other W&B metric is plotted against: each line is its own W&B history row, so
  a line written for an earlier step, such as the reward's trend, is kept, where W&B's own
  ``_step`` would drop it); a nested mapping's values go under ``outer/inner``;
- non-finite numbers are not sent: ``metrics.jsonl`` writes them as ``null`` and the
  libraries disagree on them (MLflow clamps infinities), so "no value" is what all agree on;
- strings, lists and ``null`` stay in ``metrics.jsonl`` only (they are notes, not series);
- a line without a step (an interrupt's) goes at the last step a line had.

The loggers run on one thread of their own, fed by a queue: a slow or hung logger never
holds the training loop up. Their ids are kept in ``<run_dir>/loggers.json``, so
``--resume`` of the directory logs into the same MLflow run and W&B run id (online W&B
resumes that run; offline, W&B writes a second offline run of the same id, which
``wandb sync`` uploads into it), and TensorBoard adds an event file to the same directory.
A logger that raises, when it opens or later, is reported once (a log warning and a
``logging/dropped`` line in ``metrics.jsonl``) and dropped; the run goes on. At the run's
end, whatever it ended with, each is closed with the run's outcome, within a deadline.

The libraries are imported on the loggers' thread, when a logger is enabled; the preflight
(:func:`rlcore.setup.preflight.check_loggers`) has refused a run whose logger's package is
missing, naming the extra that installs it.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlcore.app.logger_sinks import Sink, make_sinks
from rlcore.app.records import STALL_WARN_S, MetricsWriter, write_atomic
from rlcore.config import RunConfig
from rlcore.errors import RunDirError

log = logging.getLogger(__name__)

__all__ = ["LOGGERS_FILE", "LoggedWriter", "Loggers", "scalars"]

#: The loggers' ids, for ``--resume``: ``{"<config key>": {...}}``.
LOGGERS_FILE = "loggers.json"
#: How long the run's end waits for the loggers to close (an interrupted run: less).
CLOSE_TIMEOUT_S = 30.0
INTERRUPTED_CLOSE_TIMEOUT_S = 3.0
#: Keys of a metrics line that are its coordinates, not metrics.
_COORDINATES = ("step", "time")


def scalars(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric, finite values of a metrics line by key (nested mappings flattened with
    ``/``), without its ``step`` and ``time``."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if not prefix and key in _COORDINATES:
            continue
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


def _outcome(failure: BaseException | None) -> str:
    if failure is None:
        return "finished"
    return "interrupted" if isinstance(failure, KeyboardInterrupt) else "failed"


class Loggers:
    """Hands metrics lines to ``sinks`` on a thread of its own; drops a sink that raises.

    Args:
        sinks: the loggers (:func:`make_sinks`); opened on the thread, in order.
        run_dir: where ``loggers.json`` is read (``--resume``) and written.
        report: writes a line to ``metrics.jsonl`` (a dropped logger's ``logging/dropped``).
    """

    def __init__(
        self, sinks: list[Sink], run_dir: Path, report: Callable[[dict[str, Any], int | None], None]
    ) -> None:
        self.sinks, self.run_dir, self._report = list(sinks), run_dir, report
        self.dropped: dict[str, str] = {}  # key -> why
        self._gone: list[Sink] = []  # dropped: still closed at the end, for what they opened
        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._deadline: float | None = None  # set by end()
        self._left_behind = False
        self._last_step = 0
        # Daemon: a logger hung past the close deadline must not keep the process alive.
        self._thread = threading.Thread(target=self._work, name="rlcore-loggers", daemon=True)
        self._thread.start()

    def log(self, row: Mapping[str, Any]) -> None:
        """Queue one ``metrics.jsonl`` line (as written, with ``step`` and ``time``)."""
        if self._deadline is None:
            self._queue.put(("line", dict(row)))

    def samples(self, lines: list[dict[str, Any]], step: int) -> None:
        """Queue a step's decoded samples (``samples.jsonl``'s lines) for the loggers that show text."""
        if self._deadline is None and lines:
            self._queue.put(("samples", (step, [dict(line) for line in lines])))

    def end(self, failure: BaseException | None = None, timeout: float | None = None) -> None:
        """Start closing: what is queued is logged, then every logger is closed with the
        run's outcome, on the loggers' thread, while the caller goes on (the run's teardown).
        :meth:`wait` waits for it until ``timeout`` seconds from now (default:
        :data:`CLOSE_TIMEOUT_S`, or :data:`INTERRUPTED_CLOSE_TIMEOUT_S` after an interrupt).
        Once; later calls do nothing."""
        if self._deadline is not None:
            return
        outcome = _outcome(failure)
        if timeout is None:
            timeout = INTERRUPTED_CLOSE_TIMEOUT_S if outcome == "interrupted" else CLOSE_TIMEOUT_S
        self._deadline = time.monotonic() + timeout
        self._queue.put(("close", outcome))

    def wait(self) -> None:
        """Wait for :meth:`end`'s closing until its deadline (a run that did not call it:
        closed as ``finished``); a logger still busy then is left behind, with a warning.
        Never raises."""
        self.end()
        assert self._deadline is not None
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._thread.is_alive() and not self._left_behind:
            self._left_behind = True
            names = ", ".join(s.key for s in self.sinks) or "none"
            log.warning("loggers (%s) did not close by their deadline; left behind", names)

    def close(self, failure: BaseException | None = None, timeout: float | None = None) -> None:
        """:meth:`end` and :meth:`wait`."""
        self.end(failure, timeout)
        self.wait()

    # ---------------------------------------------------------------- the thread

    def _work(self) -> None:
        self._open()
        while True:
            kind, item = self._queue.get()
            if kind == "close":
                for sink in self.sinks + self._gone:
                    try:
                        sink.close(item)
                    except Exception as err:  # closing is best effort: the run has ended
                        log.warning("%s: closing failed: %s: %s", sink.key, type(err).__name__, err)
                return
            if kind == "samples":
                self._samples(*item)
                continue
            step = item.get("step")
            if isinstance(step, int):
                self._last_step = step
            values = scalars(item)
            if not values:
                continue
            for sink in list(self.sinks):
                try:
                    sink.log(values, self._last_step, float(item.get("time", 0.0)))
                except Exception as err:
                    self._drop(sink, err, "logging")

    def _samples(self, step: int, lines: list[dict[str, Any]]) -> None:
        for sink in list(self.sinks):
            try:
                sink.samples(lines, step)
            except Exception as err:
                self._drop(sink, err, "logging samples")

    def _open(self) -> None:
        saved = self._saved()
        ids: dict[str, Any] = {}
        for sink in list(self.sinks):
            try:
                ids[sink.key] = sink.open(saved.get(sink.key) or {})
            except Exception as err:
                self._drop(sink, err, "opening")
        if ids:
            try:
                write_atomic(self.run_dir / LOGGERS_FILE, json.dumps({**saved, **ids}, indent=2) + "\n")
            except RunDirError as err:
                log.warning("%s (a --resume of this run will start new logger runs)", err)

    def _saved(self) -> dict[str, Any]:
        path = self.run_dir / LOGGERS_FILE
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("%s unreadable (%s); the loggers start new runs", path, err)
            return {}
        return saved if isinstance(saved, dict) else {}

    def _drop(self, sink: Sink, err: BaseException, during: str) -> None:
        why = f"{type(err).__name__}: {' '.join(str(err).split())}"
        self.sinks.remove(sink)
        self._gone.append(sink)
        self.dropped[sink.key] = why
        log.warning("%s dropped after an error %s: %s; the run goes on without it", sink.key, during, why)
        try:
            self._report({"logging/dropped": sink.key, "logging/dropped_error": why}, self._last_step)
        except (RunDirError, ValueError) as report_err:  # a full disk, or the writer closed
            log.warning("%s", report_err)


class LoggedWriter(MetricsWriter):
    """``metrics.jsonl``'s writer whose every line also goes to the loggers the config
    enables (none: it is a plain :class:`MetricsWriter`)."""

    def __init__(
        self, path: str | Path, config: RunConfig, sinks: list[Sink] | None = None, resumed_after: int | None = None
    ) -> None:
        # A stalled disk is said within the run's own bound on silence (cluster.hang_timeout_s).
        super().__init__(path, stall_warn_s=config.cluster.hang_timeout_s or STALL_WARN_S)
        sinks = make_sinks(config, self.path.parent, resumed_after) if sinks is None else sinks
        self.loggers = Loggers(sinks, self.path.parent, self._report) if sinks else None

    def write(self, record: Mapping[str, Any], *, step: int | None = None) -> dict[str, Any]:
        row = super().write(record, step=step)
        if self.loggers is not None:
            self.loggers.log(row)
        return row

    def samples(self, lines: list[dict[str, Any]], step: int) -> None:
        """A step's decoded samples to the loggers (``samples.jsonl`` is written by its own writer)."""
        if self.loggers is not None:
            self.loggers.samples(lines, step)

    def _report(self, record: dict[str, Any], step: int | None) -> None:
        MetricsWriter.write(self, record, step=step)  # not to the loggers: it is about them

    def close_loggers(self, failure: BaseException | None) -> None:
        """Start closing the loggers with the run's outcome (:meth:`Loggers.end`): they
        close while the run is torn down; :meth:`close` waits for them, bounded."""
        if self.loggers is not None:
            self.loggers.end(failure)

    def close(self) -> None:
        """Wait for the loggers (until their deadline), then close ``metrics.jsonl``."""
        if self.loggers is not None:
            self.loggers.wait()
        super().close()

"""A run's directory: created empty (or resumed), its ``run.json``, its records closed.

:func:`make_run_dir` makes the directory the preflight checked; :class:`RunStatus` writes
``run.json`` (how far the run got); :func:`close_records` closes ``metrics.jsonl`` and
writes ``trace.json`` and the final ``run.json`` at the end of a run, whatever it ended with.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

from rlcore.config import RunConfig
from rlcore.errors import RunDirError
from rlcore.setup.metrics import MetricsWriter, write_atomic
from rlcore.setup.preflight import RUN_STATUS_FILE, no_step_leftovers, read_run_status, run_dir_for
from rlcore.setup.trace import TraceRecorder

log = logging.getLogger(__name__)


def make_run_dir(config: RunConfig, out: str | None, *, resume: bool = False) -> Path:
    """Create the run directory (``out``, else a new ``<output_dir>/<name>-<time>[-k]``).

    :func:`rlcore.setup.preflight.check_before_start` has checked that it can be written and
    that ``out`` is empty unless the run resumes, or holds only what a run that completed no
    step left: those files are removed here, so the new run starts from an empty directory.

    Raises:
        RunDirError: the directory or a leftover could not be created or removed.
    """
    path = base = run_dir_for(config, out)
    k = 1
    while not out and path.exists():  # two runs started in the same second
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        for old in [] if resume else no_step_leftovers(path) or []:
            if old.is_dir():  # a write check's directory, left by a kill
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)
    except OSError as err:
        raise RunDirError.from_os_error(err.filename or path, err) from err
    return path


class RunStatus:
    """The run's ``run.json``: how far it got, written whole at its start (``setting-up``),
    before the first step's metrics line (``running``) and at its end (``finished``,
    ``failed`` or ``interrupted``, with the error). ``steps_done`` is exact once the run has
    ended; while it runs (or if it was killed) it says only that steps were done. A rerun into
    the same ``--out`` reads it (:func:`rlcore.setup.preflight.check_run_dir`): a run that
    completed no step (failed, interrupted or killed in setup) does not block it.

    A resumed run counts on from the ``steps_done`` of the run it appends to (unknown, and
    so never replaced, when that run left no ``run.json``).
    """

    def __init__(self, run_dir: Path, *, resume: bool) -> None:
        self.path = run_dir / RUN_STATUS_FILE
        self.before: int | None = 0
        if resume:
            prev = read_run_status(run_dir)
            steps = prev.get("steps_done") if prev is not None else None
            has_files = any(p.name != RUN_STATUS_FILE for p in run_dir.iterdir())
            self.before = steps if isinstance(steps, int) else (None if has_files else 0)
        self.steps = 0
        self.record: dict[str, Any] = {
            "status": "setting-up",
            "steps_done": self.before,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": datetime.now().isoformat(timespec="seconds"),
        }
        self._write()

    def _write(self) -> None:
        if self.before is not None:
            self.record["steps_done"] = self.before + self.steps
        self.record["updated_at"] = datetime.now().isoformat(timespec="seconds")
        write_atomic(self.path, json.dumps(self.record, indent=2) + "\n")

    def step_done(self) -> None:
        """A step has run; called before its ``metrics.jsonl`` line is written, so that a disk
        filling between the two leaves a run that blocks its ``--out`` rather than one a rerun
        replaces. Only the first step is written (the count is written at the end)."""
        self.steps += 1
        if self.steps == 1:
            self.record["status"] = "running"
            self._write()

    def end(self, failure: BaseException | None) -> None:
        """``finished``, or ``failed`` / ``interrupted`` with the error's line."""
        if failure is None:
            self.record["status"] = "finished"
        else:
            interrupted = isinstance(failure, KeyboardInterrupt)
            self.record["status"] = "interrupted" if interrupted else "failed"
            self.record["error"] = f"{type(failure).__name__}: {' '.join(str(failure).split())}"
        self._write()


def close_records(
    run_dir: Path,
    writer: MetricsWriter,
    trace: TraceRecorder,
    status: RunStatus,
    failure: BaseException | None,
) -> None:
    """Close ``metrics.jsonl``, write ``trace.json``, then the final ``run.json``, each tried
    whatever the others did. A write that fails (a full disk) raises the first
    :class:`RunDirError` when the run had not failed already; otherwise the run's own error
    is the one to report (not a chained traceback), and this one is logged."""
    first: RunDirError | None = None
    writes = (
        writer.close,
        lambda: trace.write(run_dir / "trace.json"),
        lambda: status.end(failure or first),
    )
    for write in writes:
        try:
            write()
        except RunDirError as err:
            if failure is None and first is None:
                first = err
            elif isinstance(failure or first, RunDirError):
                log.debug("%s", err)  # the same disk: the error reported already says so
            else:
                log.warning("%s", err)
    if first is not None:
        raise first

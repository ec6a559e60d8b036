"""A run's directory: checked, created empty (or resumed), its ``run.json``, its records closed.

:func:`check_run_dir` refuses an ``--out`` that holds another run's results;
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

from rlcore.app import runlog
from rlcore.app.records import MetricsWriter, is_temp_file, write_atomic
from rlcore.app.trace import TraceRecorder
from rlcore.config import RunConfig
from rlcore.errors import ConfigError, RunDirError
from rlcore.setup.preflight import PROBE_PREFIX, check_writable_dir

log = logging.getLogger(__name__)

#: The run's own record of how far it got, written whole by ``rlcore run`` at its start,
#: before its first step's metrics line and at its end (``rlcore.app.rundir.RunStatus``):
#: ``{"status": "setting-up" | "running" | "finished" | "failed" | "interrupted",
#: "steps_done": N, "pid": ..., "host": ..., "error": ...}``.
RUN_STATUS_FILE = "run.json"
#: Everything a run writes into its directory (besides the temporary files of
#: :func:`rlcore.app.records.write_atomic`, left only by a kill).
RUN_FILES = (
    RUN_STATUS_FILE, "config.yaml", "metrics.jsonl", "samples.jsonl", "trace.json", "placement.json",
    "setup_timeline.png", "reward.png",
    # Other libraries' output, when the CLI routes it off the console (rlcore.app.runlog).
    "run.log",
    # The loggers' (rlcore.app.loggers): their ids, and the stores under the run directory.
    "loggers.json", "tensorboard", "wandb", "mlflow",
)


def run_dir_for(config: RunConfig, out: str | None, *, now: datetime | None = None) -> Path:
    """The run directory a run writes: ``out``, else ``<output_dir>/<name>-<timestamp>``."""
    if out:
        return Path(out).expanduser()
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path(config.output_dir).expanduser() / f"{config.name}-{stamp}"


def check_run_dir(path: Path, *, resume: bool, key: str = "--out") -> None:
    """The run directory can be written, and is new or empty unless ``resume``.

    A directory that holds only what a run that completed no step left (its
    ``run.json`` says so, see :func:`no_step_leftovers`) counts as empty: a run that
    failed in setup never blocks the same ``--out``, and the next run replaces its files.
    """
    check_writable_dir(path, key=key)
    if resume or not path.is_dir() or all(_a_probe(p.name) for p in path.iterdir()):
        return
    why = _why_not_reusable(path)
    if why is None:
        return
    raise ConfigError(
        f"run directory '{path}' ({key}) is not empty{why}; choose a new one, or pass --resume "
        "to append to it",
        key=key,
    )


def read_run_status(path: Path) -> dict[str, object] | None:
    """The run directory's ``run.json``, or ``None`` when it is missing or unreadable."""
    try:
        status = json.loads((path / RUN_STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return status if isinstance(status, dict) else None


def no_step_leftovers(path: Path) -> list[Path] | None:
    """What a run that completed no step left in ``path`` (files to replace), or ``None``
    when ``path`` holds anything else: a run that completed a step or finished, a run
    still in its setup, a file no run wrote, or no ``run.json`` at all."""
    if _why_not_reusable(path) is not None:
        return None
    return sorted(p for p in path.iterdir() if _a_run_wrote(p.name) or _a_probe(p.name))


def _why_not_reusable(path: Path) -> str | None:
    """``None`` when ``path`` holds only what a run that completed no step left; else a
    clause for the refusal (empty when there is nothing more to say than "not empty")."""
    status = read_run_status(path)
    if status is None:
        return ""
    foreign = sorted(p.name for p in path.iterdir() if not (_a_run_wrote(p.name) or _a_probe(p.name)))
    if foreign:
        return f" (it holds '{foreign[0]}', which no run wrote)"
    steps, state = status.get("steps_done"), status.get("status")
    if steps != 0 or state == "finished":
        done = f"{steps} step(s)" if isinstance(steps, int) else "an unknown number of steps"
        if state == "running":  # its end was never written: killed, or its disk filled
            done = f"at least {done}"
        return f": it holds a run that completed {done} (run.json status '{state}')"
    pid = status.get("pid")
    if (
        state == "setting-up"
        and isinstance(pid, int)
        and pid != os.getpid()
        and status.get("host") == socket.gethostname()
        and _alive(pid)
    ):
        return f": a run (pid {pid}) is setting up in it"
    return None


def _a_run_wrote(name: str) -> bool:
    return name in RUN_FILES or is_temp_file(name, RUN_FILES)


def _a_probe(name: str) -> bool:
    """A directory :func:`check_writable_dir` made (in ``--out`` when it exists) and a kill
    kept it from removing: it never makes a directory not empty."""
    return name.startswith(PROBE_PREFIX)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True



def make_run_dir(config: RunConfig, out: str | None, *, resume: bool = False) -> Path:
    """Create the run directory (``out``, else a new ``<output_dir>/<name>-<time>[-k]``).

    :func:`rlcore.setup.preflight.check_before_start` has checked that it can be written and
    that ``out`` is empty unless the run resumes, or holds only what a run that completed no
    step left: those files are removed here, so the new run starts from an empty directory.
    Where ``rlcore run`` routes other libraries' output off the console, its ``run.log``
    starts here (:func:`rlcore.app.runlog.attach`).

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
        runlog.attach(path, resume=resume)
    except OSError as err:
        raise RunDirError.from_os_error(err.filename or path, err) from err
    return path


class RunStatus:
    """The run's ``run.json``: how far it got, written whole at its start (``setting-up``),
    before the first step's metrics line (``running``) and at its end (``finished``,
    ``failed`` or ``interrupted``, with the error). ``steps_done`` is exact once the run has
    ended; while it runs (or if it was killed) it says only that steps were done. A rerun into
    the same ``--out`` reads it (:func:`check_run_dir`): a run that
    completed no step (failed, interrupted or killed in setup) does not block it.

    A resumed run counts on from the step of the checkpoint it resumes from
    (``steps_before``), else from the ``steps_done`` of the run it appends to (unknown, and
    so never replaced, when that run left no ``run.json``).
    """

    def __init__(self, run_dir: Path, *, resume: bool, steps_before: int | None = None) -> None:
        self.path = run_dir / RUN_STATUS_FILE
        self.before: int | None = 0
        if steps_before is not None:  # resumed from the checkpoint of that step
            self.before = steps_before
        elif resume:
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


def truncate_metrics(run_dir: Path, last_step: int, name: str = "metrics.jsonl") -> int:
    """Drop the lines of steps after ``last_step`` from the run's ``name`` (``metrics.jsonl``,
    ``samples.jsonl``: a run resumed from that step's checkpoint does them again); the file
    is replaced whole. Returns how many lines went."""
    path = run_dir / name
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = []
    for line in lines:
        if not line.endswith("\n"):
            continue  # a cut last line (see MetricsWriter)
        try:
            step = json.loads(line).get("step")
        except ValueError:
            step = None
        if not (isinstance(step, int) and step > last_step):
            kept.append(line)
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))
    return len(lines) - len(kept)

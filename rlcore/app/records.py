"""The run directory's writers: ``metrics.jsonl`` line by line, every other file whole.

The run directory's files are never half-written: :class:`MetricsWriter` appends each
line of ``metrics.jsonl`` with one ``write(2)`` and cuts a line the disk had no room for
back off; every other file goes through :func:`write_atomic` (a temporary file beside it,
then a rename). A failure is a :class:`~rlcore.errors.RunDirError` naming the file and the
cause.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from rlcore.errors import RunDirError

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN/inf are not JSON
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


#: Seconds a write to the run directory may take before it is warned about.
STALL_WARN_S = 30.0


@contextlib.contextmanager
def stall_watch(path: Path, what: str, after_s: float | None) -> Any:
    """Warn, naming ``path``, when the block takes longer than ``after_s`` (a frozen or hung
    filesystem blocks a write without an error; the run would stop with nothing said), and
    again when it returns. The block goes on waiting: a disk that comes back loses nothing."""
    if not after_s:
        yield
        return
    t0 = time.monotonic()
    warned = threading.Event()

    def warn() -> None:
        warned.set()
        log.warning(
            "%s %s has not returned for %.0f s: the disk under the run directory is stalled (a frozen "
            "filesystem, a hung network mount?); the run waits for it", what, path, after_s,
        )

    timer = threading.Timer(after_s, warn)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if warned.is_set():
            log.warning("%s %s returned after %.1f s; the run goes on", what, path, time.monotonic() - t0)


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl``; thread-safe.

    Each record gets ``time`` (epoch seconds) unless it has one, and ``step`` when given.
    Non-finite floats are written as ``null``. Every line is one ``write(2)`` on an
    ``O_APPEND`` descriptor, with nothing buffered in the process: a process that exits or
    is killed leaves the lines it wrote, whole. A line the disk has no room for is cut back
    off before :class:`~rlcore.errors.RunDirError` is raised, so the file ends at a whole
    line. The one cut a line can still suffer is SIGKILL while the kernel copies a write
    that spans pages (Linux stops between pages for a fatal signal): only the last line can
    be cut that way, and the fragment, having no newline, is dropped when the file is
    opened again (``--resume``) and skipped by :func:`read_metrics`.
    """

    def __init__(self, path: str | Path, *, stall_warn_s: float | None = STALL_WARN_S) -> None:
        self.path = Path(path)
        #: A write or fsync still running after this many seconds is warned about (the disk
        #: under the run directory is stalled); None: never.
        self.stall_warn_s = stall_warn_s
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(
                self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
            )
            self._drop_cut_line()
        except OSError as err:
            raise RunDirError.from_os_error(self.path, err) from err

    def _drop_cut_line(self) -> None:
        """Truncate a trailing fragment (no newline) so appended lines start on a line."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with self.path.open("rb") as f:
            end = size
            while end > 0:
                begin = max(0, end - 65536)
                f.seek(begin)
                chunk = f.read(end - begin)
                if end == size and chunk.endswith(b"\n"):
                    return
                nl = chunk.rfind(b"\n")
                if nl >= 0:
                    keep = begin + nl + 1
                    break
                end = begin
            else:
                keep = 0
        log.warning("%s ended in a cut line (%d bytes); dropped it", self.path, size - keep)
        os.ftruncate(self._fd, keep)

    def write(self, record: Mapping[str, Any], *, step: int | None = None) -> dict[str, Any]:
        """Append ``record`` as one line; return the line's object (what a logger is sent).

        Raises:
            RunDirError: the line could not be written (it is not in the file).
            ValueError: the writer is closed.
        """
        row: dict[str, Any] = {}
        if step is not None:
            row["step"] = step
        row.update(_jsonable(record))
        row.setdefault("time", time.time())
        data = (json.dumps(row, allow_nan=False) + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                raise ValueError(f"{self.path}: write to a closed MetricsWriter")
            with stall_watch(self.path, "a write to", self.stall_warn_s):
                self._append(self._fd, data)
        return row

    def _append(self, fd: int, data: bytes) -> None:
        start = os.fstat(fd).st_size  # where O_APPEND puts the line: we are its only writer
        try:
            done = os.write(fd, data)
            while done < len(data):
                # A short write means the disk is (nearly) full; the next one either finishes
                # the line or raises with the real cause (ENOSPC, EDQUOT, EFBIG).
                n = os.write(fd, data[done:])
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError as err:
            try:
                os.ftruncate(fd, start)  # shrinking needs no free space
            except OSError as cut:
                left = f"its last line may be cut (truncating it back failed: {cut.strerror or cut})"
                raise RunDirError.from_os_error(self.path, err, left=left) from err
            raise RunDirError.from_os_error(self.path, err) from err

    def sync(self) -> None:
        """Flush every line written so far to the device (``fsync``): what a checkpoint
        published beside it counts on finding at resume.

        Raises:
            RunDirError: the device refused (its lines may be lost with a crash).
        """
        with self._lock:
            if self._fd is None:
                return
            try:
                with stall_watch(self.path, "an fsync of", self.stall_warn_s):
                    os.fsync(self._fd)
            except OSError as err:
                raise RunDirError.from_os_error(self.path, err) from err

    def close(self) -> None:
        """Close the file (once; later calls do nothing)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as err:  # network filesystems report late write errors here
                raise RunDirError.from_os_error(self.path, err) from err

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


#: :func:`write_atomic`'s temporary files, ``.NAME.PID.N.tmp`` beside their target: left
#: only when the process is killed mid-write.
_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.\d+\.\d+\.tmp")
_temp_ids = itertools.count()


def is_temp_file(name: str, targets: Collection[str] | None = None) -> bool:
    """Whether ``name`` is one of :func:`write_atomic`'s temporary files (for a file named
    in ``targets``, when given)."""
    match = _TEMP_NAME.fullmatch(name)
    return match is not None and (targets is None or match["target"] in targets)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (str: UTF-8) to ``path`` whole or not at all.

    The bytes go to a temporary file in the same directory, which is then renamed over
    ``path``: a reader, a killed process or a full disk finds the previous file (or none),
    never part of the new one. Not flushed to the device (a power cut is out of scope).

    Raises:
        RunDirError: naming ``path`` and the cause; the temporary file is removed and
            ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_temp_ids)}.tmp")
    view = memoryview(data.encode("utf-8") if isinstance(data, str) else data)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            while view:
                n = os.write(fd, view)
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                view = view[n:]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise RunDirError.from_os_error(path, err) from err
    return path


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order. A last line without its newline
    (cut by a kill in the middle of the kernel's copy, see :class:`MetricsWriter`) is no
    record and is left out; any other line that does not parse raises."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]

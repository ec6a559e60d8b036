"""The completion marker: what makes a published directory count (:mod:`rlcore.publish`).

A directory is complete only with its marker (:data:`MARKER_NAME`), written last, and every
file it lists at its recorded size. Files are fsynced before the marker is written, and the
marker is replaced into place, never truncated.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlcore.errors import CancelToken, Deadline, PublishError, wait_until

log = logging.getLogger(__name__)

#: Completion marker, written inside the staging directory before the rename.
MARKER_NAME = ".rlcore-complete.json"
#: Version of the marker's format. Later versions must keep ``files`` as is.
MARKER_FORMAT = 1


def fsync(path: str | os.PathLike[str]) -> None:
    """fsync a file or directory (a filesystem that cannot fsync directories is let be)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        unsupported = err.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)
        if not (unsupported and stat.S_ISDIR(os.fstat(fd).st_mode)):
            raise
    finally:
        os.close(fd)


def _raise(err: OSError) -> None:
    raise err  # a tree we cannot read must not be published with files missing


def flush_tree(staging: Path) -> dict[str, int]:
    """fsync everything under ``staging`` (bottom-up: a directory after its entries) and
    return the manifest (relative path -> size). Refuses special files, dangling symlinks
    and absolute symlinks into ``staging`` (they would dangle once published)."""
    root, manifest = os.path.abspath(staging), {}
    for dirpath, dirnames, filenames in os.walk(root, topdown=False, onerror=_raise):
        for name in filenames + dirnames:
            full = os.path.join(dirpath, name)
            rel, st = Path(os.path.relpath(full, root)).as_posix(), os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                fsync(full)
                manifest[rel] = st.st_size
            elif stat.S_ISLNK(st.st_mode):
                link = os.readlink(full)
                absolute = os.path.normpath(link) if os.path.isabs(link) else None
                if absolute and os.path.commonpath([absolute, root]) == root:
                    raise PublishError(f"{full} is an absolute symlink into the staging directory;"
                                       " it would dangle once published: make it relative")
                if not os.path.exists(full):
                    raise PublishError(f"{full} is a dangling symlink ({link})")
                if os.path.isfile(full):
                    manifest[rel] = os.path.getsize(full)
            elif not stat.S_ISDIR(st.st_mode):  # a directory is fsynced as its own dirpath
                raise PublishError(f"{full} is not a regular file, directory or symlink")
        fsync(dirpath)
    return manifest


def write_marker(staging: Path, manifest: dict[str, int]) -> None:
    now = time.time()
    created = datetime.fromtimestamp(now, UTC).isoformat()
    marker = {"format": MARKER_FORMAT, "created": created, "created_unix": now,
              "host": socket.gethostname(), "pid": os.getpid(), "files": manifest}
    tmp = staging / f"{MARKER_NAME}.tmp"  # replaced into place: never a truncated marker
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True), encoding="utf-8")
    fsync(tmp)
    os.replace(tmp, staging / MARKER_NAME)
    fsync(staging)


def _count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def read_marker(path: Path) -> dict[str, Any] | None:
    """The parsed completion marker of ``path``, or None if absent or malformed. It checks
    the marker only, not the files it lists: :func:`is_complete` says if an artifact is usable."""
    try:
        data = json.loads((Path(path) / MARKER_NAME).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not _count(data.get("format"), 1):
        return None
    files = data.get("files")
    if not isinstance(files, dict) or not all(  # sizes, of relative paths inside the directory
            _count(size, 0) and "\x00" not in rel and not {"", ".", ".."} & set(rel.split("/"))
            for rel, size in files.items()):
        return None
    return data


def is_complete(path: Path) -> bool:
    """True only if ``path`` holds a valid marker and every listed file has its recorded size.
    Never raises: a missing, unreadable or garbled directory is not complete."""
    marker = read_marker(path)
    try:
        return marker is not None and all(
            stat.S_ISREG((st := os.stat(Path(path) / rel)).st_mode) and st.st_size == size
            for rel, size in marker["files"].items())
    except (OSError, ValueError) as err:
        log.debug("%s is incomplete: %s", path, err)
        return False


def wait_for_artifact(path: Path, *, cancel: CancelToken | None = None,
                      deadline: Deadline | None = None, poll_s: float = 0.05) -> Path:
    """Wait until ``path`` is complete (see :func:`is_complete`) and return it. Raises
    :class:`~rlcore.errors.Cancelled` when ``cancel`` is set and
    :class:`~rlcore.errors.DeadlineExceeded` when ``deadline`` passes, both naming ``path``;
    without a deadline it waits until cancelled."""
    path = Path(path)
    return wait_until(lambda: path if is_complete(path) else None, what=f"artifact {path}",
                      cancel=cancel, deadline=deadline, poll_s=poll_s)

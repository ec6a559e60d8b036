"""Atomic publish of a directory: the core's implementation of ``rlcore_publish``.

An artifact (a converted checkpoint, the tiny model) is a directory that several worker
groups, threads or processes may try to create at once and that readers may look at
while it is being made. Guarantees:

* **Nothing half-written counts.** A directory is complete only if it holds the marker
  (:data:`MARKER_NAME`) and every file the marker lists has its recorded size
  (:func:`is_complete`).
* **A crash at any moment is harmless.** A publisher killed at any point (SIGKILL, a
  power loss) leaves at most scratch directories, never a destination that
  :func:`is_complete` accepts but that is not fully written.
* **One writer, one winner.** Publishers of one destination on one host write it once
  (the others wait for it); publishers anywhere end with one complete directory.

:func:`publish_dir`, and why each step exists:

1. A complete destination is returned as is: writing is expensive, artifacts immutable.
2. The destination's lock (a ``filelock.FileLock`` in this user's directory of the temp
   dir, named by the destination's path) elects one writer on this host; the others
   wait, observing their cancel token and deadline, and return once the destination is
   complete. The kernel releases a dead writer's lock, so a crash never blocks the next.
3. Holding it, scratch entries of this destination left on this host are a dead
   writer's: they are removed (:func:`clean_stale_staging` does the same for a whole
   parent, testing each entry's lock).
4. ``write(staging)`` fills a private directory beside the destination (a rename is
   atomic only within one filesystem).
5. Every file and directory is fsynced, then the marker (a manifest of every file and
   its size) is written last, through a temporary file and ``os.replace``: without the
   fsync a power loss could keep the rename but not the data, and a marker would vouch
   for zero-filled files.
6. ``os.rename(staging, destination)`` makes it visible in one step, and fails if the
   destination is a non-empty directory: if that is complete another host's publisher
   won (ours is discarded); an incomplete occupant (another tool's half-written
   directory, a damaged artifact) is moved aside to a trash name, deleted, and the
   rename retried, boundedly. The parent is fsynced after the winning rename.

Publishers on other hosts of a shared filesystem do not share a lock: both may write,
and the rename still elects one winner; their scratch entries are removed only when
older than ``max_age_s``. The destination must not change after it is published.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlcore.errors import (
    Cancelled,
    CancelToken,
    Deadline,
    DeadlineExceeded,
    PublishError,
    wait_until,
)

log = logging.getLogger(__name__)

#: Completion marker, written inside the staging directory before the rename.
MARKER_NAME = ".rlcore-complete.json"
#: Version of the marker's format. Later versions must keep ``files`` as is.
MARKER_FORMAT = 1
#: Name prefix of private staging directories (in the destination's parent).
STAGING_PREFIX = ".staging."
#: Name prefix of directories moved aside for deletion.
TRASH_PREFIX = ".trash."

# How often the rename is retried when an incomplete occupant keeps coming back.
_MAX_RENAME_ATTEMPTS = 50
# How much of the destination's name goes into scratch names (255-byte limit).
_NAME_ROOM = 96
# Errors of rename(2) meaning "the destination is occupied".
_OCCUPIED = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})
# Errors of fsync on a directory from filesystems that do not support it.
_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def _host_tag() -> str:
    """This host's name as it appears in scratch names (no dots, bounded)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:63] or "unknown-host"


def _dest_tag(name: str) -> str:
    """A destination's name as scratch names carry it (long names kept distinct)."""
    if len(name) > _NAME_ROOM:  # the 255-byte limit of a name
        name = f"{name[:_NAME_ROOM]}-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex[:16]}"
    return name


def _scratch_name(prefix: str, dest_name: str) -> str:
    """``<prefix><destination>.<host>.<unique>``: whose it is, for the cleaners."""
    return f"{prefix}{_dest_tag(dest_name)}.{_host_tag()}.{uuid.uuid4().hex}"


def _parse_scratch(name: str) -> tuple[str, str] | None:
    """(destination tag, host) of a scratch entry's name; None if not one of ours."""
    for prefix in (STAGING_PREFIX, TRASH_PREFIX):
        if name.startswith(prefix):
            parts = name[len(prefix):].rsplit(".", 2)
            if len(parts) == 3 and re.fullmatch(r"[0-9a-f]{32}", parts[2]):
                return parts[0], parts[1]
    return None


def _fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove a file or directory tree; log rather than raise (cleanup is best effort)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("could not remove %s (clean_stale_staging retries later): %s", path, err)


def _within(target: str, root: str) -> bool:
    target, root = os.path.normpath(target), os.path.normpath(root)
    return target == root or target.startswith(root + os.sep)


def _raise_walk_error(err: OSError) -> None:
    raise err


def _flush_tree(staging: Path) -> dict[str, int]:
    """fsync everything under ``staging`` and return the manifest (relative path -> size).

    Refuses what cannot be published: special files, dangling symlinks and
    absolute symlinks into the staging directory (they would dangle after the
    rename).
    """
    root = str(staging)
    manifest: dict[str, int] = {}
    # Bottom-up, so a directory is fsynced after the entries it holds.
    for dirpath, dirnames, filenames in os.walk(root, topdown=False, onerror=_raise_walk_error):
        for name in filenames + dirnames:
            full = os.path.join(dirpath, name)
            rel = Path(os.path.relpath(full, root)).as_posix()
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                continue  # fsynced as its own dirpath
            if stat.S_ISREG(st.st_mode):
                _fsync_file(full)
                manifest[rel] = st.st_size
            elif stat.S_ISLNK(st.st_mode):
                link = os.readlink(full)
                if os.path.isabs(link) and _within(link, root):
                    raise PublishError(
                        f"{full} is an absolute symlink into the staging directory; it would "
                        "dangle once published: make it relative"
                    )
                try:
                    target = os.stat(full)
                except OSError as err:
                    raise PublishError(f"{full} is a dangling symlink ({link})") from err
                if stat.S_ISREG(target.st_mode):
                    manifest[rel] = target.st_size
            else:
                raise PublishError(f"{full} is not a regular file, directory or symlink")
        _fsync_dir(dirpath)
    return manifest


def _write_marker(staging: Path, manifest: dict[str, int]) -> None:
    now = time.time()
    marker = {
        "format": MARKER_FORMAT,
        "created": datetime.fromtimestamp(now, UTC).isoformat(),
        "created_unix": now,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "files": manifest,
    }
    # Temp file + replace: even inside the private staging directory, a marker
    # under its final name is never a truncated one.
    tmp = staging / f"{MARKER_NAME}.tmp.{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, staging / MARKER_NAME)
    _fsync_dir(staging)


# ----------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------


def _safe_relpath(rel: object) -> bool:
    if not isinstance(rel, str) or not rel or "\x00" in rel or rel.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def _valid_marker(data: object) -> bool:
    if not isinstance(data, dict):
        return False
    fmt = data.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        return False
    files = data.get("files")
    if not isinstance(files, dict):
        return False
    for rel, size in files.items():
        if not _safe_relpath(rel):
            return False
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return False
    return True


def read_marker(path: Path) -> dict[str, Any] | None:
    """The parsed completion marker of ``path``, or None if absent or malformed.

    This checks the marker's structure only, not the files it lists: use
    :func:`is_complete` to decide whether an artifact can be used.
    """
    try:
        raw = (Path(path) / MARKER_NAME).read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    return data if _valid_marker(data) else None


def is_complete(path: Path) -> bool:
    """True only if ``path`` holds a valid marker and every listed file has its recorded size.

    Never raises: a missing, unreadable or garbled directory is not complete.
    """
    path = Path(path)
    marker = read_marker(path)
    if marker is None:
        return False
    try:
        for rel, size in marker["files"].items():
            st = os.stat(path / rel)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                log.debug(
                    "%s is incomplete: %s has %d bytes, marker says %d", path, rel, st.st_size, size
                )
                return False
    except (OSError, ValueError) as err:
        log.debug("%s is incomplete: %s", path, err)
        return False
    return True


def wait_for_artifact(
    path: Path,
    *,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
    poll_s: float = 0.05,
) -> Path:
    """Wait until ``path`` is complete (see :func:`is_complete`) and return it.

    Raises :class:`~rlcore.errors.Cancelled` when ``cancel`` is set and
    :class:`~rlcore.errors.DeadlineExceeded` when ``deadline`` passes, both
    naming ``path``. Without a deadline it waits until cancelled.
    """
    path = Path(path)
    return wait_until(
        lambda: path if is_complete(path) else None,
        what=f"artifact {path}",
        cancel=cancel,
        deadline=deadline,
        poll_s=poll_s,
    )


# ----------------------------------------------------------------------------
# The writer's lock, and cleaning what dead writers left
# ----------------------------------------------------------------------------


def _lock(parent: Path, dest_tag: str) -> Any:
    """The lock of destination ``parent/<dest_tag>``: in this user's directory of the
    system's temp dir, named by the destination's path, so nothing sits beside artifacts.
    Lock files stay (empty): removing one could let two holders in."""
    from filelock import FileLock

    key = hashlib.sha256(str(Path(parent).absolute() / dest_tag).encode()).hexdigest()[:32]
    root = Path(tempfile.gettempdir()) / f"rlcore-publish-locks-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    return FileLock(str(root / f"{key}.lock"))


@contextlib.contextmanager
def _writer_lock(
    destination: Path, cancel: CancelToken | None, deadline: Deadline | None, what: str
) -> Iterator[bool]:
    """Hold ``destination``'s lock while the body writes; yields False instead when the
    destination became complete while waiting for another writer (nothing to write)."""
    from filelock import Timeout

    lock = _lock(destination.parent, _dest_tag(destination.name))
    waiting = False
    while True:
        if cancel is not None:
            cancel.raise_if_cancelled(what)
        if deadline is not None:
            deadline.raise_if_expired(what)
        try:
            lock.acquire(timeout=0.1)
            break
        except Timeout:
            if is_complete(destination):
                yield False
                return
            if not waiting:
                log.info("%s is being written by another publisher; waiting for it", destination)
                what, waiting = f"{what} (being written by another publisher)", True
    try:
        yield True
    finally:
        lock.release()


def _newest_mtime(path: Path) -> float:
    """The newest mtime in a tree: an active writer anywhere in it keeps it young."""
    try:
        newest = os.lstat(path).st_mtime
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    except OSError:
        return time.time()  # changing under us: treat as young
    return newest


def _stale_reason(path: Path, max_age_s: float | None, held: set[str]) -> str | None:
    """Why scratch entry ``path`` may be removed, or None to keep it. ``held``: the
    destinations whose lock the caller holds (their entries of this host are dead)."""
    parsed = _parse_scratch(path.name)
    if parsed is not None and parsed[1] == _host_tag():
        tag = parsed[0]
        if tag in held:
            return "its writer, on this host, is gone"
        lock = _lock(path.parent, tag)
        with contextlib.suppress(Exception):
            lock.acquire(timeout=0)
            lock.release()
            return "no writer on this host holds its destination's lock"
        return None  # a live writer's: never touched, however old
    if max_age_s is not None:
        age = time.time() - _newest_mtime(path)
        if age > max_age_s:
            return f"untouched for {age:.0f}s (max_age_s={max_age_s:g})"
    return None


def clean_stale_staging(
    parent: Path, *, max_age_s: float | None = None, held: Iterable[str] = ()
) -> list[Path]:
    """Remove the ``.staging.*`` and ``.trash.*`` entries in ``parent`` that no one will
    finish: those of this host whose destination's lock no live writer holds (or whose
    lock the caller holds: ``held``, destination names), and, with ``max_age_s``, those
    of other hosts (or of unknown names) untouched for that long. A live writer's entry
    on this host is never removed.

    Safe to run concurrently: each entry is renamed to a private trash name before it is
    deleted. Returns the removed paths (their old names).
    """
    parent = Path(parent)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    tags = {_dest_tag(name) for name in held}
    removed: list[Path] = []
    for name in names:
        if not name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            continue
        path = parent / name
        reason = _stale_reason(path, max_age_s, tags)
        if reason is None:
            continue
        claim = parent / _scratch_name(TRASH_PREFIX, "stale")
        try:
            os.rename(path, claim)
        except FileNotFoundError:
            continue  # another cleaner took it
        except OSError as err:
            log.warning("could not claim stale %s for removal: %s", path, err)
            continue
        _remove(claim)
        log.info("removed stale %s: %s", path, reason)
        removed.append(path)
    return removed


# ----------------------------------------------------------------------------
# Publishing
# ----------------------------------------------------------------------------


def _displace(destination: Path) -> None:
    """Move an incomplete occupant of ``destination`` aside and delete it."""
    trash = destination.parent / _scratch_name(TRASH_PREFIX, destination.name)
    try:
        os.rename(destination, trash)
    except FileNotFoundError:
        return  # another publisher displaced it first
    except OSError as err:
        raise PublishError(
            f"{destination} is occupied by an incomplete entry that could not be moved aside: {err}"
        ) from err
    if is_complete(trash):
        # A winner landed between our check and our rename: put it back.
        try:
            os.rename(trash, destination)
            log.debug("put back %s, published meanwhile by another publisher", destination)
            return
        except OSError:
            pass  # the destination is occupied again; the caller looks at it next
    log.warning(
        "%s was occupied by an incomplete directory (no valid completion marker); "
        "it was moved aside and deleted",
        destination,
    )
    _remove(trash)


def _rename_into_place(
    staging: Path,
    destination: Path,
    cancel: CancelToken | None,
    deadline: Deadline | None,
    what: str,
) -> Path:
    for attempt in range(_MAX_RENAME_ATTEMPTS):
        if cancel is not None:
            cancel.raise_if_cancelled(what)
        try:
            os.rename(staging, destination)
        except OSError as err:
            if err.errno not in _OCCUPIED:
                raise PublishError(f"could not rename {staging} to {destination}: {err}") from err
        else:
            try:
                _fsync_dir(destination.parent)
            except OSError as err:
                # Visible and complete already; after a power loss it is either
                # there or absent, both safe. Failing the task would help nobody.
                log.warning("published %s but could not fsync its parent: %s", destination, err)
            log.info("published %s", destination)
            return destination
        if is_complete(destination):
            log.info("%s was published by another publisher first; discarding ours", destination)
            _remove(staging)
            return destination
        if deadline is not None:
            deadline.raise_if_expired(f"{what}: {destination} is occupied by an incomplete entry")
        _displace(destination)
        if attempt >= 2:
            # Something keeps recreating the occupant: back off a little.
            pause = min(0.2, 0.005 * 2**attempt)
            if cancel is not None:
                cancel.sleep(pause)
            else:
                time.sleep(pause)
    raise PublishError(
        f"could not publish {destination}: it was occupied by an incomplete entry "
        f"{_MAX_RENAME_ATTEMPTS} times in a row; is another tool writing there directly?"
    )


def publish_dir(
    destination: Path,
    write: Callable[[Path], None],
    *,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
) -> Path:
    """Publish a directory atomically at ``destination`` and return ``destination``.

    ``write(staging)`` fills a private staging directory; it must have finished
    writing when it returns and must not create :data:`MARKER_NAME`. If
    ``destination`` is already complete, ``write`` is not called. Concurrent
    callers end with exactly one winner; all of them return ``destination``.
    A caller that finds another publisher writing ``destination`` (holding its lock)
    waits for it (observing ``cancel`` and ``deadline``) instead of writing too, and
    writes itself only if that publisher fails or dies.
    See the module docstring for the protocol.

    Raises:
        PublishError: ``write`` failed (chained from its error) or the result
            cannot be published; nothing is left at ``destination`` or in staging.
        Cancelled: ``cancel`` was set (also when ``write`` raised it).
        DeadlineExceeded: ``deadline`` passed before writing or while an
            incomplete occupant kept the destination busy.
    """
    destination = Path(destination)
    what = f"publish of {destination}"
    if is_complete(destination):
        log.debug("%s is already published", destination)
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    with _writer_lock(destination, cancel, deadline, what) as must_write:
        if not must_write or is_complete(destination):  # the writer we waited for published it
            return destination
        clean_stale_staging(destination.parent, held=[destination.name])
        return _stage_and_publish(destination, write, cancel, deadline, what)


def _stage_and_publish(
    destination: Path,
    write: Callable[[Path], None],
    cancel: CancelToken | None,
    deadline: Deadline | None,
    what: str,
) -> Path:
    """Steps 3-7 of the protocol: stage, write, flush, mark, rename into place."""
    parent = destination.parent
    staging = parent / _scratch_name(STAGING_PREFIX, destination.name)
    staging.mkdir()
    log.debug("staging %s in %s", destination, staging)
    try:
        try:
            write(staging)
        except (Cancelled, DeadlineExceeded):
            raise  # control flow of the run, not a failure of this artifact
        except Exception as err:
            raise PublishError(
                f"writing {destination} failed ({type(err).__name__}: {err}); nothing was published"
            ) from err
        if cancel is not None:
            cancel.raise_if_cancelled(what)
        if os.path.lexists(staging / MARKER_NAME):
            raise PublishError(
                f"write() for {destination} created {MARKER_NAME} itself; only the core writes it"
            )
        try:
            manifest = _flush_tree(staging)
            if cancel is not None:
                cancel.raise_if_cancelled(what)
            _write_marker(staging, manifest)
        except OSError as err:
            raise PublishError(f"could not flush or mark {destination}: {err}") from err
        return _rename_into_place(staging, destination, cancel, deadline, what)
    except BaseException:
        _remove(staging)  # a no-op once the rename has succeeded
        raise

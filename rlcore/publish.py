"""Atomic publish of a directory: the core's implementation of ``rlcore_publish``.

An artifact (a converted checkpoint, the tiny model) is a directory that threads,
processes or hosts may create at once while readers look at it. Guarantees (why each
step exists: docs/decisions.md, "Publish and caches"):

* **Nothing half-written counts**: a directory is complete only with its marker
  (:data:`MARKER_NAME`), written last, and every file it lists at its recorded size.
* **A crash at any moment is harmless**: files are fsynced before the marker, one
  ``os.rename`` makes the directory visible; a killed publisher leaves only scratch
  (``.staging.*``, ``.trash.*`` beside the destination), never a false complete.
* **One writer, one winner**: a ``filelock.FileLock`` per destination elects one writer
  on a host; the others wait, and take over if it dies (the kernel drops a dead holder's
  lock). Across hosts the rename elects the winner. An incomplete occupant is moved aside
  and deleted. The destination must not change after it is published.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterable
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

_MAX_RENAME_ATTEMPTS = 50  # when an incomplete occupant keeps coming back
_OCCUPIED = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})  # rename(2)
# Scratch names say whose they are, for the cleaners: <prefix><dest tag>.<host>.<uuid4 hex>.
_SCRATCH = re.compile(r"\.(?:staging|trash)\.(.+)\.([^.]+)\.[0-9a-f]{32}")


def _host_tag() -> str:
    """This host's name as it appears in scratch names (no dots, bounded)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:63] or "unknown-host"


def _dest_tag(name: str) -> str:
    """A destination's name as scratch names carry it (long ones hashed: 255-byte names)."""
    if len(name) > 96:
        name = f"{name[:96]}-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex[:16]}"
    return name


def _scratch_name(prefix: str, dest_name: str) -> str:
    return f"{prefix}{_dest_tag(dest_name)}.{_host_tag()}.{uuid.uuid4().hex}"


def _fsync(path: str | os.PathLike[str]) -> None:
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


def _raise(err: OSError) -> None:
    raise err  # a tree we cannot read must not be published with files missing


def _flush_tree(staging: Path) -> dict[str, int]:
    """fsync everything under ``staging`` (bottom-up: a directory after its entries) and
    return the manifest (relative path -> size). Refuses special files, dangling symlinks
    and absolute symlinks into ``staging`` (they would dangle once published)."""
    root, manifest = os.path.abspath(staging), {}
    for dirpath, dirnames, filenames in os.walk(root, topdown=False, onerror=_raise):
        for name in filenames + dirnames:
            full = os.path.join(dirpath, name)
            rel, st = Path(os.path.relpath(full, root)).as_posix(), os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                _fsync(full)
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
        _fsync(dirpath)
    return manifest


def _write_marker(staging: Path, manifest: dict[str, int]) -> None:
    now = time.time()
    created = datetime.fromtimestamp(now, UTC).isoformat()
    marker = {"format": MARKER_FORMAT, "created": created, "created_unix": now,
              "host": socket.gethostname(), "pid": os.getpid(), "files": manifest}
    tmp = staging / f"{MARKER_NAME}.tmp"  # replaced into place: never a truncated marker
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True), encoding="utf-8")
    _fsync(tmp)
    os.replace(tmp, staging / MARKER_NAME)
    _fsync(staging)


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


def _lock(parent: Path, dest_tag: str) -> Any:
    """The lock of destination ``parent/<dest_tag>``, in this user's directory of the temp
    dir (nothing beside artifacts). Lock files stay: removing one could let two holders in."""
    from filelock import FileLock

    key = hashlib.sha256(str(Path(parent).absolute() / dest_tag).encode()).hexdigest()[:32]
    root = Path(tempfile.gettempdir()) / f"rlcore-publish-locks-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    return FileLock(str(root / f"{key}.lock"))


def _stale_reason(path: Path, max_age_s: float | None, held: set[str]) -> str | None:
    """Why scratch entry ``path`` may be removed, or None to keep it. ``held``: the
    destination tags whose lock the caller holds (their entries of this host are dead)."""
    ours = _SCRATCH.fullmatch(path.name)
    if ours is not None and ours[2] == _host_tag():
        if ours[1] in held:
            return "its writer, on this host, is gone"
        lock = _lock(path.parent, ours[1])
        try:
            lock.acquire(timeout=0)
        except Exception:
            return None  # a live writer's: never touched, however old
        lock.release()
        return "no writer on this host holds its destination's lock"
    if max_age_s is None:
        return None
    try:  # the newest mtime in the tree: an active writer anywhere in it keeps it young
        age = time.time() - max([os.lstat(path).st_mtime] + [
            os.lstat(os.path.join(d, n)).st_mtime for d, ds, fs in os.walk(path) for n in ds + fs])
    except OSError:
        return None  # changing under us: young
    return f"untouched for {age:.0f}s (max_age_s={max_age_s:g})" if age > max_age_s else None


def clean_stale_staging(parent: Path, *, max_age_s: float | None = None,
                        held: Iterable[str] = ()) -> list[Path]:
    """Remove the scratch entries in ``parent`` that no one will finish: this host's whose
    destination's lock no live writer holds (or the caller holds: ``held``, destination
    names), and, with ``max_age_s``, other hosts' (or unknown names) untouched for that long.
    Safe to run concurrently (an entry is renamed to a private name before it is deleted).
    Returns the removed paths (their old names)."""
    parent, tags, removed = Path(parent), {_dest_tag(name) for name in held}, []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    for path in (parent / n for n in names if n.startswith((STAGING_PREFIX, TRASH_PREFIX))):
        if (reason := _stale_reason(path, max_age_s, tags)) is None:
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


def discard(path: Path) -> None:
    """Remove a published directory so that no reader ever sees it half-deleted: one rename
    to a scratch name (from then on it is not at ``path``), then the delete, which a crash
    may leave to :func:`clean_stale_staging`."""
    path = Path(path)
    trash = path.parent / _scratch_name(TRASH_PREFIX, path.name)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    _remove(trash)


def _displace(destination: Path) -> None:
    """Move an incomplete occupant of ``destination`` aside and delete it."""
    trash = destination.parent / _scratch_name(TRASH_PREFIX, destination.name)
    try:
        os.rename(destination, trash)
    except FileNotFoundError:
        return  # another publisher displaced it first
    except OSError as err:
        raise PublishError(f"{destination} is occupied by an incomplete entry that could "
                           f"not be moved aside: {err}") from err
    if is_complete(trash):  # a winner landed between our check and our rename: put it back
        try:
            os.rename(trash, destination)
            return
        except OSError:
            pass  # occupied again; the caller looks at it next
    log.warning("%s was occupied by an incomplete directory (no valid completion marker); "
                "it was moved aside and deleted", destination)
    _remove(trash)


def _check(what: str, cancel: CancelToken | None, deadline: Deadline | None = None) -> None:
    if cancel is not None:
        cancel.raise_if_cancelled(what)
    if deadline is not None:
        deadline.raise_if_expired(what)


def publish_dir(destination: Path, write: Callable[[Path], None], *,
                cancel: CancelToken | None = None, deadline: Deadline | None = None) -> Path:
    """Publish a directory atomically at ``destination`` and return ``destination``.

    ``write(staging)`` fills a private staging directory; it must have finished writing
    when it returns and must not create :data:`MARKER_NAME`. It is not called if
    ``destination`` is complete, nor while another publisher writes it: this one waits
    (observing ``cancel`` and ``deadline``) and writes only if that one fails or dies.
    Concurrent callers end with one winner; all return ``destination``.

    Raises:
        PublishError: ``write`` failed (chained from its error) or the result cannot be
            published; nothing is left at ``destination`` or in staging.
        Cancelled: ``cancel`` was set (also when ``write`` raised it).
        DeadlineExceeded: ``deadline`` passed before writing or while an incomplete
            occupant kept the destination busy.
    """
    from filelock import Timeout

    destination = Path(destination)
    what = waiting = f"publish of {destination}"  # waiting: what a waiter's error names
    if is_complete(destination):
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock(destination.parent, _dest_tag(destination.name))
    while True:
        _check(waiting, cancel, deadline)
        try:
            lock.acquire(timeout=0.1)
            break
        except Timeout:
            if is_complete(destination):  # the writer we waited for published it
                return destination
            if waiting == what:
                log.info("%s is being written by another publisher; waiting for it", destination)
                waiting = f"{what} (being written by another publisher)"
    try:
        if is_complete(destination):
            return destination
        clean_stale_staging(destination.parent, held=[destination.name])  # dead writers' scratch
        staging = destination.parent / _scratch_name(STAGING_PREFIX, destination.name)
        staging.mkdir()
        try:
            _write_staging(staging, write, destination, cancel, what)
            return _rename_into_place(staging, destination, cancel, deadline, what)
        except BaseException:
            _remove(staging)  # a no-op once the rename has succeeded
            raise
    finally:
        lock.release()


def _write_staging(staging: Path, write: Callable[[Path], None], destination: Path,
                   cancel: CancelToken | None, what: str) -> None:
    """Let ``write`` fill ``staging``, then fsync it and write the marker last."""
    try:
        write(staging)
    except (Cancelled, DeadlineExceeded):
        raise  # control flow of the run, not a failure of this artifact
    except Exception as err:
        raise PublishError(f"writing {destination} failed ({type(err).__name__}: {err}); "
                           "nothing was published") from err
    _check(what, cancel)
    if os.path.lexists(staging / MARKER_NAME):
        raise PublishError(f"write() for {destination} created {MARKER_NAME} itself; "
                           "only the core writes it")
    try:
        manifest = _flush_tree(staging)
        _check(what, cancel)
        _write_marker(staging, manifest)
    except OSError as err:
        raise PublishError(f"could not flush or mark {destination}: {err}") from err


def _rename_into_place(staging: Path, destination: Path, cancel: CancelToken | None,
                       deadline: Deadline | None, what: str) -> Path:
    """Rename until ours or another publisher's complete directory is at ``destination``."""
    for attempt in range(_MAX_RENAME_ATTEMPTS):
        _check(what, cancel)
        try:
            os.rename(staging, destination)
        except OSError as err:
            if err.errno not in _OCCUPIED:
                raise PublishError(f"could not rename {staging} to {destination}: {err}") from err
        else:
            try:
                _fsync(destination.parent)
            except OSError as err:  # visible and complete: after a power loss there or absent
                log.warning("published %s but could not fsync its parent: %s", destination, err)
            log.info("published %s", destination)
            return destination
        if is_complete(destination):
            log.info("%s was published by another publisher first; discarding ours", destination)
            _remove(staging)
            return destination
        _check(f"{what}: {destination} is occupied by an incomplete entry", None, deadline)
        _displace(destination)
        if attempt >= 2:  # something keeps recreating the occupant: back off a little
            (cancel.sleep if cancel is not None else time.sleep)(min(0.2, 0.005 * 2**attempt))
    raise PublishError(f"could not publish {destination}: it was occupied by an incomplete entry "
                       f"{_MAX_RENAME_ATTEMPTS} times in a row; is another tool writing there "
                       "directly?")

"""Atomic publish of a directory: the core's implementation of ``rlcore_publish``.

An artifact (a converted checkpoint, a tokenizer dump...) is a directory that
several worker groups, threads or processes may try to create at once and that
readers may look at while it is being made. The protocol below gives three
guarantees:

* **Nothing half-written counts.** A directory is *complete* only if it holds
  the completion marker (:data:`MARKER_NAME`) and every file the marker lists
  exists with the recorded size (:func:`is_complete`). A directory without its
  marker is never complete, whoever made it.
* **A crash at any moment is harmless.** A publisher killed with SIGKILL (or a
  machine that loses power) leaves at most a staging directory, never a
  destination that :func:`is_complete` accepts but that is not fully written.
* **Exactly one winner.** Concurrent publishers of one destination (threads,
  processes, hosts sharing a filesystem) end with one complete directory at the
  destination; the losers discard their copies and return the winner's.

Protocol of :func:`publish_dir`, and why each step exists:

1. If the destination is already complete, return it: ``write`` is expensive
   (a checkpoint conversion) and the artifact is immutable once published.
2. Remove staging and trash directories left in the parent by dead processes
   of this host (:func:`clean_stale_staging`), so crashes do not fill the disk.
3. Create a private staging directory *beside* the destination, in the same
   parent: a rename is only atomic within one filesystem. Its name carries the
   host, pid and process start time of its owner, so that a cleaner can tell a
   live publisher's directory (never touched) from a dead one's, even after
   the pid has been reused.
4. ``write(staging)`` fills it. Nobody else looks inside, so ``write`` needs no
   care about atomicity.
5. fsync every file and directory in the staging directory. Without it, after
   a power loss the rename below could be durable while file data is not, and
   a marker would vouch for zero-filled files.
6. Write the marker (format version, time, host, pid and a manifest of every
   file and its size) through a temporary file, fsync and ``os.replace``
   *inside* the staging directory, then fsync the staging directory. The
   marker is written last, so its presence means everything before it is on
   disk; the manifest lets readers detect files truncated or removed later.
7. ``os.rename(staging, destination)``: one atomic step that makes the whole
   directory visible with its marker. A directory rename fails if the
   destination is a non-empty directory, which is what elects one winner
   without any lock:

   * if the destination is complete, another publisher won: discard ours;
   * if it is occupied but *incomplete* (a half-written directory of some
     other tool, an artifact damaged later), it is never trusted: it is moved
     aside to a unique ``.trash.*`` name (a rename, so only one displacer
     succeeds; ENOENT means someone else did it), deleted, and the rename is
     retried, in a bounded loop that honours cancellation and the deadline.

   After the winning rename the parent directory is fsynced so the new entry
   itself survives a power loss.

Before step 3, publishers of one destination elect a writer, so that concurrent
runs convert a checkpoint once instead of each converting and all but one
discarding the result: a publisher *claims* the destination by creating a
symlink ``.publishing.<name>`` in the parent whose target text names its owner
(host, pid, process start time, a unique id). ``symlink(2)`` fails if the name
exists, so exactly one claim succeeds, and ``readlink`` reads an owner whole.
A publisher that finds a live owner's claim waits (with its own cancel token and
deadline) until the destination is complete, or until the claim goes away (the
owner failed and released it), and then claims again. A claim whose owner died
(SIGKILL) is taken over: moved aside by a rename (one taker wins), after which
the claim is retried. The claim is an optimisation, never a condition for
correctness: the rename in step 7 still elects one winner if two publishers
write (a claim of another host cannot be checked for liveness, so such a claim
is not waited for), and the claim is released when ``publish_dir`` returns or
raises.

Readers call :func:`wait_for_artifact`, which polls :func:`is_complete` with the
run's cancellation token and deadline.

Known limits: the destination's content must not change after publish (the
protocol never rewrites it). Liveness of a staging directory's owner can only
be checked on its own host; directories of other hosts (shared filesystems)
are removed only when older than ``max_age_s``. Hosts that share a filesystem
must have distinct host names.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlcore.errors import Cancelled, DeadlineExceeded, PublishError
from rlcore.waiting import CancelToken, Deadline, wait_until

log = logging.getLogger(__name__)

#: Completion marker, written inside the staging directory before the rename.
MARKER_NAME = ".rlcore-complete.json"
#: Version of the marker's format. Later versions must keep ``files`` as is.
MARKER_FORMAT = 1
#: Name prefix of private staging directories (in the destination's parent).
STAGING_PREFIX = ".staging."
#: Name prefix of directories moved aside for deletion.
TRASH_PREFIX = ".trash."
#: Name prefix of a destination's claim: a symlink whose target names the publisher writing it.
CLAIM_PREFIX = ".publishing."

# How often the rename is retried when an incomplete occupant keeps coming back.
_MAX_RENAME_ATTEMPTS = 50
# How much of the destination's name goes into scratch names (255-byte limit).
_NAME_ROOM = 96
# Errors of rename(2) meaning "the destination is occupied".
_OCCUPIED = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})
# Errors of fsync on a directory from filesystems that do not support it.
_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})
_SCRATCH_TAIL_RE = re.compile(
    r"^(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>[0-9]+)\.(?P<token>[0-9a-z]+)\.(?P<uid>[0-9a-f]{32})$"
)


def _host_tag(host: str | None = None) -> str:
    """This host's name as it appears in scratch names (no dots, bounded)."""
    raw = socket.gethostname() if host is None else host
    return re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:63] or "unknown-host"


# ----------------------------------------------------------------------------
# Process identity: pid plus start time, so a reused pid is not mistaken for
# the publisher that died.
# ----------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc, or None if unavailable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    return fields[0].decode(), fields[19].decode()


def _psutil_start(pid: int) -> tuple[str, str] | None:
    """(status, start token) of ``pid`` through psutil (non-Linux), or None."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        proc = psutil.Process(pid)
        zombie = proc.status() == psutil.STATUS_ZOMBIE
        return ("Z" if zombie else "R"), f"c{int(proc.create_time() * 100)}"
    except psutil.Error:
        return None


def _start_token(pid: int) -> str:
    """A string that identifies this incarnation of ``pid``; ``x`` if unknown."""
    st = _proc_stat(pid) or _psutil_start(pid)
    return "x" if st is None else st[1]


_own_token: dict[int, str] = {}


def _own_start_token() -> str:
    pid = os.getpid()  # looked up per call: a forked child has a new pid
    token = _own_token.get(pid)
    if token is None:
        token = _own_token[pid] = _start_token(pid)
    return token


def _pid_alive(pid: int, token: str) -> bool:
    """Whether the process that created a scratch directory still runs on this host.

    Errs on the side of "alive" whenever it cannot tell.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    except OSError:
        return True
    st = _proc_stat(pid)
    if st is None:
        st = _psutil_start(pid)
        if st is None:
            return True
    state, current = st
    if state in ("Z", "X"):
        return False  # killed, not yet reaped: it will never finish
    return token == "x" or token == current


@dataclass(frozen=True)
class _Owner:
    host: str
    pid: int
    token: str


def _scratch_name(prefix: str, dest_name: str) -> str:
    """A unique name for a staging or trash entry, recording who owns it."""
    return (
        f"{prefix}{dest_name[:_NAME_ROOM]}.{_host_tag()}.{os.getpid()}."
        f"{_own_start_token()}.{uuid.uuid4().hex}"
    )


def _parse_owner(name: str) -> _Owner | None:
    """The owner recorded in a scratch name, or None if the name is not one of ours."""
    for prefix in (STAGING_PREFIX, TRASH_PREFIX):
        if name.startswith(prefix):
            parts = name[len(prefix) :].rsplit(".", 4)
            if len(parts) != 5:
                return None
            m = _SCRATCH_TAIL_RE.match(".".join(parts[1:]))
            if m is None:
                return None
            return _Owner(m["host"], int(m["pid"]), m["token"])
    return None


# ----------------------------------------------------------------------------
# Filesystem helpers
# ----------------------------------------------------------------------------


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
# Cleaning
# ----------------------------------------------------------------------------


def _newest_mtime(path: Path) -> float:
    """The newest mtime in a tree: an active writer anywhere in it keeps it young."""
    try:
        st = os.lstat(path)
        newest = st.st_mtime
        if stat.S_ISDIR(st.st_mode):
            for dirpath, dirnames, filenames in os.walk(path):
                for name in dirnames + filenames:
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    except OSError:
        return time.time()  # changing under us: treat as young
    return newest


def _stale_reason(path: Path, max_age_s: float | None) -> str | None:
    """Why ``path`` (a staging or trash entry) may be removed, or None to keep it."""
    owner = _parse_owner(path.name)
    if owner is not None and owner.host == _host_tag():
        if _pid_alive(owner.pid, owner.token):
            return None  # a live publisher's: never touched, however old
        return f"its owner, pid {owner.pid} on this host, is gone"
    if max_age_s is None:
        return None
    age = time.time() - _newest_mtime(path)
    if age > max_age_s:
        return f"untouched for {age:.0f}s (max_age_s={max_age_s:g})"
    return None


def clean_stale_staging(parent: Path, *, max_age_s: float | None = None) -> list[Path]:
    """Remove ``.staging.*`` and ``.trash.*`` entries (and ``.publishing.*`` claims) in
    ``parent`` that no one will finish.

    An entry is removed if the process that created it ran on this host and is
    gone (its pid is not alive, is a zombie, or now belongs to a process started
    later), or, if ``max_age_s`` is given, if its owner cannot be checked (other
    host, unknown name) and nothing in it changed for ``max_age_s`` seconds. A
    live publisher's staging directory on this host is never removed.

    Safe to run concurrently: each entry is claimed by renaming it to a private
    trash name before deletion. Returns the removed paths (their old names).
    """
    parent = Path(parent)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    removed: list[Path] = []
    for name in names:
        if name.startswith(CLAIM_PREFIX):
            found = _claim_owner(parent / name)
            if found is not None and found[1] is not None and found[1].host == _host_tag():
                if not _owner_alive(found[1]):
                    _take_over(parent / name, found[0])
                    removed.append(parent / name)
            continue
        if not name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            continue
        path = parent / name
        reason = _stale_reason(path, max_age_s)
        if reason is None:
            continue
        # Claim it first, so two cleaners never delete one tree at once and a
        # cleaner that dies mid-delete leaves a trash entry of its own.
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
# Claiming: one writer per destination while its owner lives
# ----------------------------------------------------------------------------


def _claim_path(destination: Path) -> Path:
    name = destination.name
    if len(name) > _NAME_ROOM:  # keep long names distinct within the 255-byte limit
        name = f"{name[:_NAME_ROOM]}-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex[:16]}"
    return destination.parent / f"{CLAIM_PREFIX}{name}"


def _owner_text() -> str:
    return f"{_host_tag()}.{os.getpid()}.{_own_start_token()}.{uuid.uuid4().hex}"


def _claim_owner(claim: Path) -> tuple[str, _Owner | None] | None:
    """(text, owner) of a claim; None if there is none. The owner is None if garbled."""
    try:
        text = os.readlink(claim)
    except FileNotFoundError:
        return None
    except OSError:  # not a symlink: nothing of ours, so nobody to wait for
        return "", None
    m = _SCRATCH_TAIL_RE.match(text)
    return text, (None if m is None else _Owner(m["host"], int(m["pid"]), m["token"]))


def _owner_alive(owner: _Owner | None) -> bool:
    return owner is not None and owner.host == _host_tag() and _pid_alive(owner.pid, owner.token)


def _take_over(claim: Path, text: str) -> None:
    """Remove the claim ``text`` of a dead owner (moved aside first: one taker wins)."""
    aside = claim.parent / _scratch_name(TRASH_PREFIX, "claim")
    try:
        os.rename(claim, aside)
    except FileNotFoundError:
        return  # another taker was first
    try:
        if os.readlink(aside) != text:
            # A live publisher claimed it between our look and our rename: give it back.
            with contextlib.suppress(OSError):
                os.rename(aside, claim)
            return
    except OSError:
        pass
    log.info("took over the claim %s of a dead publisher (%s)", claim, text)
    _remove(aside)


def _claim(
    destination: Path, cancel: CancelToken | None, deadline: Deadline | None, what: str
) -> str | None:
    """Claim ``destination`` for this publisher; returns the claim's text, or None when it
    need not write: the destination became complete while a live owner wrote it, or the
    claim belongs to another host (whose liveness cannot be checked here)."""
    claim = _claim_path(destination)
    mine = _owner_text()
    while True:
        if cancel is not None:
            cancel.raise_if_cancelled(what)
        if deadline is not None:
            deadline.raise_if_expired(what)
        try:
            os.symlink(mine, claim)
            return mine
        except FileExistsError:
            pass
        found = _claim_owner(claim)
        if found is None:
            continue  # released meanwhile
        text, owner = found
        if owner is not None and owner.host != _host_tag():
            return None  # not waited for: write, the rename still elects one winner
        if not _owner_alive(owner):
            _take_over(claim, text)
            clean_stale_staging(destination.parent)  # the dead owner's staging directory
            continue
        assert owner is not None
        log.info("%s is being written by pid %d; waiting for it", destination, owner.pid)

        def settled(text: str = text, owner: _Owner = owner) -> bool:
            current = _claim_owner(claim)
            return is_complete(destination) or current is None or current[0] != text or not _owner_alive(owner)

        wait_until(
            settled,
            what=f"{destination}, being written by pid {owner.pid} on this host",
            cancel=cancel,
            deadline=deadline,
        )
        if is_complete(destination):
            return None


def _release(destination: Path, text: str) -> None:
    claim = _claim_path(destination)
    found = _claim_owner(claim)
    if found is not None and found[0] == text:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(claim)


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
    A caller that finds a live publisher of this host already writing
    ``destination`` waits for it (observing ``cancel`` and ``deadline``) instead
    of writing too, and writes itself only if that publisher fails or dies.
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
    parent = destination.parent
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(parent)
    claim = _claim(destination, cancel, deadline, what)
    try:
        if is_complete(destination):  # published by the owner we waited for (or just before)
            return destination
        return _stage_and_publish(destination, write, cancel, deadline, what)
    finally:
        if claim is not None:
            _release(destination, claim)


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

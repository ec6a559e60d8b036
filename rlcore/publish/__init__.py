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

This module elects the writer and renames; :mod:`rlcore.publish.marker` says what makes a
directory complete, :mod:`rlcore.publish.scratch` names, locks and cleans the scratch.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from rlcore.errors import Cancelled, CancelToken, Deadline, DeadlineExceeded, PublishError
from rlcore.publish.marker import (
    MARKER_FORMAT,
    MARKER_NAME,
    flush_tree,
    fsync,
    is_complete,
    read_marker,
    wait_for_artifact,
    write_marker,
)
from rlcore.publish.scratch import (
    STAGING_PREFIX,
    TRASH_PREFIX,
    clean_stale_staging,
    dest_tag,
    discard,
    displace,
    remove,
    scratch_name,
    writer_lock,
)

__all__ = [
    "MARKER_FORMAT", "MARKER_NAME", "STAGING_PREFIX", "TRASH_PREFIX", "clean_stale_staging", "discard",
    "is_complete", "publish_dir", "read_marker", "wait_for_artifact",
]

log = logging.getLogger(__name__)

_MAX_RENAME_ATTEMPTS = 50  # when an incomplete occupant keeps coming back
_OCCUPIED = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})  # rename(2)


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
    lock = writer_lock(destination.parent, dest_tag(destination.name))
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
        staging = destination.parent / scratch_name(STAGING_PREFIX, destination.name)
        staging.mkdir()
        try:
            _write_staging(staging, write, destination, cancel, what)
            return _rename_into_place(staging, destination, cancel, deadline, what)
        except BaseException:
            remove(staging)  # a no-op once the rename has succeeded
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
        manifest = flush_tree(staging)
        _check(what, cancel)
        write_marker(staging, manifest)
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
                fsync(destination.parent)
            except OSError as err:  # visible and complete: after a power loss there or absent
                log.warning("published %s but could not fsync its parent: %s", destination, err)
            log.info("published %s", destination)
            return destination
        if is_complete(destination):
            log.info("%s was published by another publisher first; discarding ours", destination)
            remove(staging)
            return destination
        _check(f"{what}: {destination} is occupied by an incomplete entry", None, deadline)
        displace(destination)
        if attempt >= 2:  # something keeps recreating the occupant: back off a little
            (cancel.sleep if cancel is not None else time.sleep)(min(0.2, 0.005 * 2**attempt))
    raise PublishError(f"could not publish {destination}: it was occupied by an incomplete entry "
                       f"{_MAX_RENAME_ATTEMPTS} times in a row; is another tool writing there "
                       "directly?")

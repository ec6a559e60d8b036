"""Scratch beside a destination: staging and trash names, the writer's lock, and the
cleanup of what dead writers left (:mod:`rlcore.publish`).

Scratch names say whose they are (``<prefix><destination>.<host>.<uuid4 hex>``), so a
cleaner on this host can tell a dead writer's staging (no one holds its destination's
lock) from a live one's, and removes an entry only after renaming it to a private name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlcore.errors import PublishError
from rlcore.publish.marker import is_complete

log = logging.getLogger(__name__)

#: Name prefix of private staging directories (in the destination's parent).
STAGING_PREFIX = ".staging."
#: Name prefix of directories moved aside for deletion.
TRASH_PREFIX = ".trash."

# Scratch names say whose they are, for the cleaners: <prefix><dest tag>.<host>.<uuid4 hex>.
_SCRATCH = re.compile(r"\.(?:staging|trash)\.(.+)\.([^.]+)\.[0-9a-f]{32}")


def host_tag() -> str:
    """This host's name as it appears in scratch names (no dots, bounded)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:63] or "unknown-host"


def dest_tag(name: str) -> str:
    """A destination's name as scratch names carry it (long ones hashed: 255-byte names)."""
    if len(name) > 96:
        name = f"{name[:96]}-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex[:16]}"
    return name


def scratch_name(prefix: str, dest_name: str) -> str:
    return f"{prefix}{dest_tag(dest_name)}.{host_tag()}.{uuid.uuid4().hex}"


def remove(path: Path) -> None:
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


def writer_lock(parent: Path, dest_tag: str) -> Any:
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
    if ours is not None and ours[2] == host_tag():
        if ours[1] in held:
            return "its writer, on this host, is gone"
        lock = writer_lock(path.parent, ours[1])
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
    parent, tags, removed = Path(parent), {dest_tag(name) for name in held}, []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    for path in (parent / n for n in names if n.startswith((STAGING_PREFIX, TRASH_PREFIX))):
        if (reason := _stale_reason(path, max_age_s, tags)) is None:
            continue
        claim = parent / scratch_name(TRASH_PREFIX, "stale")
        try:
            os.rename(path, claim)
        except FileNotFoundError:
            continue  # another cleaner took it
        except OSError as err:
            log.warning("could not claim stale %s for removal: %s", path, err)
            continue
        remove(claim)
        log.info("removed stale %s: %s", path, reason)
        removed.append(path)
    return removed


def discard(path: Path) -> None:
    """Remove a published directory so that no reader ever sees it half-deleted: one rename
    to a scratch name (from then on it is not at ``path``), then the delete, which a crash
    may leave to :func:`clean_stale_staging`."""
    path = Path(path)
    trash = path.parent / scratch_name(TRASH_PREFIX, path.name)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    remove(trash)


def displace(destination: Path) -> None:
    """Move an incomplete occupant of ``destination`` aside and delete it."""
    trash = destination.parent / scratch_name(TRASH_PREFIX, destination.name)
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
    remove(trash)

"""Stopping processes: the process groups a backend started, the right signals, bounded
waits; and a worker group's Ray processes with their children (``psutil``).

Backends that start server processes (vLLM's and SGLang's servers, NeMo Gym's
launcher, Megatron's converter) start each in a process group of its own and stop
it with :func:`stop_group`: SIGTERM, a bounded wait, SIGKILL for what is left, a
last bounded wait. A group whose members are all zombies is gone: their parents
reap them, and a zombie holds no memory, port or GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def signal_group(pgid: int | None, sig: int) -> None:
    """Send ``sig`` to process group ``pgid`` (nothing if it is gone or None)."""
    if pgid is None:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of group ``pgid``."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.info["pid"]) == pgid:
                out.append(p.info["pid"])
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def group_gone(
    pgid: int, timeout_s: float, *, reap: Sequence[Any] = (), poll_s: float = 0.05
) -> bool:
    """Wait up to ``timeout_s`` until group ``pgid`` has no live member; whether it has none.

    ``reap`` are ``subprocess.Popen`` objects of this process in the group: polled on
    every round, so that they do not linger as zombies.
    """
    end = time.monotonic() + timeout_s
    while True:
        for p in reap:
            p.poll()
        if _no_live_member(pgid):
            for p in reap:  # one that died since the poll above is a zombie: reap it
                p.poll()
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)


def _no_live_member(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return not group_members(pgid)


def stop_group(
    pgid: int | None, grace_s: float, *, reap: Sequence[Any] = (), what: str = "process group", kill_wait_s: float = 3.0
) -> bool:
    """SIGTERM group ``pgid``, wait ``grace_s``, SIGKILL what is left, wait ``kill_wait_s``.

    Returns whether the group is gone (a warning names ``what`` if it is not). Idempotent.
    """
    if pgid is None:
        return True
    if group_gone(pgid, 0.0, reap=reap):
        return True
    signal_group(pgid, signal.SIGTERM)
    if group_gone(pgid, grace_s, reap=reap):
        return True
    signal_group(pgid, signal.SIGKILL)
    if group_gone(pgid, kill_wait_s, reap=reap):
        return True
    log.warning("%s: process group %d survived SIGKILL", what, pgid)
    return False


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (``(no log)`` if it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def kill_all(procs: Sequence[Any]) -> None:
    """SIGKILL each ``psutil.Process`` (a stopped one too: SIGKILL needs no cooperation)."""
    for p in procs:
        try:
            p.kill()
        except Exception as err:  # gone meanwhile, or not ours to kill
            log.debug("SIGKILL of %d failed: %s", p.pid, err)


def processes_of(pids: Sequence[int]) -> list[Any]:
    """``psutil.Process`` objects of ``pids`` and all their descendants (those still there)."""
    import psutil

    found: dict[int, Any] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                found[p.pid] = p
        except psutil.Error:
            continue
    return list(found.values())


def wait_exited(procs: Sequence[Any], timeout_s: float, poll_s: float = 0.05) -> list[Any]:
    """Poll until every ``psutil.Process`` in ``procs`` has exited (a zombie counts as
    exited) or ``timeout_s`` passes; returns those still running."""
    import psutil

    def running(p: Any) -> bool:
        try:
            return bool(p.is_running()) and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = [p for p in left if running(p)]
    return left

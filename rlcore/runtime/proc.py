"""Stopping the processes a backend started: process groups, the right signals, bounded waits.

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

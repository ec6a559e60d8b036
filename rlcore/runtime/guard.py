"""A guard for a server a worker starts: ``python -m rlcore.runtime.guard --watch-pid PID -- CMD...``.

It runs ``CMD`` in a process group of its own and ends the whole group (the server's
helper processes included: vLLM's engine core, SGLang's scheduler and detokenizer)
when the server exits, when the guard is told to stop (SIGTERM/SIGINT), or when the
worker ``PID`` that started it dies without cleaning up (``ray.kill``, a crash).

The guard forks once so that it is the worker's grandchild: Ray kills a dying
worker's direct children (the stub that waits for the guard) but not their
descendants, so a guard that were the direct child would die with the worker and
leave the server running. :class:`rlcore.runtime.server.GuardedServer` starts
servers this way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from rlcore.runtime.proc import group_members

#: After SIGTERM, how long the server's own handlers get before the group is SIGKILLed.
SETTLE_S = 5.0


def _watch(pid: int) -> Callable[[], bool]:
    """A callable telling whether process ``pid`` is still running (pidfd where available)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: False
    except (AttributeError, OSError):  # no pidfd: poll with signal 0

        def alive() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True

        return alive
    import select

    return lambda: not select.select([fd], [], [], 0)[0]  # readable once the process exited


def _guard(watch_pid: int, cmd: list[str]) -> int:
    """Run ``cmd``; end the process group when it exits, on SIGTERM/SIGINT, or when
    ``watch_pid`` dies. Returns the server's exit code (0 when it was stopped)."""
    worker_alive = _watch(watch_pid)
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(cmd)
    rc: int | None = None
    while rc is None and not stop and worker_alive():
        time.sleep(0.2)
        rc = child.poll()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _signal_the_rest(signal.SIGTERM)
    try:
        child.wait(SETTLE_S)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(0.5)  # the server's helper processes finish their own SIGTERM handling
    _signal_the_rest(signal.SIGKILL)
    return rc or 0


def _signal_the_rest(sig: int) -> None:
    """Signal every process of this group but the guard and its stub: the stub must live
    to pass the server's exit code on (a group-wide signal would replace it with -15)."""
    ours = {os.getpid(), os.getppid()}
    for pid in group_members(os.getpgrp()):
        if pid not in ours:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "--watch-pid" or argv[2] != "--":
        print("usage: python -m rlcore.runtime.guard --watch-pid PID -- CMD...", file=sys.stderr)
        return 2
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # lead our own group, so ending "the group" never reaches our parent's
    guard = os.fork()
    if guard == 0:  # the guard: the worker's grandchild (see the module doc)
        code = 1
        try:
            code = _guard(int(argv[1]), argv[3:])
        finally:
            os._exit(code)
    _, status = os.waitpid(guard, 0)  # the stub: the worker's direct child
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())

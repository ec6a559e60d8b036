"""Process-group teardown: SIGTERM, bounded waits, SIGKILL for what ignores it, zombies gone."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from rlcore.runtime.proc import group_gone, group_members, log_tail, stop_group

IGNORES_TERM = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def start(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_group_that_ignores_sigterm_is_killed() -> None:
    proc = start(IGNORES_TERM)
    pgid = proc.pid
    assert len(group_members(pgid)) == 2  # the launcher and its grandchild
    assert stop_group(pgid, grace_s=0.5, reap=[proc], what="test group")
    assert group_members(pgid) == [] and proc.poll() == -signal.SIGKILL
    assert stop_group(pgid, grace_s=0.5, reap=[proc])  # idempotent


def test_a_group_that_ends_on_sigterm_is_not_killed() -> None:
    proc = start("import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    assert stop_group(proc.pid, grace_s=30, reap=[proc])
    assert proc.returncode == -signal.SIGTERM


def test_only_zombies_left_counts_as_gone() -> None:
    # The leader exits without being reaped (a zombie of this process): the group is gone.
    proc = start("print('ready', flush=True)\n")
    assert group_gone(proc.pid, timeout_s=30)
    proc.wait()


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)))
    assert log_tail(log, 3) == "line 97\nline 98\nline 99"
    assert log_tail(tmp_path / "missing.log") == "(no log)"

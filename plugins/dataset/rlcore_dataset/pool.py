"""Reward functions run in processes of their own, concurrently, each call bounded.

A :class:`RewardPool` owns ``workers`` :class:`RewardProcess` children (``spawn``ed: the
driver runs Ray and threads, which ``fork`` would copy half-way), each with the reward
functions loaded once. A call runs in one free process; a call past its timeout gets its
process (and the process group it leads: whatever the function started) killed, so a hung
reward is ended, not abandoned, and the next call that process slot serves starts a fresh
one first (a run that ends on the timeout starts none). A call that raises (with the
traceback frames of the user's own code), or a process that dies, is an :class:`Outcome`
with the reason; the caller decides what it means (:mod:`rlcore_dataset.scoring`).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import subprocess
import sys
import sysconfig
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: How often a wait for a reply looks at whether the process is still alive.
POLL_S = 0.05
#: What a process gets to exit after it is asked to before it is killed.
EXIT_GRACE_S = 2.0
#: The most frames of a raising reward function's own code an error shows (the innermost).
MAX_USER_FRAMES = 8


@dataclass(frozen=True)
class Call:
    """One reward call: function ``fn`` (one of the pool's specs), its keyword arguments."""

    fn: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What a call gave: ``scores`` (one per completion, not yet checked), or ``error``;
    for a function that raised, ``trace``: its own frames (:func:`user_frames`), or ``""``."""

    scores: list[float] | None = None
    error: str | None = None
    trace: str = ""


class RewardProcessError(RuntimeError):
    """A reward process did not start (its functions did not load) within its deadline."""


def _serve(specs: Sequence[str]) -> None:
    """The reward process (``python -m rlcore_dataset.pool SPEC...``): load the functions,
    then answer calls on stdin/stdout until told to stop. What the functions print goes to
    stderr: stdout is the channel."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver ends it; Ctrl-C is the driver's
    conn_in = Connection(os.dup(0), writable=False)
    conn_out = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    from rlcore_dataset import rewards
    send, recv = conn_out.send, conn_in.recv

    try:
        fns = {s: rewards.load(s) for s in specs}
    except Exception as err:  # noqa: BLE001 - reported to the parent, which names it
        send(("load_error", f"{type(err).__name__}: {err}"))
        return
    send(("ready", None))
    while True:
        try:
            msg = recv()
        except EOFError:
            return
        if msg is None:
            return
        call: Call = msg
        try:
            out = rewards.call(fns[call.fn], call.arguments)
        except BaseException as err:  # noqa: BLE001 - the user's function: any failure is reported
            send(("error", (f"raised {type(err).__name__}: {err}", user_frames(err.__traceback__))))
            continue
        send(_as_floats(out))


def _dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where code that is not the user's lives: rlcore's and this plugin's, then the
    standard library's and installed packages' (each ending in a separator)."""
    import rlcore

    paths = sysconfig.get_paths()
    ours = {os.path.dirname(rlcore.__file__), os.path.dirname(__file__)}
    libraries = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(_as_dir(d) for d in ours), tuple(_as_dir(d) for d in libraries)


def _as_dir(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


def user_frames(tb: Any, *, limit: int = MAX_USER_FRAMES) -> str:
    """The frames of ``tb`` in the user's own code (outside rlcore, the standard library
    and installed packages), the innermost ``limit``, as Python prints them (``File
    "reward.py", line 7, in correct`` and its source line); for a function that lives in an
    installed package, its frames outside rlcore. ``""`` when there are none."""
    ours, libraries = _dirs()
    frames = [(f, os.path.realpath(f.filename)) for f in traceback.extract_tb(tb) if not f.filename.startswith("<")]
    user = [f for f, path in frames if not path.startswith(ours + libraries)]
    user = user or [f for f, path in frames if not path.startswith(ours)]
    return "".join(traceback.format_list(user[-limit:])).rstrip("\n")


def _as_floats(out: Any) -> tuple[str, Any]:
    """A reward function's return value as a list of floats, or why it is not one."""
    if hasattr(out, "tolist"):  # numpy arrays, torch tensors
        out = out.tolist()
    if not isinstance(out, list | tuple):
        return ("error", f"returned a {type(out).__name__}, not a list of floats")
    scores = []
    for i, x in enumerate(out):
        if isinstance(x, bool) or not isinstance(x, int | float):
            return ("error", f"returned {x!r} ({type(x).__name__}) at index {i}, not a float")
        scores.append(float(x))
    return ("ok", scores)


class RewardProcess:
    """One child process serving reward calls, one at a time."""

    def __init__(self, specs: Sequence[str], *, index: int, start_timeout_s: float) -> None:
        self.specs, self.index, self.start_timeout_s = list(specs), index, start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._send: Any = None
        self._recv: Any = None
        self.restarts = 0
        self.closed = False
        #: Killed after a call (a timeout, or it died): the next call starts a fresh one first.
        self.stopped = False

    def start(self) -> None:
        """Start the child and wait until its functions are loaded."""
        from multiprocessing.connection import Connection

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlcore_dataset.pool", *self.specs],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            start_new_session=True,  # a group of its own: a kill takes what the function started too
        )
        self._send = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self._recv = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        reply = self._wait(self.start_timeout_s)
        if reply is None or reply[0] != "ready":
            why = "did not load its functions in time" if reply is None else reply[1] or "it exited"
            self.kill()
            raise RewardProcessError(f"reward process {self.index} failed to start: {why}")

    def pid(self) -> int | None:
        """The running process's id; None before it starts and once it is killed."""
        return self.proc.pid if self.proc is not None and not self.stopped else None

    def call(self, call: Call, timeout_s: float) -> Outcome:
        """Run ``call``; past ``timeout_s`` the process is killed (the next call starts a
        fresh one: :meth:`_restart`)."""
        if self.stopped:
            if self.closed:
                return Outcome(error="the reward pool was closed")
            self._restart()
        try:
            self._send.send(call)
        except (BrokenPipeError, OSError):
            return self._lost("was gone before the call")
        reply = self._wait(timeout_s)
        if reply is None:
            self.kill()
            self.stopped = True
            return Outcome(
                error=f"timed out after {timeout_s:g} s (env.options.reward_timeout_s): the call did not "
                "return in time, so its process and what it started were killed"
            )
        kind, value = reply
        if kind == "gone":
            return self._lost("exited during the call")
        if kind == "ok":
            return Outcome(scores=value)
        error, trace = value if isinstance(value, tuple) else (value, "")
        return Outcome(error=error, trace=trace)

    def _lost(self, what: str) -> Outcome:
        self.kill()  # reaps it: the exit code is known after
        code = self.proc.returncode if self.proc is not None else None
        self.stopped = True
        return Outcome(error=f"its process {what} (exit code {code})")

    def _restart(self) -> None:
        """A fresh process in place of the one killed after an earlier call (started when a
        call needs it, not at the kill: a run that ends on that call starts none)."""
        self.restarts += 1
        self.start()
        self.stopped = False

    def _wait(self, timeout_s: float) -> tuple[str, Any] | None:
        """The child's next message, ``("gone", None)`` when it died, or None when nothing
        came in time."""
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            try:
                if self._recv.poll(max(0.0, min(POLL_S, left))):
                    return self._recv.recv()
            except (EOFError, OSError):
                return ("gone", None)
            if self.proc.poll() is not None:
                return ("gone", None)
            if left <= 0:
                return None

    def kill(self) -> None:
        """Kill the child and its process group now; returns once it is reaped."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        try:
            self.proc.wait(EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("reward process %d did not exit after SIGKILL", self.proc.pid)
        for conn in (self._send, self._recv):
            conn.close()

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not in time."""
        self.closed = True
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self._send.send(None)
                self.proc.wait(EXIT_GRACE_S)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class RewardPool:
    """``workers`` reward processes and the threads that feed them."""

    def __init__(
        self, specs: Sequence[str], *, workers: int, timeout_s: float, start_timeout_s: float = 120.0
    ) -> None:
        self.timeout_s = timeout_s
        self.procs = [RewardProcess(specs, index=i, start_timeout_s=start_timeout_s) for i in range(workers)]
        self._free: queue.Queue[RewardProcess] = queue.Queue()
        self._threads: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start every process (concurrently); on a failure, stop the rest and raise."""
        self._threads = ThreadPoolExecutor(max_workers=len(self.procs), thread_name_prefix="rlcore-reward")
        try:
            for f in [self._threads.submit(p.start) for p in self.procs]:
                f.result()
        except BaseException:
            self.close()
            raise
        for p in self.procs:
            self._free.put(p)

    def run(self, calls: Sequence[Call]) -> list[Outcome]:
        """Every call's outcome, in order; calls run concurrently, one per process."""
        if self._threads is None:
            raise RuntimeError("the reward pool is not started (or is closed)")
        return list(self._threads.map(self._one, calls))

    def _one(self, call: Call) -> Outcome:
        proc = self._free.get(timeout=self.timeout_s * 2 + 60 * len(self.procs))  # every call is bounded
        try:
            return proc.call(call, self.timeout_s)
        except RewardProcessError as err:
            return Outcome(error=str(err))
        finally:
            self._free.put(proc)

    def pids(self) -> list[int]:
        return [p for p in (proc.pid() for proc in self.procs) if p is not None]

    def close(self) -> None:
        """Stop every process and thread; safe to call twice."""
        for p in self.procs:
            p.close()
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
            self._threads = None


def finite(scores: Sequence[float]) -> int | None:
    """The index of the first score that is not finite, or None."""
    return next((i for i, s in enumerate(scores) if not math.isfinite(s)), None)


if __name__ == "__main__":
    _serve(sys.argv[1:])

"""Error types of rlcore.

Every error rlcore raises is an :class:`RlcoreError`. Messages name the thing at
fault (config key, plugin and distribution, backend, task) and say what to do.

The two things every wait in rlcore observes live here too, beside the errors they end in:
a :class:`CancelToken` is set once by whoever decides the run is over (the executor, on
the first failure); a :class:`Deadline` is a point in monotonic time; :func:`wait_until`
polls a condition until it holds, the token is set or the deadline passes, so no wait in
rlcore can block forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar


class RlcoreError(Exception):
    """Base class of every error rlcore raises on purpose."""


class ConfigError(RlcoreError):
    """The run's configuration is invalid: unknown key, wrong type, bad value."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class PluginError(RlcoreError):
    """A plugin could not be loaded, validated or registered."""

    def __init__(self, message: str, *, plugin: str, distribution: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution


class DeclarationError(PluginError):
    """A backend's declaration is invalid or contradicts itself."""


class BackendNotFoundError(RlcoreError):
    """The config selects a backend that no loaded plugin provides for that role."""


class PlanError(RlcoreError):
    """The declarations cannot be turned into a setup plan (cycle, missing producer)."""


class Cancelled(RlcoreError):
    """A wait was abandoned because the run was cancelled (another task failed)."""


class DeadlineExceeded(RlcoreError):
    """A wait or a task ran past its deadline."""


class PublishError(RlcoreError):
    """An artifact could not be published or a published artifact is unusable."""


class CheckpointError(RlcoreError):
    """A training checkpoint that cannot be written, found or loaded: none usable in a run
    directory (naming what was found), one of another config, backend or format version
    (naming the difference), or a backend's ``load_checkpoint`` that cannot take it."""


class RefitError(RlcoreError):
    """A weight sync from policy to generation failed."""


class SetupError(RlcoreError):
    """Setup failed: one task's failure, with what was aborted and torn down.

    Attributes:
        task: the name of the task that failed first (e.g. ``init:generation``).
        backend: the backend that task ran, or ``None`` for core tasks.
        role: the role of the task (``policy``, ``generation``, ``env``, ``refit``).
        cause: the exception that task raised.
        aborted: tasks that were cancelled or never started because of it.
        shut_down: backends that were started and have been shut down again.
    """

    def __init__(
        self,
        *,
        task: str,
        backend: str | None,
        role: str,
        cause: BaseException,
        aborted: Sequence[str] = (),
        shut_down: Sequence[str] = (),
        shutdown_errors: Sequence[str] = (),
    ) -> None:
        self.task = task
        self.backend = backend
        self.role = role
        self.cause = cause
        self.aborted = list(aborted)
        self.shut_down = list(shut_down)
        self.shutdown_errors = list(shutdown_errors)
        who = f"backend '{backend}' (role {role})" if backend else f"role {role}"
        lines = [
            f"setup failed in task '{task}' of {who}: {type(cause).__name__}: {cause}",
            f"  aborted: {', '.join(self.aborted) or 'nothing'}",
            f"  shut down: {', '.join(self.shut_down) or 'nothing'}",
        ]
        lines += [f"  shutdown error: {e}" for e in self.shutdown_errors]
        super().__init__("\n".join(lines))


class WorkerError(RlcoreError):
    """A worker of a backend failed or died; the message names the group and rank."""


class WorkerLost(WorkerError):
    """A worker's process is gone (a Ray actor death, a killed server), not merely an
    error it raised. A handle call that finds one of its workers gone raises it (handles
    built on :class:`rlcore.runtime.worker_group.WorkerGroup` do so by themselves); with
    ``generation.on_worker_loss: replace`` the run then replaces a lost generation.

    Attributes:
        worker: the lost worker's label (``vllm-generation rank 0``).
        index: its position among the refs of the call that found it.
        rank: its rank in its worker group, where the call knew it (``None`` otherwise).
        role: the role whose worker it was, once a caller that knows it has said so
            (:meth:`tag`: the run's guarded handles, the core's refit); ``None`` until then.
            Only a loss known to be the generation's is replaced.
    """

    def __init__(self, message: str, *, worker: str, index: int = 0, rank: int | None = None) -> None:
        super().__init__(message)
        self.worker = worker
        self.index = index
        self.rank = rank
        self.role: str | None = None

    def tag(self, role: str) -> WorkerLost:
        """Say whose worker it was, unless a caller nearer the worker already did."""
        if self.role is None:
            self.role = role
        return self


class ClusterLost(RlcoreError):
    """The Ray cluster's head (its GCS) went away mid-run (:mod:`rlcore.runtime.head_watch`);
    the run has been torn down.

    Attributes:
        address: the GCS's ``host:port``.
        silent_s: how long it had accepted no connection when it was declared lost.
    """

    def __init__(self, message: str, *, address: str, silent_s: float) -> None:
        super().__init__(message)
        self.address = address
        self.silent_s = silent_s


class NotServingError(RlcoreError):
    """A generation engine cannot serve: no weights yet (refit-fed, before the first
    refit) or weights left half-updated by a failed refit. Endpoints answer 503."""


class ProtocolError(RlcoreError):
    """A backend's handle broke the contract of :mod:`rlcore.handles` at run time.

    Attributes:
        backend: the backend's declared name.
        role: ``policy``, ``generation`` or ``env``.
        method: the handle method that was called.
    """

    def __init__(self, message: str, *, backend: str, role: str, method: str) -> None:
        super().__init__(message)
        self.backend = backend
        self.role = role
        self.method = method


class MismatchError(RlcoreError):
    """On a step's own samples the generation's token probabilities left the policy's by more
    than ``grpo.max_mismatch`` (with ``grpo.on_mismatch: stop``; :mod:`rlcore.app.mismatch`).

    Attributes:
        kl: the step's ``mismatch/kl`` estimate.
        step: the step that was not trained.
    """

    def __init__(self, message: str, *, kl: float | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.kl = kl
        self.step = step


class DivergenceError(RefitError):
    """After a refit the generation's logprobs left the policy's by more than
    ``refit.max_mult_prob_error``: the engine computes with other weights than the
    policy trains, so training on its samples would be silently wrong.

    Attributes:
        mult_prob_error: the measured ``refit/token_mult_prob_error`` (``None`` if unknown).
        step: the step whose refit failed the check (``None`` if unknown).
    """

    def __init__(self, message: str, *, mult_prob_error: float | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.mult_prob_error = mult_prob_error
        self.step = step


class RunDirError(RlcoreError):
    """A file of the run directory could not be written: a full disk, a read-only mount, a
    lost permission. What was written before is left valid: ``metrics.jsonl`` ends at its
    last whole line, every other file is its previous version or absent.

    Attributes:
        path: the file that could not be written.
        errno: the operating system's error number (``errno.ENOSPC`` for a full disk), if any.
    """

    def __init__(self, message: str, *, path: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno

    @classmethod
    def from_os_error(
        cls, path: object, err: OSError, *, left: str = "what was written before is intact"
    ) -> RunDirError:
        """``writing PATH: No space left on device [Errno 28]; what was written before is
        intact``: the file, the cause and what is left (``left``)."""
        cause = err.strerror or str(err) or type(err).__name__
        if err.errno is not None:
            cause += f" [Errno {err.errno}]"
        return cls(
            f"writing {path}: {cause}; {left}",
            path=str(path),
            errno=err.errno,
        )


T = TypeVar("T")


class CancelToken:
    """A one-shot, thread-safe cancellation flag with the reason it was set."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason: str | None = None
        self._lock = threading.Lock()

    def cancel(self, reason: str) -> None:
        """Set the token. The first reason given is kept."""
        with self._lock:
            if self._reason is None:
                self._reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def raise_if_cancelled(self, what: str = "wait") -> None:
        """Raise :class:`Cancelled` naming ``what`` if the token is set."""
        if self._event.is_set():
            raise Cancelled(f"{what} cancelled: {self._reason}")

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return True early if cancelled meanwhile."""
        return self._event.wait(max(0.0, seconds))


class Deadline:
    """A point in monotonic time by which something must be done."""

    def __init__(self, seconds: float | None, what: str = "operation") -> None:
        self.what = what
        self.seconds = seconds
        self._at = None if seconds is None else time.monotonic() + seconds

    @classmethod
    def never(cls, what: str = "operation") -> Deadline:
        return cls(None, what)

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` for no deadline."""
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    @property
    def expired(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at

    def raise_if_expired(self, detail: str = "") -> None:
        if self.expired:
            extra = f": {detail}" if detail else ""
            raise DeadlineExceeded(f"{self.what} exceeded its deadline of {self.seconds:g}s{extra}")

    def sooner(self, seconds: float | None, what: str | None = None) -> Deadline:
        """The earlier of this deadline and ``seconds`` from now."""
        other = Deadline(seconds, what or self.what)
        if other._at is None or (self._at is not None and self._at <= other._at):
            return self
        return other


def wait_until(
    condition: Callable[[], T | None],
    *,
    what: str,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
    poll_s: float = 0.05,
    max_poll_s: float = 0.5,
) -> T:
    """Poll ``condition`` until it returns something other than None/False.

    Raises :class:`Cancelled` when ``cancel`` is set and
    :class:`DeadlineExceeded` when ``deadline`` passes, each naming ``what``.
    The poll interval grows from ``poll_s`` to ``max_poll_s``.
    """
    deadline = deadline or Deadline.never(what)
    interval = poll_s
    while True:
        if cancel is not None:
            cancel.raise_if_cancelled(what)
        result = condition()
        if result is not None and result is not False:
            return result
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(
                f"gave up waiting for {what} after {deadline.seconds:g}s "
                f"(deadline of {deadline.what})"
            )
        step = interval if remaining is None else min(interval, remaining)
        if cancel is not None:
            if cancel.sleep(step):
                cancel.raise_if_cancelled(what)
        else:
            time.sleep(step)
        interval = min(max_poll_s, interval * 1.5)

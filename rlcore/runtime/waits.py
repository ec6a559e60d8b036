"""Waiting on Ray: :func:`ray_get` observes cancellation, a deadline and the liveness
monitor, and names the worker that failed (a dead one before the errors it caused).

Every wait polls in short slices so a cancelled run never waits on a dead peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlcore.errors import (
    Cancelled,
    CancelToken,
    Deadline,
    DeadlineExceeded,
    WorkerError,
    WorkerLost,
)
from rlcore.runtime.gate import RAY_GATE
from rlcore.runtime.head_watch import HEAD_WATCH
from rlcore.runtime.liveness import LIVENESS


def _failure(ray: Any, ref: Any) -> tuple[bool, BaseException] | None:
    """(is a worker death, error) for a finished ref that failed; None if it succeeded."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as err:
        return True, err
    except ray.exceptions.RayTaskError as err:
        return False, err.cause if getattr(err, "cause", None) is not None else err
    return None


def ray_get(
    refs: Any,
    *,
    what: str,
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
    slice_s: float = 0.2,
    labels: Sequence[str] | None = None,
    settle_s: float = 2.0,
    ranks: Sequence[int] | None = None,
) -> Any:
    """``ray.get`` that observes cancellation and a deadline, and names ``what`` on failure.

    ``labels`` (one per ref, e.g. ``vllm-generation rank 0``) name the worker in
    errors; ``ranks`` (one per ref) say which rank of its group each ref's worker is
    (:attr:`WorkerLost.rank`, what a replacement restarts). When one ref fails, the others get ``settle_s`` to finish: a worker
    that *died* is the root cause and is reported before the errors it caused in
    its peers (a collective partner sees only a closed connection).
    """
    single = not isinstance(refs, list | tuple)
    pending = [refs] if single else list(refs)
    if not pending:
        # Handles that did their work in the driver return no refs; ray.wait([])
        # would start a local cluster.
        return []
    import ray

    names = list(labels) if labels is not None else [f"worker {i}" for i in range(len(pending))]
    deadline = deadline or Deadline.never(what)
    while True:
        # Checked before every slice: a cancelled run (or a closed cluster) makes no
        # further Ray call from this thread, even one the executor has abandoned.
        if cancel is not None and cancel.cancelled:
            raise Cancelled(f"{what} cancelled: {cancel.reason}")
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"{what} did not finish within {deadline.seconds:g}s")
        # A frozen worker anywhere in the run ends this wait too: in a synchronous run
        # nothing can finish without it, and the error names it (role, rank, pid).
        LIVENESS.raise_if_hung(what)
        # So does a lost head (its GCS gone): the workers may still answer, but blind.
        HEAD_WATCH.raise_if_lost(what)
        timeout = slice_s if remaining is None else min(slice_s, remaining)
        with RAY_GATE.call(what):
            ready, not_ready = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            # Surface a failure as soon as any worker fails, not after the slowest finishes.
            if any(_failure(ray, r) for r in ready):
                _raise_first_failure(ray, pending, not_ready, names, what, settle_s, ranks)
            if not not_ready:
                values = ray.get(pending)
                return values[0] if single else values


def _raise_first_failure(
    ray: Any, pending: list[Any], not_ready: list[Any], names: list[str], what: str, settle_s: float,
    ranks: Sequence[int] | None = None,
) -> None:
    """Raise a WorkerError for the failed refs, a dead worker's first (see :func:`ray_get`)."""
    if not_ready:
        ray.wait(not_ready, num_returns=len(not_ready), timeout=settle_s)
    failures = []
    for i, r in enumerate(pending):
        done, _ = ray.wait([r], timeout=0)
        found = _failure(ray, r) if done else None
        if found:
            failures.append((not found[0], i, found))  # deaths sort first
    _, i, (died, err) = min(failures, key=lambda f: (f[0], f[1]))
    others = [f"{names[j]}: {type(e).__name__}" for _, j, (_, e) in failures if j != i]
    also = f" (then: {'; '.join(others)})" if others else ""
    if died:
        rank = ranks[i] if ranks is not None else None
        raise WorkerLost(f"{what}: {names[i]} died: {err}{also}", worker=names[i], index=i, rank=rank) from err
    raise WorkerError(f"{what}: {names[i]} failed: {type(err).__name__}: {err}{also}") from err



"""A lost generation worker replaced mid-run (``generation.on_worker_loss: replace``).

How a loss is found: a generation worker's process that dies (SIGKILL, OOM killer, a
crashed engine) makes the next call on it fail with
:class:`~rlcore.errors.WorkerLost`, within one polling slice plus the settle
time of :func:`rlcore.runtime.waits.ray_get` (about 2 s) once Ray sees the actor die.
Whose worker it was is said by the caller that knows: the loop's generation
(:class:`rlcore.app.guards.GuardedGeneration`) for ``generate`` and ``logprobs``, the core's refit
(:mod:`rlcore.refit.sync`) for a refit. Only a loss known to be the generation's is
replaced; a lost policy rank (or an env's worker) still aborts the run with the error
that names it, as does every loss under the default ``abort``.

What replacing does (:class:`GenerationRecovery`), in order:

1. where the generation's engines are independent (its handle offers ``replace_engine``,
   as :class:`rlcore.runtime.generation_group.GroupGeneration` does for vLLM and SGLang),
   the pair refits through the core's channels and the loss came outside a refit (the
   other engines then hold whole weights and are free), only the lost or hung engine is
   started again (:meth:`SetupResult.replace_engine`): its process is killed, a new
   worker built and started as at setup, and refitted alone from the policy's current
   weights over a channel of its own, while the other engines keep running with their
   weights; the generation's channels are dropped, so the next refit opens new ones
   with every engine;
2. otherwise (a tensor-parallel engine cannot rejoin its group, a backend's own refit
   expects its own handle, the other engines are blocked half-way through the refit
   that lost one) the whole generation: its refit channels are dropped
   (:meth:`RefitSessions.forget_generation`), it is shut down, bounded, started again
   through its backend's own ``rlcore_init_generation`` with the context
   ``init:generation`` had (:meth:`SetupResult.restart_generation`), and refitted;
   the core names no backend, and a backend needs nothing beyond its init hook;
3. the generation's logprobs are compared with the policy's on the probe batch
   (``token_mult_prob_error``; above ``refit.max_mult_prob_error`` the run stops as after
   any refit);
4. hand back to the loop, which runs the interrupted phase of the step again with the
   same request and seed (:class:`rlcore.app.session.Session`): no sample of the step is
   dropped or scored zero, none of the failed call's partial results is used.

A hung engine (:mod:`rlcore.runtime.liveness`: its process stopped answering) is replaced
like a dead one.

The replacement is checked with the probe batch whatever ``refit.check`` says (a
replacement is rare, and it must serve the policy's weights before the loop goes on). With
``refit.check: sampled`` the loop then checks it once more as it checks every refit: the
retried rollout is the replacement's, so the step's comparison of its sampling logprobs
with the policy's (``refit/token_mult_prob_error`` of the step line) is the
replacement's; a loss during the probe after the last step (the only probe of such a run)
is replaced and the probe run again like any phase. The time a replacement takes counts in
the phase it interrupted (``timing/generate_time_s`` for a rollout).

Each loss is one record in ``metrics.jsonl`` (``generation/lost_*``: worker, rank, step,
phase, cause ``died`` or ``hung``; ``generation/replaced``: ``engine N`` or ``the
generation``; ``generation/replace_*``) with the seconds from detection to serving again
beside ``init:generation``'s setup time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rlcore.app.guards import GuardedGeneration
from rlcore.errors import CancelToken, WorkerLost
from rlcore.runtime.head_watch import HEAD_WATCH
from rlcore.runtime.liveness import WorkerHung

log = logging.getLogger(__name__)

#: Losses in a row one phase of a step may meet before the run gives up (an engine that
#: dies again at once would otherwise be restarted forever).
MAX_LOSSES_PER_PHASE = 2


def retry_on_generation_loss(
    fn: Callable[[], Any],
    recover: Callable[[WorkerLost, str], None] | None,
    phase: str,
) -> Any:
    """``fn()``; when it loses a generation worker and ``recover`` is given, ``recover(err,
    phase)`` (which replaces the generation) and ``fn()`` again, up to
    :data:`MAX_LOSSES_PER_PHASE` times. Any other error, or a loss that is not the
    generation's, or one while the cluster's head is gone (:mod:`rlcore.runtime.head_watch`),
    propagates at once."""
    for attempt in range(MAX_LOSSES_PER_PHASE + 1):
        try:
            return fn()
        except WorkerLost as err:
            if recover is None or err.role != "generation" or attempt == MAX_LOSSES_PER_PHASE:
                raise
            if HEAD_WATCH.error(check=True) is not None:
                raise  # no replacement without the cluster's head: the run's end says it is gone
            recover(err, phase)
    raise AssertionError("unreachable")  # pragma: no cover


class GenerationRecovery:
    """Replaces the generation after a loss (see the module doc); one call per loss.

    Args:
        setup: the run's :class:`rlcore.setup.runner.SetupResult` (restart and refit).
        generation: the loop's :class:`GuardedGeneration`; its handle is swapped.
        cancel: the run's cancellation token.
        probe_error: ``token_mult_prob_error`` of generation vs policy on the probe batch.
        check: ``check(err, step)`` raises when the error is above the run's limit.
        record: ``record(metrics, step)`` writes one metrics line.
        handoff: the colocated memory handoff, whose generation side is swapped too.
        init_time_s: ``init:generation``'s setup time, for the ratio in the record.
    """

    def __init__(
        self,
        setup: Any,
        generation: GuardedGeneration,
        cancel: CancelToken,
        *,
        probe_error: Callable[[], float],
        check: Callable[[float, int], None],
        record: Callable[[dict[str, Any], int], None],
        handoff: Any = None,
        init_time_s: float | None = None,
    ) -> None:
        self.setup, self.generation, self.cancel = setup, generation, cancel
        self.probe_error, self.check, self.record = probe_error, check, record
        self.handoff, self.init_time_s = handoff, init_time_s
        self.losses: list[dict[str, Any]] = []

    def __call__(self, err: WorkerLost, step: int, phase: str) -> None:
        detected_at, t0 = time.time(), time.monotonic()
        # A loss mid-refit leaves the other engines with half-loaded weights, blocked in the
        # abandoned channel: only a whole restart frees them.
        one = phase != "refit" and self.setup.engine_replaceable(err.rank)
        what = f"engine {err.rank}" if one else "the generation"
        log.warning("step %d (%s): %s; replacing %s", step, phase, err, what)
        shutdown_s = 0.0  # one engine: killed, not shut down, as part of its start
        if one:
            report, init_s, refit_s = self.setup.replace_engine(err.rank, step, self.cancel)
        else:
            handle, init_s = self.setup.restart_generation(self.cancel)
            self.generation.handle = handle
            if self.handoff is not None and self.handoff.generation is not None:
                self.handoff.generation = handle  # declared memory_handoff: the new engine's
            t1 = time.monotonic()
            shutdown_s = t1 - t0 - init_s
            report = self.setup.refit(step, self.cancel)
            refit_s = time.monotonic() - t1
        probe_err = self.probe_error()
        serving_at, t3 = time.time(), time.monotonic()
        loss = {
            "generation/lost_worker": err.worker,
            "generation/lost_rank": err.rank,
            "generation/lost_step": step,
            "generation/lost_during": phase,
            "generation/lost_cause": "hung" if isinstance(err, WorkerHung) else "died",
            "generation/replaced": what,
            "generation/lost_detected_at": detected_at,
            "generation/serving_again_at": serving_at,
            "generation/replace_init_time_s": init_s,
            "generation/replace_refit_time_s": refit_s,
            "generation/replace_shutdown_time_s": shutdown_s,
            "generation/replace_time_s": t3 - t0,
            "generation/replace_mult_prob_error": probe_err,
            "generation/replace_refit_transport": getattr(report, "transport", None),
            "generation/losses": len(self.losses) + 1,
        }
        if self.init_time_s:
            loss["generation/replace_vs_setup_init"] = (t3 - t0) / self.init_time_s
        self.losses.append(loss)
        self.record(loss, step)
        log.warning("step %d: %s replaced and serving in %.1fs", step, what, t3 - t0)
        self.check(probe_err, step)

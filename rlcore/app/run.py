"""``rlcore run``: set up -> GRPO loop -> report, into a run directory.

Written on the library's API, as any loop on rlcore is: :func:`rlcore.open` (load config
and plugins, every check that needs no cluster, the run directory, the cluster, the setup
plan run with progress shown) and, inside its block, the GRPO loop
(:func:`rlcore.app.grpo.run_grpo_on`: rollout, reward, train step, refit, refit check) with
this command's console lines; leaving the block writes ``metrics.jsonl``, ``trace.json``
and the plots and tears everything down (also on failure or Ctrl-C).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console

from rlcore.app.grpo import run_grpo_on
from rlcore.app.session import Session
from rlcore.app.session import open as open_session
from rlcore.errors import DivergenceError


def run_job(
    config_path: str | None,
    overrides: Sequence[str] = (),
    *,
    out: str | None = None,
    console: Console | None = None,
    setup_only: bool = False,
    extra_plugins: Sequence[tuple[str, Any]] = (),
    resume: bool = False,
) -> Path:
    """Run the main job; returns the run directory. Raises RlcoreError subclasses on failure.

    ``extra_plugins`` are (name, plugin) pairs registered beside the installed ones
    (wrapper plugins for tracing or fault injection when embedding rlcore).
    Every check that needs no cluster runs first (:mod:`rlcore.setup.preflight`): a bad
    input raises :class:`~rlcore.errors.ConfigError` before any process starts.
    ``resume`` lets ``out`` be a non-empty run directory (metrics are appended). Signals
    are the caller's to route (``rlcore run``'s :class:`~rlcore.app.interrupts.SignalGuard`).
    """
    console = console or Console()
    with open_session(
        config_path, overrides, out=out, resume=resume, needs_env=not setup_only, console=console,
        extra_plugins=extra_plugins, handle_signals=False,
    ) as s:
        if not setup_only:
            _train(s, console)
    assert s.run_dir is not None
    return s.run_dir


def _train(s: Session, console: Console) -> None:
    """The GRPO loop with ``rlcore run``'s console lines; the first refit checked first."""
    config = s.config
    how = config.refit.check
    # The first refit (refit:initial) already ran during setup. With refit.check=sampled
    # step 1's samples check it (its line carries refit/checked_step 0); with probe, now.
    if how == "probe":
        s.now = "the first refit's check"
        failure: DivergenceError | None = None
        pool = ThreadPoolExecutor(1, thread_name_prefix="rlcore-probe")
        try:  # not waited for on an interrupt: the teardown ends the call
            policy_lp = pool.submit(s.policy.logprobs, s.probe)  # beside the generation's
            generation_lp = s.generation.logprobs(s.probe)
            try:
                err0 = s.check_refit(0, generation_logprobs=generation_lp, policy_logprobs=policy_lp.result())
            except DivergenceError as failed:  # recorded first
                err0, failure = failed.mult_prob_error, failed
        finally:
            pool.shutdown(wait=False)
        s.record({
            "refit/token_mult_prob_error": err0, "refit/check": how, "refit/checked_step": 0,
            "refit/transport": s.transport,
        }, 0, step_done=False)
        if failure is not None:
            raise failure
    else:
        s.record({"refit/check": how, "refit/transport": s.transport}, 0, step_done=False)

    def on_step(m: dict[str, Any]) -> None:
        last = m["step"] >= config.grpo.steps
        s.now = "the last refit's check" if last and how == "sampled" else f"step {m['step'] + 1}"
        s.record(m, m["step"])  # run.json (first step only): a rerun may no longer replace this run
        console.print(
            f"step {m['step']:>3}  reward {m['reward/mean']:.3f}  exact {m['reward/exact']:.2f}  "
            f"refit {m['refit/weight_sync_time_s'] * 1e3:.0f} ms  "
            f"mult_prob_err {m['refit/token_mult_prob_error']:.4f} (refit {m['refit/checked_step']})  "
            f"({m['timing/step_time_s']:.1f}s: generate {m['timing/generate_time_s']:.1f}, "
            f"train {m['timing/train_time_s']:.1f}, refit {m['timing/refit_time_s']:.2f}, "
            f"handoff {m['timing/handoff_time_s']:.2f}, check {m['timing/refit_check_share']:.1%})"
        )

    def on_check(m: dict[str, Any]) -> None:
        """A refit check no step line carries (refit.check=sampled): the last refit's probe,
        or a failed check (written before the DivergenceError)."""
        s.record(m, m["step"], step_done=False)
        console.print(
            f"refit of step {m['refit/checked_step']} checked ({m['refit/check']}): "
            f"mult_prob_err {m['refit/token_mult_prob_error']:.4f}"
            f"  ({m['timing/refit_check_time_s']:.2f}s)"
        )

    s.now = "step 1"
    run_grpo_on(s, on_step=on_step, on_check=on_check)

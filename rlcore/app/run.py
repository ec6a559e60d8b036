"""``rlcore run``: set up -> GRPO loop -> report, into a run directory.

Written on the library's API, as any loop on rlcore is: :func:`rlcore.open` (load config
and plugins, every check that needs no cluster, the run directory, the cluster, the setup
plan run with progress shown) and, inside its block, the GRPO loop
(:func:`rlcore.app.grpo.run_grpo_on`: rollout, reward, train step, refit, refit check) with
this command's console lines; leaving the block writes ``metrics.jsonl``, ``trace.json``
and the plots and tears everything down (also on failure or Ctrl-C).

Each step is one console line (:func:`step_line`); what its columns mean is printed once
before the first (:func:`legend`, :data:`STEP_COLUMNS`) and said again in the README
("Reading the step lines").
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from rlcore.app.grpo import run_grpo_on
from rlcore.app.session import Session
from rlcore.app.session import open as open_session
from rlcore.errors import DivergenceError

#: What each column of a step line means, in the order they come (:func:`step_line`):
#: ``(label, meaning)``. ``failed`` is shown only by a step with failed rewards, ``lag`` only
#: by the loop that runs ahead (``grpo.max_staleness`` >= 1).
STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("reward", "mean reward of the step's samples"),
    ("exact", "share of the samples with reward 1.0"),
    ("failed", "samples whose reward failed, left out of both (env.options.on_reward_error=skip)"),
    ("refit", "time to copy the trained weights into the generation"),
    ("mult_prob_err", "(refit N): generation vs policy probabilities of the same tokens after the "
     "refit of step N; 1.0000 = same weights, the run stops above refit.max_mult_prob_error"),
    ("lag", "most steps a sample's weights were behind the policy's (at most grpo.max_staleness)"),
)
#: The step's seconds in the parentheses that end its line, in their order: ``(label,
#: meaning)``; ``ahead, waited`` only in the loop that runs ahead.
STEP_TIMES: tuple[tuple[str, str], ...] = (
    ("generate", "sample and score"),
    ("ahead, waited", "beside the last train step; what training waited for it"),
    ("train", "logprobs, train step"),
    ("refit", "the refit call"),
    ("handoff", "colocated roles passing the devices"),
    ("check", "the refit check's share"),
)
#: What only some runs' step lines show (see :data:`STEP_COLUMNS`, :data:`STEP_TIMES`).
_FAILED, _AHEAD = {"failed"}, {"lag", "ahead, waited"}
#: Columns the legend is wrapped to.
LEGEND_WIDTH = 100


def legend(*, ahead: bool = False, failed: bool = False) -> list[str]:
    """The lines that say what each column of a step line means (:data:`STEP_COLUMNS`,
    :data:`STEP_TIMES`), for a loop that runs ``ahead`` or not, with ``failed`` or not;
    within :data:`LEGEND_WIDTH` columns."""
    skip = (set() if failed else _FAILED) | (set() if ahead else _AHEAD)
    times = ", ".join(f"{label} ({text})" for label, text in STEP_TIMES if label not in skip)
    rows = [(label, text) for label, text in STEP_COLUMNS if label not in skip]
    rows.append(("(Ts: ...)", f"the step's T seconds: {times}"))
    width = max(len(label) for label, _ in rows)
    lines = ['columns of the step lines (README, "Reading the step lines"):']
    for label, text in rows:
        lines += textwrap.wrap(
            text, LEGEND_WIDTH, initial_indent=f"  {label:<{width}}  ",
            subsequent_indent=" " * (width + 4), break_on_hyphens=False,
        )
    return lines


def step_line(m: dict[str, Any]) -> str:
    """A step's console line (rich markup) from its metrics."""
    ahead = "staleness/max_staleness" in m  # the loop that runs ahead
    return (
        f"step {m['step']:>3}  reward {m['reward/mean']:.3f}  exact {m['reward/exact']:.2f}  "
        + (f"[yellow]failed {m['reward/failed']}[/yellow]  " if m.get("reward/failed") else "")
        + f"refit {m['refit/weight_sync_time_s'] * 1e3:.0f} ms  "
        f"mult_prob_err {m['refit/token_mult_prob_error']:.4f} (refit {m['refit/checked_step']})  "
        + (f"lag <= {m['staleness/lag_max']}  " if ahead else "")
        + f"({m['timing/step_time_s']:.1f}s: generate {m['timing/generate_time_s']:.1f}"
        + (f" ahead, waited {m['timing/wait_for_rollouts_time_s']:.1f}" if ahead else "")
        + f", train {m['timing/train_time_s']:.1f}, refit {m['timing/refit_time_s']:.2f}, "
        f"handoff {m['timing/handoff_time_s']:.2f}, check {m['timing/refit_check_share']:.1%})"
    )


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
    # The loop that runs ahead (grpo.max_staleness >= 1) checks every refit with the probe:
    # no sample is generated by the weights the policy has when it trains.
    how = "probe" if config.grpo.max_staleness > 0 else config.refit.check
    # The first refit (refit:initial) already ran during setup. With refit.check=sampled
    # step 1's samples check it (its line carries refit/checked_step 0); with probe, now.
    # A resumed run's first refit is the restored step's (first_step - 1), checked the same way.
    first = s.first_step - 1
    if how == "probe":
        s.now = "the first refit's check"
        failure: DivergenceError | None = None
        try:
            err0 = s.check_refit(first)
        except DivergenceError as failed:  # recorded first
            err0, failure = failed.mult_prob_error, failed
        s.record({
            "refit/token_mult_prob_error": err0, "refit/check": how, "refit/checked_step": first,
            "refit/transport": s.transport,
        }, first, step_done=False)
        if failure is not None:
            raise failure
    else:
        s.record({"refit/check": how, "refit/transport": s.transport}, first, step_done=False)

    # What the columns mean, once; the failed column's meaning once it first shows.
    ahead = config.grpo.max_staleness > 0
    failed_explained = config.env.options.get("on_reward_error") == "skip"
    for line in legend(ahead=ahead, failed=failed_explained):
        console.print(line, highlight=False, markup=False)

    def on_step(m: dict[str, Any]) -> None:
        nonlocal failed_explained
        last = m["step"] >= config.grpo.steps
        s.now = "the last refit's check" if last and how == "sampled" else f"step {m['step'] + 1}"
        s.record(m, m["step"])  # run.json (first step only): a rerun may no longer replace this run
        if m.get("reward/failed") and not failed_explained:
            failed_explained = True
            console.print(next(x for x in legend(ahead=ahead, failed=True) if x.startswith("  failed ")),
                          highlight=False, markup=False)
        console.print(step_line(m))

    def on_check(m: dict[str, Any]) -> None:
        """A refit check no step line carries (refit.check=sampled): the last refit's probe,
        or a failed check (written before the DivergenceError)."""
        s.record(m, m["step"], step_done=False)
        console.print(
            f"refit of step {m['refit/checked_step']} checked ({m['refit/check']}): "
            f"mult_prob_err {m['refit/token_mult_prob_error']:.4f}"
            f"  ({m['timing/refit_check_time_s']:.2f}s)"
        )

    s.now = f"step {s.first_step}"
    run_grpo_on(s, on_step=on_step, on_check=on_check)

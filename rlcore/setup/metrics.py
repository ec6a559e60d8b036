"""Setup metrics from measured task times.

Keys (all seconds, under ``timing/setup/``):

* ``<task>_time_s``: one per task that ran, e.g. ``timing/setup/init:policy_time_s``;
* ``total_setup_time_s``: first task start to last task end;
* ``critical_path_s``: the longest chain over the plan's *edges*, weighted by
  the measured durations: what setup would take with zero scheduling overhead
  (in-init waits are inside a task's duration, so they count where they happen);
* ``serial_sum_s``: the sum of all task durations, i.e. running them one after another;
* ``executor_overhead_s``: ``total_setup_time_s - critical_path_s``.

``serial_sum_s / total_setup_time_s`` is the speed-up that overlap bought.

The run directory's writers (``metrics.jsonl`` and the rest) are :mod:`rlcore.app.records`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rlcore.setup.executor import ExecutionResult
from rlcore.setup.plan import Plan

PREFIX = "timing/setup/"
#: The key of a setup that finished (its line in ``metrics.jsonl``, step 0).
TOTAL_KEY = f"{PREFIX}total_setup_time_s"


def task_key(name: str) -> str:
    """The metric of task ``name``'s duration: ``timing/setup/init:policy_time_s``."""
    return f"{PREFIX}{name}_time_s"


def recorded_durations(record: Mapping[str, Any], names: Iterable[str]) -> dict[str, float]:
    """The durations of the tasks ``names`` in a setup's metrics line (:func:`setup_metrics`,
    as ``metrics.jsonl`` holds it), by name; a task without a number is left out."""
    out: dict[str, float] = {}
    for name in names:
        value = record.get(task_key(name))
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def task_durations(execution: ExecutionResult) -> dict[str, float]:
    """Measured duration of every task that started and ended, by name."""
    out: dict[str, float] = {}
    for name, rec in execution.records.items():
        d = rec.duration
        if d is not None:
            out[name] = d
    return out


def measured_critical_path(plan: Plan, execution: ExecutionResult) -> tuple[float, list[str]]:
    """Longest chain over the plan's edges, weighted by measured durations."""
    return plan.timed_critical_path(task_durations(execution))


def setup_metrics(plan: Plan, execution: ExecutionResult) -> dict[str, float]:
    """The ``timing/setup/*`` metrics of one setup (see the module docstring)."""
    durations = task_durations(execution)
    metrics: dict[str, float] = {}
    order = [n for n in plan.names if n in durations]
    order += [n for n in durations if n not in order]
    for name in order:
        metrics[task_key(name)] = durations[name]
    recs = [r for r in execution.records.values() if r.start is not None and r.end is not None]
    total = (
        max(r.end for r in recs) - min(r.start for r in recs)  # type: ignore[type-var,operator]
        if recs
        else 0.0
    )
    critical, _ = measured_critical_path(plan, execution)
    metrics[TOTAL_KEY] = total
    metrics[f"{PREFIX}critical_path_s"] = critical
    metrics[f"{PREFIX}serial_sum_s"] = sum(durations.values())
    metrics[f"{PREFIX}executor_overhead_s"] = total - critical
    return metrics

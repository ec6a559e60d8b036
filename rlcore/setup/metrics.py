"""Setup metrics from measured task times, and the run's ``metrics.jsonl`` writer.

Keys (all seconds, under ``timing/setup/``):

* ``<task>_time_s``: one per task that ran, e.g. ``timing/setup/init:policy_time_s``;
* ``total_setup_time_s``: first task start to last task end;
* ``critical_path_s``: the longest chain over the plan's *edges*, weighted by
  the measured durations: what setup would take with zero scheduling overhead
  (in-init waits are inside a task's duration, so they count where they happen);
* ``serial_sum_s``: the sum of all task durations, i.e. running them one after another;
* ``executor_overhead_s``: ``total_setup_time_s - critical_path_s``.

``serial_sum_s / total_setup_time_s`` is the speed-up that overlap bought.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from rlcore.setup.executor import ExecutionResult
from rlcore.setup.plan import Plan, longest_path

PREFIX = "timing/setup/"


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
    durations = task_durations(execution)
    names = [n for n in plan.names if n in durations] or list(durations)
    deps = {n: plan.predecessors(n) for n in plan.names}
    return longest_path(names, deps, durations)


def setup_metrics(plan: Plan, execution: ExecutionResult) -> dict[str, float]:
    """The ``timing/setup/*`` metrics of one setup (see the module docstring)."""
    durations = task_durations(execution)
    metrics: dict[str, float] = {}
    order = [n for n in plan.names if n in durations]
    order += [n for n in durations if n not in order]
    for name in order:
        metrics[f"{PREFIX}{name}_time_s"] = durations[name]
    recs = [r for r in execution.records.values() if r.start is not None and r.end is not None]
    total = (
        max(r.end for r in recs) - min(r.start for r in recs)  # type: ignore[type-var,operator]
        if recs
        else 0.0
    )
    critical, _ = measured_critical_path(plan, execution)
    metrics[f"{PREFIX}total_setup_time_s"] = total
    metrics[f"{PREFIX}critical_path_s"] = critical
    metrics[f"{PREFIX}serial_sum_s"] = sum(durations.values())
    metrics[f"{PREFIX}executor_overhead_s"] = total - critical
    return metrics


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN/inf are not JSON
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl``, flushed line by line.

    Each record gets ``time`` (epoch seconds) unless it has one, and ``step``
    when given. Non-finite floats are written as ``null``. Thread-safe.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any], *, step: int | None = None) -> None:
        row: dict[str, Any] = {}
        if step is not None:
            row["step"] = step
        row.update(_jsonable(record))
        row.setdefault("time", time.time())
        line = json.dumps(row, allow_nan=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

"""Chrome-trace (Perfetto) recording of setup and training steps.

A :class:`TraceRecorder` collects complete events (``"ph": "X"``) on named
lanes (one trace "thread" per lane) and writes the JSON object format::

    {"traceEvents": [...], "displayTimeUnit": "ms"}

which https://ui.perfetto.dev and ``chrome://tracing`` open. Times are given in
seconds of one clock (``time.monotonic()`` for everything rlcore measures) and
written in microseconds relative to the recorder's origin.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlcore.app.records import write_atomic
from rlcore.errors import RunDirError
from rlcore.setup.executor import ExecutionResult
from rlcore.setup.metrics import measured_critical_path
from rlcore.setup.plan import Plan


class TraceRecorder:
    """Collects trace events; thread-safe.

    Args:
        origin_s: the time (same clock as the spans) that becomes ``ts == 0``;
            default: now on ``time.monotonic()``.
        pid: process id written in events (one process per recorder).
        process_name: shown as the process's name in the viewer.
    """

    def __init__(
        self,
        *,
        origin_s: float | None = None,
        pid: int | None = None,
        process_name: str = "rlcore",
    ) -> None:
        self.origin_s = time.monotonic() if origin_s is None else origin_s
        self.pid = os.getpid() if pid is None else pid
        self._lanes: dict[str, int] = {}
        self._events: list[dict[str, Any]] = []
        self._meta: list[dict[str, Any]] = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": self.pid,
                "tid": 0,
                "args": {"name": process_name},
            }
        ]
        self._lock = threading.Lock()

    def _us(self, t_s: float) -> float:
        return round((t_s - self.origin_s) * 1e6, 3)

    def lane(self, name: str) -> int:
        """The trace thread id of lane ``name`` (created on first use, in order)."""
        with self._lock:
            tid = self._lanes.get(name)
            if tid is None:
                tid = len(self._lanes) + 1
                self._lanes[name] = tid
                for meta, args in (("thread_name", {"name": name}), ("thread_sort_index", {"sort_index": tid})):
                    self._meta.append({"ph": "M", "name": meta, "pid": self.pid, "tid": tid, "args": args})
            return tid

    def _record(
        self, event: dict[str, Any], *, lane: str, args: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        event.update(pid=self.pid, tid=self.lane(lane))
        if args:
            event["args"] = _plain(args)
        with self._lock:
            self._events.append(event)
        return event

    def add_span(
        self,
        name: str,
        start_s: float,
        end_s: float,
        *,
        cat: str,
        lane: str,
        args: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Record a complete event from ``start_s`` to ``end_s`` on ``lane``."""
        duration_us = round(max(0.0, end_s - start_s) * 1e6, 3)
        event: dict[str, Any] = {"ph": "X", "name": name, "cat": cat, "ts": self._us(start_s), "dur": duration_us}
        return self._record(event, lane=lane, args=args)

    def add_instant(
        self,
        name: str,
        t_s: float,
        *,
        cat: str,
        lane: str,
        args: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Record a point in time (``"ph": "i"``, thread scope) on ``lane``."""
        event: dict[str, Any] = {"ph": "i", "s": "t", "name": name, "cat": cat, "ts": self._us(t_s)}
        return self._record(event, lane=lane, args=args)

    def add_execution(self, execution: ExecutionResult, plan: Plan | None = None) -> None:
        """One span per task that ran (category ``setup.task``, one lane per task),
        plus an overall ``setup`` span. ``args`` carry status, backend, role, error,
        the plan's dependencies and in-init waits, and whether the task is on the
        measured critical path."""
        critical: set[str] = set()
        if plan is not None:
            critical = set(measured_critical_path(plan, execution)[1])
        names = list(execution.records)
        if plan is not None:
            names = [n for n in plan.names if n in execution.records] + [
                n for n in names if n not in plan.names
            ]
        spans = []
        for name in names:
            rec = execution.records[name]
            if rec.start is None or rec.end is None:
                continue
            args: dict[str, Any] = {"status": rec.status}
            args.update({k: v for k, v in rec.label.items() if v is not None})
            if rec.error is not None:
                args["error"] = f"{type(rec.error).__name__}: {rec.error}"
            if rec.abandoned:
                args["abandoned"] = True
            if plan is not None:
                deps = plan.predecessors(name)
                if deps:
                    args["after"] = deps
                waits = [w.target for w in plan.waits if w.task == name]
                if waits:
                    args["waits_for"] = waits
                args["critical_path"] = name in critical
            spans.append((rec.start, rec.end))
            self.add_span(name, rec.start, rec.end, cat="setup.task", lane=name, args=args)
        if spans:
            start, end = min(s for s, _ in spans), max(e for _, e in spans)
            status = "ok" if execution.ok else "failed"
            self.add_span("setup", start, end, cat="setup", lane="setup", args={"status": status})

    @classmethod
    def from_execution(cls, execution: ExecutionResult, plan: Plan | None = None) -> TraceRecorder:
        """A recorder whose origin is the start of ``execution``, holding its spans."""
        rec = cls(origin_s=execution.start)
        rec.add_execution(execution, plan)
        return rec

    @property
    def events(self) -> list[dict[str, Any]]:
        """Metadata events, then the recorded events in order of recording."""
        with self._lock:
            return [*self._meta, *self._events]

    def to_dict(self) -> dict[str, Any]:
        return {"traceEvents": self.events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        """Write the Chrome trace JSON to ``path`` whole or not at all
        (:func:`~rlcore.app.records.write_atomic`): a failure leaves the previous
        ``path`` (or none) and no temporary file.

        Raises:
            RunDirError: naming ``path`` and the cause (a full disk, a read-only mount).
        """
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError.from_os_error(path.parent, err) from err
        return write_atomic(path, json.dumps(self.to_dict()))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):  # NaN/inf are not JSON
        return None
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)

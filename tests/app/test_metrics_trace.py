"""Setup metrics, metrics.jsonl and the Chrome trace, from a synthetic execution."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlcore.app.records import MetricsWriter, read_metrics
from rlcore.app.trace import TraceRecorder
from rlcore.setup.executor import ExecutionResult, TaskRecord, TaskSpec, execute
from rlcore.setup.metrics import setup_metrics
from rlcore.setup.plan import Edge, Plan, Task, Wait

T0 = 1000.0

# The worked example: generation refit-fed, env waits for the endpoint inside its init.
PLAN = Plan(
    tasks=(
        Task("init:policy", "policy", "megatron"),
        Task("init:generation", "generation", "megatron"),
        Task("init:env", "env", "nemo_gym"),
        Task("refit:initial", "refit", None),
    ),
    edges=(
        Edge("init:policy", "refit:initial", "needs policy up", 4),
        Edge("init:generation", "refit:initial", "needs generation up", 4),
    ),
    waits=(
        Wait("init:env", "generation.endpoint", "event", "refit:initial", "talks to the model"),
    ),
    posts={"refit:initial": ("generation.endpoint",)},
)

# (start, end) relative to T0: policy 0-10, generation 0.5-4.5, refit 10.1-12.1, env 0.2-12.3.
TIMES = {
    "init:policy": (0.0, 10.0),
    "init:generation": (0.5, 4.5),
    "init:env": (0.2, 12.3),
    "refit:initial": (10.1, 12.1),
}


def synthetic(times: dict[str, tuple[float, float]] = TIMES, plan: Plan = PLAN) -> ExecutionResult:
    records = {}
    for t in plan.tasks:
        start, end = times[t.name]
        records[t.name] = TaskRecord(
            t.name,
            status="ok",
            start=T0 + start,
            end=T0 + end,
            start_wall=1.7e9 + start,
            end_wall=1.7e9 + end,
            label={"backend": t.backend, "role": t.role},
        )
    return ExecutionResult(
        records=records,
        results={},
        start=T0,
        end=T0 + max(e for _, e in times.values()),
        start_wall=1.7e9,
    )


def test_setup_metrics_keys_and_values() -> None:
    m = setup_metrics(PLAN, synthetic())
    assert m["timing/setup/init:policy_time_s"] == pytest.approx(10.0)
    assert m["timing/setup/init:generation_time_s"] == pytest.approx(4.0)
    assert m["timing/setup/init:env_time_s"] == pytest.approx(12.1)
    assert m["timing/setup/refit:initial_time_s"] == pytest.approx(2.0)
    assert m["timing/setup/total_setup_time_s"] == pytest.approx(12.3)
    # policy -> refit (10 + 2) beats generation -> refit (4 + 2); env alone is 12.1.
    assert m["timing/setup/critical_path_s"] == pytest.approx(12.1)
    assert m["timing/setup/serial_sum_s"] == pytest.approx(28.1)
    assert m["timing/setup/executor_overhead_s"] == pytest.approx(12.3 - 12.1)
    assert all(k.startswith("timing/setup/") for k in m)
    assert all(isinstance(v, float) for v in m.values())


def test_critical_path_follows_edges_not_wall_clock() -> None:
    # A chain a -> b -> c of 1 s each, plus d (2.5 s) in parallel: critical path is the chain.
    plan = Plan(
        tasks=(
            Task("a", "x", None),
            Task("b", "x", None),
            Task("c", "x", None),
            Task("d", "x", None),
        ),
        edges=(Edge("a", "b", "", 0), Edge("b", "c", "", 0)),
    )
    times = {"a": (0.0, 1.0), "b": (1.5, 2.5), "c": (2.5, 3.5), "d": (0.0, 2.5)}
    m = setup_metrics(plan, synthetic(times, plan))
    assert m["timing/setup/critical_path_s"] == pytest.approx(3.0)  # gaps are not on it
    assert m["timing/setup/total_setup_time_s"] == pytest.approx(3.5)
    assert m["timing/setup/executor_overhead_s"] == pytest.approx(0.5)
    # Without the edges, the longest single task would be the critical path.
    flat = Plan(tasks=plan.tasks, edges=())
    assert setup_metrics(flat, synthetic(times, flat))["timing/setup/critical_path_s"] == (
        pytest.approx(2.5)
    )


def test_metrics_skip_tasks_that_never_ran() -> None:
    ex = synthetic()
    rec = ex.records["refit:initial"]
    rec.status, rec.start, rec.end = "not_started", None, None
    m = setup_metrics(PLAN, ex)
    assert "timing/setup/refit:initial_time_s" not in m
    assert m["timing/setup/critical_path_s"] == pytest.approx(12.1)


def test_metrics_from_a_real_execution() -> None:
    ex = execute([TaskSpec("a", [], lambda r: None), TaskSpec("b", ["a"], lambda r: None)])
    plan = Plan(tasks=(Task("a", "x", None), Task("b", "x", None)), edges=(Edge("a", "b", "", 0),))
    m = setup_metrics(plan, ex)
    assert 0 <= m["timing/setup/critical_path_s"] <= m["timing/setup/total_setup_time_s"]
    assert m["timing/setup/executor_overhead_s"] >= 0


@pytest.mark.perf
def test_executor_overhead_of_a_real_execution_is_small() -> None:
    ex = execute([TaskSpec("a", [], lambda r: None), TaskSpec("b", ["a"], lambda r: None)])
    plan = Plan(tasks=(Task("a", "x", None), Task("b", "x", None)), edges=(Edge("a", "b", "", 0),))
    assert setup_metrics(plan, ex)["timing/setup/executor_overhead_s"] < 0.05


def test_metrics_writer_appends_flushed_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    w = MetricsWriter(path)
    w.write({"timing/setup/total_setup_time_s": 1.5})
    # Flushed per line: readable before close.
    assert json.loads(path.read_text().splitlines()[0])["timing/setup/total_setup_time_s"] == 1.5
    w.write({"reward": math.nan, "loss": 0.25}, step=3)
    w.close()
    with MetricsWriter(path) as again:
        again.write({"x": 1})
    rows = read_metrics(path)
    assert len(rows) == 3
    assert rows[1]["step"] == 3 and rows[1]["reward"] is None and rows[1]["loss"] == 0.25
    assert all("time" in r for r in rows)


def test_trace_has_one_span_per_task_with_durations(tmp_path: Path) -> None:
    ex = synthetic()
    path = TraceRecorder.from_execution(ex, PLAN).write(tmp_path / "trace.json")
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    events = data["traceEvents"]
    tasks = [e for e in events if e["ph"] == "X" and e["cat"] == "setup.task"]
    assert sorted(e["name"] for e in tasks) == sorted(TIMES)
    for e in tasks:
        start, end = TIMES[e["name"]]
        assert e["dur"] == pytest.approx((end - start) * 1e6)
        assert e["ts"] == pytest.approx(start * 1e6)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    assert len({e["tid"] for e in tasks}) == len(tasks)  # one lane each
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(TIMES) <= names
    by_name = {e["name"]: e for e in tasks}
    assert by_name["refit:initial"]["args"]["after"] == ["init:policy", "init:generation"]
    assert by_name["init:env"]["args"]["waits_for"] == ["generation.endpoint"]
    assert by_name["init:env"]["args"]["critical_path"] is True
    assert by_name["init:policy"]["args"]["backend"] == "megatron"
    total = [e for e in events if e["ph"] == "X" and e["name"] == "setup"]
    assert len(total) == 1 and total[0]["dur"] == pytest.approx(12.3e6)


def test_trace_spans_and_instants_on_named_lanes(tmp_path: Path) -> None:
    rec = TraceRecorder(origin_s=10.0, pid=7)
    rec.add_span("step 0", 10.5, 11.0, cat="step", lane="loop", args={"reward": math.inf})
    rec.add_span("refit", 11.0, 11.25, cat="refit", lane="loop")
    rec.add_instant("endpoint up", 10.75, cat="event", lane="events")
    data = json.loads(rec.write(tmp_path / "t.json").read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in xs] == [(500000.0, 500000.0), (1000000.0, 250000.0)]
    assert xs[0]["tid"] == xs[1]["tid"] and xs[0]["pid"] == 7
    assert xs[0]["args"]["reward"] is None
    inst = [e for e in data["traceEvents"] if e["ph"] == "i"]
    assert inst[0]["ts"] == 750000.0 and inst[0]["tid"] != xs[0]["tid"]


def test_sync_puts_every_line_written_on_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a checkpoint published beside ``metrics.jsonl`` counts on finding at resume."""
    import os

    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.write({"x": 1}, step=1)
    w.sync()
    fd = w._fd
    # Only this writer's file counts: another test's writer thread may fsync meanwhile.
    assert synced.count(fd) == 1
    w.close()
    w.sync()  # closed: nothing to flush
    assert synced.count(fd) == 1

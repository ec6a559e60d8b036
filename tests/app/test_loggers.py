"""TensorBoard, W&B (offline) and MLflow get the lines ``metrics.jsonl`` gets (rlcore.app.loggers).

Each logger is real and read back with its own library (TensorBoard's EventAccumulator,
MLflow's client, and W&B's offline ``.wandb`` file, read as W&B's records); the lines come
from a :class:`LoggedWriter`, as a run's ``_Run.record`` writes them.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import pytest

from rlcore.app.cli import main
from rlcore.app.loggers import LOGGERS_FILE, LoggedWriter, scalars
from rlcore.app.records import read_metrics
from rlcore.config import RunConfig
from rlcore.errors import ConfigError
from rlcore.setup.preflight import check_loggers

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")

Series = dict[str, list[tuple[int, float]]]  # key -> [(step, value)] in the order logged


def all_on(config: RunConfig | None = None) -> RunConfig:
    config = config or RunConfig()
    config.logging.tensorboard = True
    config.logging.wandb.enabled = True
    config.logging.mlflow.enabled = True
    return config


def write_a_run(writer: LoggedWriter, first: int = 1, last: int = 3) -> None:
    """Lines as a run writes them: the setup's (step 0), steps with a NaN and notes, a
    replaced worker's strings, the reward's trend for an earlier step, an interrupt's
    line without a step."""
    if first == 1:
        writer.write({"timing/setup/init:policy_time_s": 1.25, "timing/setup/total_setup_time_s": 2.5}, step=0)
    for s in range(first, last + 1):
        writer.write({
            "reward/mean": s / 4, "train/loss": math.nan if s == 2 else -0.1 * s,
            "refit/checked_step": s - 1, "refit/ok": True, "note": f"step {s}",
        }, step=s)
    writer.write({"generation/lost_worker": "gen-0", "generation/replace_time_s": 1.5}, step=last)
    writer.write({"health/reward_first": 0.25}, step=first)  # for an earlier step
    writer.write({"run/interrupted_by": "SIGTERM", "run/interrupt_teardown_s": 0.75})


def end(writer: LoggedWriter, failure: BaseException | None = None) -> None:
    """The run's end: loggers closed (waited for whole: this process opens the libraries
    cold, which on a loaded machine may pass the run's own deadline), then the file."""
    if writer.loggers is not None:
        writer.loggers.close(failure, timeout=300)
    writer.close()


def expected(metrics: Path) -> Series:
    """What every logger must hold, from ``metrics.jsonl`` alone: each number of each line at
    its step (a line without one: the last step before it); nulls, strings, lists: none."""
    out: Series = defaultdict(list)
    step = 0
    for line in read_metrics(metrics):
        if "logging/dropped" in line:
            # The loggers' own note, written from their thread whenever one fails: it may
            # land anywhere in the file and is not sent to them, so it moves no step.
            continue
        step = line.get("step", step)
        for key, value in line.items():
            if key not in ("step", "time") and isinstance(value, int | float):
                out[key].append((step, float(value)))
    return dict(out)


# ---------------------------------------------------------------- readers


def read_tensorboard(log_dir: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()  # every event file in the directory, in order
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(run_file: Path) -> list[Any]:
    """The records of an offline run's ``.wandb`` file. wandb has no public reader of it
    (the SDK's ``DataStore`` is gone): it is LevelDB's log format (32 KiB blocks of chunks,
    each with a 7-byte header: CRC, length, type) after W&B's 7-byte header, each record
    one ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeroes: the rest of the block is empty
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def read_wandb(run_dir: Path) -> tuple[Series, list[Any]]:
    """The history (against the ``step`` metric) of every offline run under ``run_dir/wandb``,
    oldest first, and the runs' records."""
    series: Series = defaultdict(list)
    records: list[Any] = []
    for run_file in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        records += wandb_records(run_file)
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
        for key, value in row.items():
            # Numbers only: a step's samples are a table (test_each_logger_shows_the_samples...).
            if key != "step" and not key.startswith("_") and isinstance(value, int | float):
                series[key].append((row["step"], float(value)))
    return dict(series), records


def read_mlflow(run_dir: Path) -> tuple[Series, Any]:
    from mlflow.tracking import MlflowClient

    saved = json.loads((run_dir / LOGGERS_FILE).read_text())["logging.mlflow"]
    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    run = client.get_run(saved["run_id"])
    series = {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                 key=lambda m: (m.step, m.timestamp))]
        for key in run.data.metrics
    }
    return series, run


def by_step(series: Series) -> dict[str, list[tuple[int, float]]]:
    """Order-free within a step (MLflow orders by step and time)."""
    return {k: sorted(v) for k, v in series.items()}


def assert_same(got: Series, want: Series, *, rel: float = 0.0) -> None:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for key in want:
        g, w = by_step(got)[key], by_step(want)[key]
        assert [s for s, _ in g] == [s for s, _ in w], key
        assert [v for _, v in g] == pytest.approx([v for _, v in w], rel=rel), key


# ---------------------------------------------------------------- tests


def test_every_logger_holds_what_metrics_jsonl_holds_step_for_step(tmp_path: Path) -> None:
    writer = LoggedWriter(tmp_path / "metrics.jsonl", all_on())
    write_a_run(writer)
    end(writer)
    assert writer.loggers is not None and writer.loggers.dropped == {}
    # Nothing the loggers started outlives them (W&B's service process included).
    children = [c.name() for c in psutil.Process().children(recursive=True)]
    assert not [n for n in children if "wandb" in n], children

    want = expected(tmp_path / "metrics.jsonl")
    # The reading is metrics.jsonl's own: a NaN is null there and in no logger; strings and
    # the step-less line's number (at the last line's step: the trend's, 1) are as written.
    assert ("train/loss" in want) and [s for s, _ in want["train/loss"]] == [1, 3]
    assert want["run/interrupt_teardown_s"] == [(1, 0.75)]
    assert want["refit/ok"] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert "note" not in want and "generation/lost_worker" not in want

    assert_same(read_tensorboard(tmp_path / "tensorboard"), want, rel=1e-6)  # float32 events
    wandb_series, records = read_wandb(tmp_path)
    assert_same(wandb_series, want)
    mlflow_series, run = read_mlflow(tmp_path)
    assert_same(mlflow_series, want)

    # The loggers' runs carry the run's config and outcome.
    assert run.info.status == "FINISHED"
    assert run.data.params["grpo.steps"] == str(RunConfig().grpo.steps)
    assert run.data.params["logging.mlflow.enabled"] == "true"
    exits = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert [e.exit_code for e in exits] == [0]
    config = next(r.run.config for r in records if r.WhichOneof("record_type") == "run")
    grpo = next(json.loads(u.value_json) for u in config.update if u.key == "grpo")
    assert grpo["steps"] == RunConfig().grpo.steps


def test_each_logger_shows_the_samples_of_a_step_as_text(tmp_path: Path) -> None:
    lines = [
        {"step": 2, "prompt": "2+2=", "completion": "4|x", "reward": 1.0, "weight_version": 1},
        {"step": 2, "prompt": "3+1=", "completion": "5", "reward": 0.0, "weight_version": 1},
    ]
    writer = LoggedWriter(tmp_path / "metrics.jsonl", all_on())
    write_a_run(writer)
    writer.samples(lines, 2)
    end(writer)
    assert writer.loggers is not None and writer.loggers.dropped == {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    [event] = acc.Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 2 and "| 2+2= | 4\\|x | 1.0 | 1 |" in text and "3+1=" in text
    _, records = read_wandb(tmp_path)
    logged = [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
        for r in records if r.WhichOneof("record_type") == "history"
    ]
    [table] = [row for row in logged if any(k.startswith("samples") for k in row)]
    fields = {k.removeprefix("samples/"): v for k, v in table.items() if k.startswith("samples")}
    flat = fields.get("samples", fields)  # one item holding the table's JSON, or one per field
    assert table["step"] == 2 and flat["_type"] == "table-file" and flat["nrows"] == 2
    _, run = read_mlflow(tmp_path)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=json.loads((tmp_path / LOGGERS_FILE).read_text())["logging.mlflow"]["tracking_uri"])
    local = client.download_artifacts(run.info.run_id, "samples/step-000002.jsonl", str(tmp_path))
    assert [json.loads(x) for x in Path(local).read_text().splitlines()] == lines


def test_resume_logs_into_the_same_logger_runs(tmp_path: Path) -> None:
    config = all_on()
    first = LoggedWriter(tmp_path / "metrics.jsonl", config)
    write_a_run(first, 1, 2)
    end(first, KeyboardInterrupt())
    ids = json.loads((tmp_path / LOGGERS_FILE).read_text())
    _, run = read_mlflow(tmp_path)
    assert run.info.status == "KILLED"

    second = LoggedWriter(tmp_path / "metrics.jsonl", config)  # --resume: the same directory
    write_a_run(second, 3, 4)
    end(second)
    assert json.loads((tmp_path / LOGGERS_FILE).read_text())["logging.mlflow"] == ids["logging.mlflow"]
    assert json.loads((tmp_path / LOGGERS_FILE).read_text())["logging.wandb"]["id"] == ids["logging.wandb"]["id"]

    want = expected(tmp_path / "metrics.jsonl")
    assert [s for s, _ in want["reward/mean"]] == [1, 2, 3, 4]
    mlflow_series, run = read_mlflow(tmp_path)
    assert run.info.status == "FINISHED"
    assert_same(mlflow_series, want)
    assert_same(read_tensorboard(tmp_path / "tensorboard"), want, rel=1e-6)
    wandb_series, records = read_wandb(tmp_path)
    assert_same(wandb_series, want)
    run_ids = {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
    assert run_ids == {ids["logging.wandb"]["id"]}


def test_tensorboard_shows_each_step_once_after_a_resume_that_does_steps_again(tmp_path: Path) -> None:
    """The stopped run logged steps 1-4; its checkpoint is of step 2, so the resumed run
    does 3 and 4 again (issue 44): TensorBoard drops the first run's 3 and 4, shows the
    resumed run's, and each step once."""
    from rlcore.app.rundir import truncate_metrics

    config = RunConfig()
    config.logging.tensorboard = True
    first = LoggedWriter(tmp_path / "metrics.jsonl", config)
    for s in range(1, 5):
        first.write({"train/loss": float(s)}, step=s)
    end(first, KeyboardInterrupt())
    truncate_metrics(tmp_path, 2)
    second = LoggedWriter(tmp_path / "metrics.jsonl", config, resumed_after=2)
    for s in range(3, 6):
        second.write({"train/loss": 10.0 * s}, step=s)
    end(second)
    got = read_tensorboard(tmp_path / "tensorboard")["train/loss"]
    assert got == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    assert got == expected(tmp_path / "metrics.jsonl")["train/loss"]


class Recording:
    """A logger that keeps what it gets; ``fail`` makes ``log`` (or ``open``) raise."""

    def __init__(self, key: str, fail_at: int | None = None, fail_open: bool = False) -> None:
        self.key, self.fail_at, self.fail_open = key, fail_at, fail_open
        self.lines: list[tuple[int, dict[str, float]]] = []
        self.outcome: str | None = None

    def open(self, saved: Any) -> dict[str, Any]:
        if self.fail_open:
            raise ConnectionError("no network\nat all")
        return {"n": 1}

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        if step == self.fail_at:
            raise RuntimeError("disk quota")
        self.lines.append((step, values))

    def close(self, outcome: str) -> None:
        self.outcome = outcome


def test_a_logger_that_raises_is_reported_once_and_dropped_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad, dead = Recording("good"), Recording("bad", fail_at=2), Recording("dead", fail_open=True)
    writer = LoggedWriter(tmp_path / "metrics.jsonl", RunConfig(), sinks=[good, bad, dead])
    with caplog.at_level(logging.WARNING, logger="rlcore.app.loggers"):
        write_a_run(writer)
        writer.close_loggers(RuntimeError("the loop failed"))
    writer.write({"after": 1.0}, step=9)  # the writer goes on after its loggers closed
    writer.close()

    assert writer.loggers is not None
    assert set(writer.loggers.dropped) == {"bad", "dead"}
    dropped = [ln for ln in read_metrics(tmp_path / "metrics.jsonl") if "logging/dropped" in ln]
    assert [(ln["logging/dropped"], ln["step"]) for ln in dropped] == [("dead", 0), ("bad", 2)]
    assert dropped[0]["logging/dropped_error"] == "ConnectionError: no network at all"
    assert [r.getMessage() for r in caplog.records].count(
        "bad dropped after an error logging: RuntimeError: disk quota; the run goes on without it"
    ) == 1
    # The good one got every line with a number, the bad one those before its failure.
    want = expected(tmp_path / "metrics.jsonl")
    got: Series = defaultdict(list)
    for step, values in good.lines:
        for k, v in values.items():
            got[k].append((step, v))
    want.pop("after")
    assert_same(got, want)
    assert [s for s, _ in bad.lines] == [0, 1]
    # Every one is closed with the run's outcome, the dropped ones too.
    assert (good.outcome, bad.outcome, dead.outcome) == ("failed", "failed", "failed")


def test_closing_is_bounded_when_a_logger_hangs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    class Hangs(Recording):
        def close(self, outcome: str) -> None:
            release.wait(60)
            super().close(outcome)

    hung = Hangs("hung")
    writer = LoggedWriter(tmp_path / "metrics.jsonl", RunConfig(), sinks=[hung])
    writer.write({"a": 1.0}, step=1)
    try:
        with caplog.at_level(logging.WARNING, logger="rlcore.app.loggers"):
            writer.loggers.close(None, timeout=0.2)  # type: ignore[union-attr]
        assert hung.outcome is None  # still in its close: close() returned without it
        assert any("did not close by their deadline" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        writer.close()


def test_no_logger_enabled_starts_nothing(tmp_path: Path) -> None:
    before = {t.name for t in threading.enumerate()}
    writer = LoggedWriter(tmp_path / "metrics.jsonl", RunConfig())
    writer.write({"a": 1.0}, step=1)
    writer.close_loggers(None)
    writer.close()
    assert writer.loggers is None
    assert "rlcore-loggers" not in {t.name for t in threading.enumerate()} - before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_scalars_flattens_mappings_and_keeps_finite_numbers_only() -> None:
    row = {"step": 3, "time": 1.0, "a": 1, "b": math.inf, "c": None, "d": "x", "e": [1],
           "f": {"g": 2.5, "h": {"i": False}}, "j": True}
    assert scalars(row) == {"a": 1.0, "f/g": 2.5, "f/h/i": 0.0, "j": 1.0}


# ---------------------------------------------------------------- preflight


@pytest.mark.parametrize(
    ("override", "module", "key", "extra"),
    [
        ("logging.tensorboard=true", "tensorboard", "logging.tensorboard", "tensorboard"),
        ("logging.wandb.enabled=true", "wandb", "logging.wandb.enabled", "wandb"),
        ("logging.mlflow.enabled=true", "mlflow", "logging.mlflow.enabled", "mlflow"),
        ("logging.mlflow.enabled=true", "sqlalchemy", "logging.mlflow.enabled", "mlflow"),
    ],
)
def test_a_logger_whose_package_is_missing_is_refused_before_start(
    override: str, module: str, key: str, extra: str,
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_cluster: None,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    rc = main(["run", QUICKSTART, override, "--out", str(tmp_path / "run")])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2
    assert len(lines) == 1, lines
    assert f"'{key}'" in lines[0] and module in lines[0]
    assert f"pip install 'rlcore[{extra}]'" in lines[0]
    assert not (tmp_path / "run").exists()


def test_preflight_passes_installed_loggers_and_a_remote_mlflow_needs_no_sqlalchemy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    check_loggers(all_on())  # installed here (the test extra)
    config = RunConfig()
    config.logging.mlflow.enabled = True
    config.logging.mlflow.tracking_uri = "http://mlflow.example:5000"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    check_loggers(config)
    config.logging.mlflow.tracking_uri = None
    with pytest.raises(ConfigError, match="sqlalchemy"):
        check_loggers(config)


def test_the_test_extra_holds_every_logger_extra() -> None:
    """CI installs ``.[run,test]``: the loggers' tests need every logger's packages."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("tensorboard", "wandb", "mlflow"):
        assert set(extras[name]) <= set(extras["test"]), name


def test_an_unknown_wandb_mode_is_refused_before_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_cluster: None
) -> None:
    rc = main(["run", QUICKSTART, "logging.wandb.mode=ofline", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "'logging.wandb.mode'" in err and "offline" in err


def test_a_runs_records_reach_the_loggers_through_run_record_and_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_cluster: None
) -> None:
    """The session's wiring, without Ray: ``_Run``'s writer feeds the loggers what its
    ``record`` writes, and ``finish`` closes them with the run's outcome."""
    from rich.console import Console

    from rlcore.app import session
    from rlcore.app.rundir import RunStatus, make_run_dir
    from rlcore.config import load_config
    from rlcore.setup.preflight import check_before_start
    from rlcore.setup.registry import load_registry

    sink = Recording("logging.tensorboard")
    monkeypatch.setattr("rlcore.app.loggers.make_sinks", lambda config, run_dir, resumed_after=None: [sink])
    config = load_config(QUICKSTART, ["logging.tensorboard=true", f"setup.cache_dir={tmp_path / 'cache'}"])
    prepared = check_before_start(config, load_registry(), output_dir=False)
    run_dir = make_run_dir(config, str(tmp_path / "run"))
    run = session._Run(prepared, run_dir, RunStatus(run_dir, resume=False), Console(quiet=True), None)
    run.record({"reward/mean": 0.5, "train/loss": 0.25}, 1, True)
    run.record({"refit/checked_step": 1}, 1, False)
    run.finish(RuntimeError("the loop failed"))

    assert sink.lines == [(1, {"reward/mean": 0.5, "train/loss": 0.25}), (1, {"refit/checked_step": 1.0})]
    assert sink.outcome == "failed"
    assert [ln["step"] for ln in read_metrics(run_dir / "metrics.jsonl")] == [1, 1]

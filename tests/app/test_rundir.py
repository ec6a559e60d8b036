"""The run directory is never half-written (issue 27, item 3).

A full disk is met two ways: an injected ENOSPC (``os.write`` fails for one file, after
letting part of a write through, as a filling disk does), which needs nothing of the host,
and a real, small tmpfs mounted in a private user and mount namespace
(``unshare --user --map-root-user --mount``; those tests are skipped where the host allows
no namespace). A killed writer is a real process SIGKILLed mid-stream. The soak test fills
the disk under a real ``rlcore run`` after its first step.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import rlcore.app.run as run_module
import rlcore.app.session as session_module
from rlcore.app import overlap
from rlcore.app.cli import EXIT_BAD_INPUT, EXIT_RUN_FAILED, main
from rlcore.app.plots import plot_reward
from rlcore.app.records import MetricsWriter, is_temp_file, read_metrics, write_atomic
from rlcore.app.rundir import check_run_dir, no_step_leftovers
from rlcore.app.trace import TraceRecorder
from rlcore.errors import ConfigError, RunDirError
from rlcore.setup.executor import TaskSpec, execute
from rlcore.setup.metrics import setup_metrics
from rlcore.setup.preflight import check_writable_dir

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
RLCORE = Path(sys.executable).with_name("rlcore")
NOSPACE = f"No space left on device [Errno {errno.ENOSPC}]"


# ---------------------------------------------------------------- an injected full disk


@dataclass
class DiskFull:
    """``os.write`` for files whose path contains one of ``room``'s names takes only that
    many more bytes (a short write), then fails with ENOSPC; every other write is real."""

    room: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> DiskFull:
        real = os.write

        def write(fd: int, data: Any) -> int:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            name = next((n for n in self.room if n in target), None)
            if name is None:
                return real(fd, data)
            if self.room[name] <= 0:
                self.failed.append(target)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = real(fd, bytes(data)[: self.room[name]])
            self.room[name] -= n
            return n

        monkeypatch.setattr(os, "write", write)
        return self


def _lines(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path`` parsed (a cut line fails the test), the file ending in one."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} ends in a cut line: {data[-80:]!r}"
    return [json.loads(line) for line in data.decode().splitlines()]


def _temps(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if is_temp_file(p.name)]


def test_a_line_the_disk_cannot_take_is_cut_back_off(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"a": 1}, step=0)
    writer.write({"b": 2}, step=1)
    before = path.read_bytes()
    disk = DiskFull({"metrics.jsonl": 7}).install(monkeypatch)  # half a line fits
    with pytest.raises(RunDirError) as info:
        writer.write({"c": "x" * 100}, step=2)
    assert disk.failed  # the short write was retried and met the real cause
    err = info.value
    assert str(err) == f"writing {path}: {NOSPACE}; what was written before is intact"
    assert err.path == str(path) and err.errno == errno.ENOSPC
    assert path.read_bytes() == before
    disk.room["metrics.jsonl"] = 10**6  # space again: the writer goes on at a line's start
    writer.write({"d": 4}, step=3)
    writer.close()
    assert [r["step"] for r in _lines(path)] == [0, 1, 3]


def test_a_file_that_ends_in_a_cut_line_is_repaired_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0}\n{"step": 1}\n{"step": 2, "rew')
    with MetricsWriter(path) as writer:
        writer.write({"x": 1}, step=3)
    assert [r["step"] for r in _lines(path)] == [0, 1, 3]
    path.write_bytes(b'{"step": 0, "cut')  # no whole line at all
    with MetricsWriter(path) as writer:
        writer.write({}, step=1)
    assert [r["step"] for r in read_metrics(path)] == [1]


def test_a_trace_that_does_not_fit_leaves_the_previous_one(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "trace.json"
    rec = TraceRecorder(origin_s=0.0)
    rec.add_span("setup", 0.0, 1.0, cat="setup", lane="setup")
    rec.write(path)
    before = path.read_bytes()
    rec.add_span("step 1", 1.0, 2.0, cat="step", lane="grpo", args={"pad": "x" * 5000})
    DiskFull({"trace.json": 4096}).install(monkeypatch)
    with pytest.raises(RunDirError, match=f"writing {path}: No space left on device"):
        rec.write(path)
    assert path.read_bytes() == before and json.loads(before)
    assert _temps(tmp_path) == []


def test_a_plot_is_whole_or_absent(tmp_path: Path, monkeypatch) -> None:
    history = [{"step": i, "reward/mean": 0.1 * i} for i in range(1, 5)]
    old = plot_reward(history, tmp_path / "reward.png", title="t").read_bytes()
    disk = DiskFull({"reward.png": 1000, "fresh.png": 0}).install(monkeypatch)
    for name in ("reward.png", "fresh.png"):
        with pytest.raises(RunDirError, match=f"{name}: No space left on device"):
            plot_reward(history, tmp_path / name, title="t")
    assert (tmp_path / "reward.png").read_bytes() == old  # the previous one, whole
    assert not (tmp_path / "fresh.png").exists()  # never a 0-byte or cut png
    assert _temps(tmp_path) == [] and len(disk.failed) == 2


def test_write_atomic_names_the_file_for_any_os_error(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match=r"writing .*/missing/x\.json: No such file or directory \[Errno 2\]"):
        write_atomic(tmp_path / "missing" / "x.json", "{}")


# ---------------------------------------------------------------- a killed writer


_WRITER = """
import sys
from rlcore.app.records import MetricsWriter

writer = MetricsWriter(sys.argv[1])
tag, pad = sys.argv[2], "x" * 30000
for i in range(10**9):
    writer.write({"tag": tag, "i": i, "pad": pad * (1 + i % 7)})
    if i == 20:
        print("writing", flush=True)
"""


def test_a_writer_killed_mid_stream_leaves_whole_lines(tmp_path: Path) -> None:
    """Lines of 30-210 KB, so that a kill often lands in the kernel's copy of one: only the
    last line may then be cut (no newline); the next writer drops it before appending."""
    path = tmp_path / "metrics.jsonl"
    for k, delay in enumerate((0.0, 0.013, 0.05, 0.11)):  # each run appends to the last
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(k)],
                                stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        data = path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        rows = [json.loads(line) for line in whole.decode().splitlines()]  # every whole line parses
        assert read_metrics(path) == rows
    MetricsWriter(path).close()  # opening it drops a cut last line
    assert _lines(path) == rows
    for k in range(4):  # each process's lines are whole and in order, none lost mid-file
        mine = [r["i"] for r in rows if r["tag"] == str(k)]
        assert mine == list(range(len(mine))) and len(mine) > 20


# ---------------------------------------------------------------- the run directory's reuse


def _status(run_dir: Path, **fields: Any) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"status": "failed", "steps_done": 0, "pid": 2**22 + 7, "host": "elsewhere", **fields}
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


def test_a_run_that_completed_no_step_does_not_block_its_out(tmp_path: Path) -> None:
    run_dir = _status(tmp_path / "run", status="failed")
    for name in ("config.yaml", "metrics.jsonl", "trace.json", "placement.json", ".trace.json.5.0.tmp"):
        (run_dir / name).write_text("{}")
    (run_dir / ".rlcore-write-check-abc").mkdir()  # a killed write check's
    check_run_dir(run_dir, resume=False)  # accepted
    assert {p.name for p in no_step_leftovers(run_dir) or []} == {p.name for p in run_dir.iterdir()}
    for status in ("setting-up", "interrupted"):  # killed or stopped in setup: the same
        _status(run_dir, status=status)
        check_run_dir(run_dir, resume=False)


@pytest.mark.parametrize(
    ("fields", "extra", "text"),
    [
        ({"status": "failed", "steps_done": 1}, None, "completed 1 step(s) (run.json status 'failed')"),
        ({"status": "running", "steps_done": 1}, None, "completed at least 1 step(s)"),
        ({"status": "finished", "steps_done": 0}, None, "completed 0 step(s) (run.json status 'finished')"),
        ({"status": "failed", "steps_done": None}, None, "an unknown number of steps"),
        ({"status": "failed"}, "notes.txt", "it holds 'notes.txt', which no run wrote"),
        ({"status": "setting-up", "pid": os.getppid(), "host": os.uname().nodename}, None,
         f"a run (pid {os.getppid()}) is setting up in it"),
        (None, "metrics.jsonl", "is not empty; choose a new one"),  # no run.json: not a run's
    ],
    ids=["trained-failed", "trained-running", "finished", "unknown", "foreign-file", "live", "no-run-json"],
)
def test_a_run_dir_that_holds_more_still_blocks(tmp_path: Path, fields, extra, text) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if fields is not None:
        _status(run_dir, **fields)
    if extra:
        (run_dir / extra).write_text("x")
    with pytest.raises(ConfigError) as info:
        check_run_dir(run_dir, resume=False)
    assert text in str(info.value) and "--resume" in str(info.value)
    assert no_step_leftovers(run_dir) is None
    check_run_dir(run_dir, resume=True)


# ---------------------------------------------------------------- rlcore run, the cluster faked


@dataclass
class FakeSetup:
    """What ``run_job`` reads of a setup that started nothing."""

    plan: Any
    execution: Any
    metrics: dict[str, float]
    handles: dict[str, Any] = field(default_factory=dict)
    shutdowns: int = 0
    prepared: Any = None

    def shutdown(self, timeout_s: float | None = None) -> list[str]:
        self.shutdowns += 1
        return []


class FakeCluster:
    """A cluster that starts nothing (or fails to start, with ``fail``)."""

    made: list[FakeCluster] = []
    fail: str | None = None

    def __init__(self, config: Any, choice: Any = None) -> None:
        self.owned, self.start_time_s, self.shut_down = False, 0.01, 0
        FakeCluster.made.append(self)

    def start(self) -> FakeCluster:
        if FakeCluster.fail:
            from rlcore.errors import RlcoreError

            raise RlcoreError(FakeCluster.fail)
        return self

    def reserve_devices(self, config: Any) -> None:
        return None

    def network(self, config: Any) -> Any:
        return SimpleNamespace(readers_elsewhere=False)

    def shutdown(self, reason: str = "", exit_s: float = 5.0) -> list[str]:
        self.shut_down += 1
        return []


@pytest.fixture
def faked(monkeypatch: pytest.MonkeyPatch) -> list[FakeSetup]:
    """``rlcore run`` in this process with no cluster, no backend and no tokenizer: setup
    returns at once (a :class:`FakeSetup`, collected in the returned list)."""
    setups: list[FakeSetup] = []

    def fake_run_prepared(prepared: Any, **_: Any) -> FakeSetup:
        plan = prepared.plan
        ex = execute([TaskSpec(t.name, [], lambda r: None) for t in plan.tasks])
        setups.append(FakeSetup(plan, ex, setup_metrics(plan, ex), prepared=prepared))
        return setups[-1]

    FakeCluster.made, FakeCluster.fail = [], None
    monkeypatch.setattr(session_module, "Cluster", FakeCluster)
    monkeypatch.setattr(session_module, "run_prepared", fake_run_prepared)
    monkeypatch.setattr(overlap, "prefetch_tokenizer", lambda *a, **k: None)
    return setups


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_open_prepares_the_run_once_and_sets_up_exactly_that_run(tmp_path: Path, faked, monkeypatch) -> None:
    """The preflight's preparation is the one the setup gets: one selection of the
    backends, one resolution of their options, no second plan."""
    import rlcore.setup.preflight as preflight_module
    import rlcore.setup.prepared as prepared_module

    made: list[Any] = []
    selections: list[Any] = []
    real_prepare, real_select = prepared_module.prepare, prepared_module.selected_backends
    monkeypatch.setattr(preflight_module, "prepare", lambda *a, **k: made.append(real_prepare(*a, **k)) or made[-1])
    monkeypatch.setattr(
        prepared_module, "selected_backends", lambda *a, **k: selections.append(1) or real_select(*a, **k)
    )
    with session_module.open(QUICKSTART, out=tmp_path / "run", quiet=True, handle_signals=False) as s:
        assert len(made) == 1 and len(selections) == 1
        assert faked[0].prepared is made[0] and s.plan is made[0].plan
    assert len(made) == 1 and len(selections) == 1


def test_a_full_disk_during_the_run_is_one_line_and_exit_3(tmp_path: Path, faked, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "run"
    disk = DiskFull({"metrics.jsonl": 40}).install(monkeypatch)  # the setup line is cut at 40 bytes
    assert main(["run", QUICKSTART, "--out", str(run_dir)]) == EXIT_RUN_FAILED
    line = _one_error_line(capsys.readouterr().err)
    assert line == f"error: writing {run_dir / 'metrics.jsonl'}: {NOSPACE}; what was written before is intact"
    # The teardown ran; what was written is valid; nothing half-written is left.
    assert faked[0].shutdowns == 1 and FakeCluster.made[0].shut_down == 1
    assert _lines(run_dir / "metrics.jsonl") == []
    assert json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "failed" and status["steps_done"] == 0 and "No space left" in status["error"]
    assert _temps(run_dir) == []
    assert "init:policy" in (run_dir / "trace.json").read_text()
    # No step was done: the same --out is taken again, from an empty directory.
    disk.room.clear()
    FakeCluster.fail = "the cluster is down (test)"
    assert main(["run", QUICKSTART, "--out", str(run_dir)]) == EXIT_RUN_FAILED
    assert _one_error_line(capsys.readouterr().err) == "error: the cluster is down (test)"
    assert "init:policy" not in (run_dir / "trace.json").read_text()  # the last run's, replaced
    assert json.loads((run_dir / "run.json").read_text())["error"] == "RlcoreError: the cluster is down (test)"


def test_a_config_yaml_the_disk_cannot_take_leaves_a_reusable_out(
    tmp_path: Path, faked, monkeypatch, capsys
) -> None:
    """The operator's case: a disk that fills between the check and the first write."""
    run_dir = tmp_path / "run"
    disk = DiskFull({"config.yaml": 10}).install(monkeypatch)
    assert main(["run", QUICKSTART, "--out", str(run_dir)]) == EXIT_RUN_FAILED
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: writing {run_dir / 'config.yaml'}: {NOSPACE}")
    # No empty config.yaml (run.log: the CLI's log of other libraries' output, rlcore.app.runlog).
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.json", "run.log"]
    disk.room.clear()
    FakeCluster.fail = "the cluster is down (test)"
    assert main(["run", QUICKSTART, "--out", str(run_dir)]) == EXIT_RUN_FAILED  # not refused
    assert _one_error_line(capsys.readouterr().err) == "error: the cluster is down (test)"
    assert (run_dir / "config.yaml").read_text().startswith("name: quickstart")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_disk_error_met_outside_the_run_dir_writers_is_one_line(monkeypatch, capsys, code) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code), "/cache/model.safetensors")

    monkeypatch.setattr(run_module, "run_job", fail)
    assert main(["run", QUICKSTART]) == EXIT_RUN_FAILED
    line = _one_error_line(capsys.readouterr().err)
    assert line == f"error: writing /cache/model.safetensors: {os.strerror(code)} [Errno {code}]"
    monkeypatch.setattr(run_module, "run_job", lambda *a, **k: open("/nonexistent/x"))  # noqa: SIM115
    with pytest.raises(FileNotFoundError):  # not a disk's: a bug, with its traceback
        main(["run", QUICKSTART])


def test_a_run_that_failed_in_setup_leaves_its_records_and_a_reusable_out(
    tmp_path: Path, faked, capsys
) -> None:
    run_dir = tmp_path / "run"
    FakeCluster.fail = "the cluster is down (test)"
    for _ in range(2):  # the second is not refused as "not empty"
        assert main(["run", QUICKSTART, "--out", str(run_dir)]) == EXIT_RUN_FAILED
        assert _one_error_line(capsys.readouterr().err) == "error: the cluster is down (test)"
        assert sorted(p.name for p in run_dir.iterdir()) == [
            "config.yaml", "metrics.jsonl", "run.json", "run.log", "trace.json",
        ]
        assert json.loads((run_dir / "run.json").read_text())["steps_done"] == 0


def test_a_trace_or_plot_the_disk_cannot_take_ends_a_setup_only_run(tmp_path: Path, faked, monkeypatch) -> None:
    disk = DiskFull().install(monkeypatch)
    for k, name in enumerate(("trace.json", "setup_timeline.png")):
        run_dir = tmp_path / f"run{k}"
        disk.room = {name: 100}
        with pytest.raises(RunDirError, match=f"writing {run_dir / name}: No space left on device"):
            run_module.run_job(QUICKSTART, out=str(run_dir), setup_only=True)
        assert not (run_dir / name).exists() and _temps(run_dir) == []
        assert faked[-1].shutdowns == 1 and FakeCluster.made[-1].shut_down == 1
        assert len(_lines(run_dir / "metrics.jsonl")) == 1  # the setup line
        status = json.loads((run_dir / "run.json").read_text())
        assert status["status"] == "failed" and name in status["error"]
        if name != "trace.json":
            json.loads((run_dir / "trace.json").read_text())


def test_a_successful_run_marks_itself_finished(tmp_path: Path, faked) -> None:
    run_dir = run_module.run_job(QUICKSTART, out=str(tmp_path / "run"), setup_only=True)
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "finished" and status["pid"] == os.getpid()
    with pytest.raises(ConfigError, match="run.json status 'finished'"):
        check_run_dir(run_dir, resume=False)


# ---------------------------------------------------------------- a real tmpfs


@cache
def _namespaces() -> bool:
    """Whether this host lets us mount a tmpfs in a private user and mount namespace."""
    try:
        return subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
             "mount -t tmpfs -o size=64k tmpfs /mnt"],
            capture_output=True, timeout=30,
        ).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_tmpfs = pytest.mark.skipif("not _namespaces()", reason="no user+mount namespace to mount a tmpfs in")


def _in_tmpfs(mount: Path, size: str, script: str, *args: str, ro: bool = False, timeout: float = 120) -> Any:
    """Run ``script`` (Python; ``sys.argv[1]`` is the mount) in a namespace of its own with a
    ``size`` tmpfs mounted at ``mount``; returns the JSON it prints last."""
    mount.mkdir()
    opts = f"size={size}" + (",ro" if ro else "")
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         f'mount -t tmpfs -o {opts} tmpfs "$1" && shift && exec "$@"', "sh", str(mount),
         sys.executable, "-c", textwrap.dedent(script), str(mount), *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_FILL = """
def fill(mnt):
    import os
    fd = os.open(os.path.join(mnt, "fill"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(65536)):
            pass
    except OSError:
        pass
    os.close(fd)
"""


_OUT_REFUSED = _FILL + """
import json, os, subprocess, sys
mnt, rlcore, config, full = sys.argv[1:]
if full == "1":
    fill(mnt)
before = sorted(os.listdir(mnt))
proc = subprocess.run([rlcore, "run", config, "--out", os.path.join(mnt, "run")],
                      capture_output=True, text=True)
print(json.dumps({"rc": proc.returncode, "err": proc.stderr, "before": before,
                  "after": sorted(os.listdir(mnt))}))
"""


@needs_tmpfs
@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_an_out_that_cannot_be_written_is_refused_before_anything_is_created(tmp_path: Path, kind: str) -> None:
    mnt = tmp_path / "mnt"
    got = _in_tmpfs(mnt, "256k", _OUT_REFUSED, str(RLCORE), QUICKSTART, "1" if kind == "full" else "0",
                    ro=kind == "read-only")
    assert got["rc"] == EXIT_BAD_INPUT, got
    line = _one_error_line(got["err"])
    cause = NOSPACE if kind == "full" else f"Read-only file system [Errno {errno.EROFS}]"
    fix = "free space on that filesystem" if kind == "full" else "mounted read-only"
    assert f"config key '--out': cannot write '{mnt / 'run'}' ({cause}" in line and fix in line, line
    assert got["after"] == got["before"]  # nothing created, nothing left


_WRITERS_ON_A_FULL_DISK = """
import json, os, sys
from rlcore.app.plots import plot_reward
from rlcore.errors import RunDirError
from rlcore.app.records import MetricsWriter
from rlcore.app.trace import TraceRecorder

mnt = sys.argv[1]
out, report = os.path.join(mnt, "run"), {}
history = [{"step": i, "reward/mean": 0.1 * i} for i in range(1, 5)]
trace = TraceRecorder(origin_s=0.0)
trace.add_span("setup", 0.0, 1.0, cat="setup", lane="setup")
trace.write(os.path.join(out, "trace.json"))
plot_reward(history, os.path.join(out, "reward.png"), title="t")
saved = {n: open(os.path.join(out, n), "rb").read() for n in ("trace.json", "reward.png")}

writer, written = MetricsWriter(os.path.join(out, "metrics.jsonl")), 0
try:
    while True:  # the metrics fill the disk
        writer.write({"i": written, "pad": "x" * 1500}, step=written)
        written += 1
except RunDirError as err:
    report["metrics_error"], report["errno"] = str(err), err.errno
writer.close()
report["written"] = written
report["metrics"] = open(os.path.join(out, "metrics.jsonl"), "rb").read().decode()

trace.add_span("step 1", 1.0, 2.0, cat="step", lane="grpo", args={"pad": "y" * 20000})
for name, write in (("trace.json", lambda p: trace.write(p)),
                    ("reward.png", lambda p: plot_reward(history, p, title="t")),
                    ("fresh.png", lambda p: plot_reward(history, p, title="t"))):
    try:
        write(os.path.join(out, name))
        report[name] = "written"
    except RunDirError as err:
        report[name] = str(err)
report["same"] = {n: open(os.path.join(out, n), "rb").read() == b for n, b in saved.items()}
report["files"] = sorted(os.listdir(out))
print(json.dumps(report))
"""


@needs_tmpfs
def test_the_writers_on_a_real_full_disk(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    got = _in_tmpfs(mnt, "128k", _WRITERS_ON_A_FULL_DISK)
    out = mnt / "run"
    assert got["errno"] == errno.ENOSPC and got["written"] > 10, got
    assert got["metrics_error"] == f"writing {out / 'metrics.jsonl'}: {NOSPACE}; what was written before is intact"
    rows = [json.loads(line) for line in got["metrics"].splitlines()]
    assert got["metrics"].endswith("\n") and [r["i"] for r in rows] == list(range(got["written"]))
    for name in ("trace.json", "reward.png", "fresh.png"):
        assert got[name].startswith(f"writing {out / name}: {NOSPACE}"), got[name]
    assert got["same"] == {"trace.json": True, "reward.png": True}
    assert got["files"] == ["metrics.jsonl", "reward.png", "trace.json"]  # no fresh.png, no temp


# ---------------------------------------------------------------- a real run on a disk that fills


_REAL_RUN = _FILL + """
import json, os, subprocess, sys, time
import psutil

mnt, rlcore, config = sys.argv[1:]
out = os.path.join(mnt, "run")
env = {**os.environ, "RLCORE_RUNDIR_TEST": str(os.getpid())}
proc = subprocess.Popen([rlcore, "run", config, "grpo.steps=12", "--out", out],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
filled = False
for line in proc.stdout:
    if line.startswith("step   1") and not filled:
        fill(mnt)  # the disk fills after the first step
        filled = True
err = proc.stderr.read()
rc = proc.wait()
left = []
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("RLCORE_RUNDIR_TEST") == str(os.getpid()):
                left.append(" ".join(p.cmdline())[:100])
        except psutil.Error:
            pass
    if not left:
        break
    time.sleep(0.2)
files = {}
for name in sorted(os.listdir(out)):
    data = open(os.path.join(out, name), "rb").read()
    files[name] = data.decode() if name.endswith((".json", ".jsonl")) else data.hex()[:16] + data.hex()[-24:]
full = subprocess.run([rlcore, "run", config, "--out", out], capture_output=True, text=True)
os.remove(os.path.join(mnt, "fill"))  # room again
rerun = subprocess.run([rlcore, "run", config, "--out", out], capture_output=True, text=True)
print(json.dumps({"rc": rc, "err": err, "filled": filled, "left": left, "files": files,
                  "full_rc": full.returncode, "full_err": full.stderr,
                  "rerun_rc": rerun.returncode, "rerun_err": rerun.stderr}))
"""

PNG_START, PNG_END = "89504e470d0a1a0a", "0000000049454e44ae426082"


@pytest.mark.soak  # a real quickstart run: ~20-30 s
@pytest.mark.slow
@needs_tmpfs
def test_a_real_run_whose_disk_fills_ends_in_one_line_with_valid_records(tmp_path: Path) -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    mnt = tmp_path / "mnt"
    got = _in_tmpfs(mnt, "1m", _REAL_RUN, str(RLCORE), QUICKSTART, timeout=600)
    assert got["filled"], got["err"][-3000:]
    assert got["rc"] == EXIT_RUN_FAILED, got["err"][-3000:]
    errors = [ln for ln in got["err"].splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in got["err"], got["err"][-3000:]
    assert NOSPACE in errors[0] and f"writing {mnt / 'run'}/" in errors[0], errors[0]
    assert got["left"] == []  # the teardown ran
    files = got["files"]
    assert not [n for n in files if is_temp_file(n)], files
    rows = [json.loads(line) for line in files["metrics.jsonl"].splitlines()]
    assert files["metrics.jsonl"].endswith("\n") and any(r.get("step") == 1 for r in rows)
    if "trace.json" in files:
        json.loads(files["trace.json"])
    for png in ("setup_timeline.png", "reward.png"):
        if png in files:
            assert files[png].startswith(PNG_START) and files[png].endswith(PNG_END), png
    # The disk still full: refused before anything, naming the cause. With room again: it
    # did a step, so the same --out is refused (not replaced) without --resume.
    assert got["full_rc"] == EXIT_BAD_INPUT and NOSPACE in _one_error_line(got["full_err"])
    assert got["rerun_rc"] == EXIT_BAD_INPUT
    assert "completed" in _one_error_line(got["rerun_err"])
    print(errors[0], sorted(files), _one_error_line(got["rerun_err"]), sep="\n")


def test_check_writable_dir_creates_nothing(tmp_path: Path) -> None:
    check_writable_dir(tmp_path / "a" / "b", key="--out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("reward", "shown"), [(None, "None"), ("1.0", "'1.0'"), (float("nan"), "nan")])
def test_a_reward_of_the_wrong_type_is_one_error_line_naming_backend_and_row_exit_3(
    tmp_path: Path, faked, monkeypatch, capsys, reward: Any, shown: str
) -> None:
    """A prompt-and-score env whose ``score`` gives None, a string or NaN for one completion:
    the run ends at step 1 with one ``error:`` line naming the env backend and the row, exit 3
    (not a traceback from ``float()`` inside the env)."""
    from rlcore.handles import PromptAndScoreEnv

    class CharTokenizer:
        eos_token_id = 3

        def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
            return SimpleNamespace(input_ids=([1] if add_special_tokens else []) + [ord(c) for c in text])

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(i) for i in ids if i > 3)

    class Model:
        def logprobs(self, batch: Any) -> list[list[float]]:
            return [[-0.5] * len(c) for _, c in batch]

        def generate(self, prompt_ids: Any, params: Any) -> Any:
            return [[{"token_ids": [ord("7"), 3], "logprobs": [-0.5, -0.5]}] * params.n for _ in prompt_ids]

        def shutdown(self) -> None:
            pass

    class BadReward(PromptAndScoreEnv):
        def sample_prompts(self, n: int, step: int) -> list[Any]:
            return [SimpleNamespace(text="3+4=")] * n

        def score(self, prompts: Any, completions: Any) -> list[list[Any]]:
            rows: list[list[Any]] = [[1.0] * len(g) for g in completions]
            rows[1][2] = reward
            return rows

    fake = session_module.run_prepared

    def with_handles(prepared: Any, **kw: Any) -> Any:
        setup = fake(prepared, **kw)
        setup.handles = {"policy": Model(), "generation": Model(), "env": BadReward()}
        setup.refit_sessions = SimpleNamespace(spec_for=lambda *a: None)  # placement.json's
        return setup

    monkeypatch.setattr(session_module, "run_prepared", with_handles)
    monkeypatch.setattr(overlap, "tokenizer", lambda *a, **k: CharTokenizer())
    assert main(["run", QUICKSTART, "--out", str(tmp_path / "run")]) == EXIT_RUN_FAILED
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: at step 1: env backend 'arithmetic' broke the contract of collect_rollouts()"), line
    assert f"group 1 rollout 2: a finite float reward; got {shown}" in line, line


def test_a_setup_task_past_setup_slow_task_warn_s_is_named_on_the_console(tmp_path: Path, faked, monkeypatch) -> None:
    """An init still running after ``setup.slow_task_warn_s`` gets one console line saying
    which task and how long; one that ends in time gets none."""
    import io

    from rich.console import Console

    fake = session_module.run_prepared

    def slow_setup(prepared: Any, **kw: Any) -> Any:
        progress = kw["progress"]
        for task in ("init:policy", "init:generation"):
            progress(task, "start")
        progress("init:policy", "end")
        time.sleep(0.6)
        progress("init:generation", "end")
        return fake(prepared, **kw)

    monkeypatch.setattr(session_module, "run_prepared", slow_setup)
    out = io.StringIO()
    console = Console(file=out, width=200, highlight=False)
    with session_module.open(
        QUICKSTART, ["setup.slow_task_warn_s=0.2"], out=tmp_path / "run", console=console, handle_signals=False
    ):
        pass
    lines = [ln for ln in out.getvalue().splitlines() if "still running" in ln]
    assert len(lines) == 1 and lines[0].startswith("setup: init:generation still running after 0."), out.getvalue()

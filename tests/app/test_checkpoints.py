"""Training checkpoints on disk: saved whole, kept, checked at resume, never lost to a bad save.

The policy here is a stand-in that writes files (its real counterparts, FSDP and Megatron,
are held to the round trip by their own tests and the conformance suite); what is tested is
the core's side: the directory, the manifest's digests, keep-last-k, the choice at resume,
a killed save, a full disk, a save overlapped with the loop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rlcore.app.checkpointing import Checkpointer, Contents, Schedule
from rlcore.app.checkpoints import MANIFEST_NAME, POLICY_DIR, scan, step_dir, verify
from rlcore.app.resume import PolicyFormat, choose, shared_config
from rlcore.app.rundir import truncate_metrics
from rlcore.config import load_config
from rlcore.errors import CheckpointError
from rlcore.publish import STAGING_PREFIX, publish_dir

REPO = Path(__file__).resolve().parents[2]
FORMAT = PolicyFormat("toy", "toy-files", "1", "rlcore-toy", "0.1")


class FilePolicy:
    """Writes its 'state' (a counter and a blob) as two files; ``gate`` holds a save."""

    def __init__(self, blob: int = 1000, gate: threading.Event | None = None, fail: BaseException | None = None):
        self.value, self.blob, self.gate, self.fail = 0, blob, gate, fail
        self.calls: list[str] = []

    def save_checkpoint(self, directory: str) -> None:
        self.calls.append("save")
        Path(directory, "state.json").write_text(json.dumps({"value": self.value}))
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        Path(directory, "shard-0.bin").write_bytes(os.urandom(self.blob))
        self.calls.append("saved")

    def load_checkpoint(self, directory: str) -> None:
        self.value = json.loads(Path(directory, "state.json").read_text())["value"]


def config(**over: Any) -> Any:
    return load_config(REPO / "examples/quickstart.yaml", [f"{k}={v}" for k, v in over.items()])


def checkpointer(root: Path, policy: FilePolicy, *, every: int = 1, keep: int = 2, overlap: bool = False,
                 records: list | None = None, cfg: Any = None, keep_every: int = 0) -> Checkpointer:
    cfg = cfg or config()
    kept = records if records is not None else []
    return Checkpointer(
        root, policy=policy, publish=lambda dest, write: publish_dir(dest, write),
        contents=Contents(
            manifest={"policy": FORMAT.__dict__, "config": shared_config(cfg)}, config_yaml="name: x\n",
            env_state=lambda step: {"position": step * 8},
        ),
        schedule=Schedule(every=every, last_step=10, keep=keep, overlap=overlap, keep_every=keep_every),
        record=lambda m, s: kept.append((s, m)),
    )


def test_a_checkpoint_is_published_whole_with_every_files_digest(tmp_path: Path) -> None:
    policy, records = FilePolicy(), []
    c = checkpointer(tmp_path, policy, records=records)
    policy.value = 7
    c.save(3)
    path = step_dir(tmp_path, 3)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["step"] == 3 and manifest["weight_version"] == 3 and manifest["env"] == {"position": 24}
    assert manifest["policy"]["backend"] == "toy" and manifest["config"]["policy.backend"] == "fsdp"
    assert set(manifest["files"]) == {f"{POLICY_DIR}/state.json", f"{POLICY_DIR}/shard-0.bin", "config.yaml"}
    assert manifest["files"][f"{POLICY_DIR}/shard-0.bin"]["bytes"] == 1000
    assert verify(scan(tmp_path)[0]) is None
    assert records[0][0] == 3 and records[0][1]["checkpoint/path"] == str(path)
    assert records[0][1]["checkpoint/bytes"] == manifest["bytes"] > 1000


def test_only_the_last_k_are_kept_and_only_behind_a_newer_complete_one(tmp_path: Path) -> None:
    c = checkpointer(tmp_path, FilePolicy(), keep=2)
    for step in (1, 2, 3):
        c.save(step)
    assert [f.step for f in scan(tmp_path)] == [3, 2]
    # A save that fails costs nothing already saved, and nothing is pruned for it.
    failing = checkpointer(tmp_path, FilePolicy(fail=OSError(28, "No space left on device")), keep=1)
    with pytest.raises(CheckpointError) as info:
        failing.save(4)
    assert f"the checkpoint of step 4 could not be saved to {step_dir(tmp_path, 4)}: " in str(info.value)
    assert "No space left on device" in str(info.value)
    assert f"the last complete checkpoint, {step_dir(tmp_path, 3)}, is intact" in str(info.value)
    assert [f.step for f in scan(tmp_path)] == [3, 2]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".staging")]  # its scratch is gone
    # Across a restart: a new writer with keep=1 prunes only once its own save is complete.
    checkpointer(tmp_path, FilePolicy(), keep=1).save(5)
    assert [f.step for f in scan(tmp_path)] == [5]


def test_resume_takes_the_newest_whole_checkpoint_and_names_each_one_it_skips(tmp_path: Path) -> None:
    c = checkpointer(tmp_path, FilePolicy(), keep=5)
    for step in (2, 4, 6):
        c.save(step)
    shard = step_dir(tmp_path, 6) / POLICY_DIR / "shard-0.bin"
    shard.write_bytes(shard.read_bytes()[:500])  # truncated
    blob = bytearray((step_dir(tmp_path, 4) / POLICY_DIR / "shard-0.bin").read_bytes())
    blob[10] ^= 0xFF  # one bit flipped: same size
    (step_dir(tmp_path, 4) / POLICY_DIR / "shard-0.bin").write_bytes(bytes(blob))
    point = choose(tmp_path, config(), FORMAT)
    assert point.step == 2
    assert point.skipped == [
        "step-00000006 (corrupt: policy/shard-0.bin has 500 bytes, 1000 were saved (truncated or overwritten)), "
        "set aside as step-00000006.corrupt",
        "step-00000004 (corrupt: policy/shard-0.bin does not match its SHA-256 digest), set aside as step-00000004.corrupt",
    ]


def test_a_corrupt_checkpoint_passed_over_at_resume_is_set_aside_resaved_whole_and_never_kept_over_a_good_one(
    tmp_path: Path,
) -> None:
    """Issue 44: a resume fell back past corrupt step-4 and step-6 to step-2; the run's new
    save of step 4 wrote nothing (the corrupt directory's marker stood), and keep=2 then
    deleted the good checkpoints and kept the corrupt ones."""
    c = checkpointer(tmp_path, FilePolicy(), keep=5)
    for step in (2, 4, 6):
        c.save(step)
    for step in (4, 6):
        shard = step_dir(tmp_path, step) / POLICY_DIR / "shard-0.bin"
        shard.write_bytes(shard.read_bytes()[:10])
    point = choose(tmp_path, config(), FORMAT)
    assert point.step == 2
    assert [s.split(" (")[0] for s in point.skipped] == ["step-00000006", "step-00000004"]
    assert all(s.endswith(f"set aside as step-0000000{n}.corrupt") for s, n in zip(point.skipped, (6, 4), strict=True))
    assert (tmp_path / "step-00000006.corrupt" / POLICY_DIR / "shard-0.bin").is_file()  # kept to look at
    records: list = []
    resumed = checkpointer(tmp_path, FilePolicy(), keep=2, records=records)
    for step in (3, 4):
        resumed.save(step)
    assert [f.step for f in scan(tmp_path)] == [4, 3]  # the good ones, the corrupt ones out of the count
    assert all(verify(f) is None for f in scan(tmp_path))
    assert records[-1][1]["checkpoint/bytes"] > 1000  # step 4 written anew, not skipped


def test_a_save_replaces_a_directory_left_at_its_step_from_before_the_resume(tmp_path: Path) -> None:
    """A checkpoint at step 5 that the resume passed over whole (a newer format) is not this
    run's step 5: the run's save of step 5 replaces it, where the publisher would keep it."""
    def newer(staging: Path) -> None:
        (staging / MANIFEST_NAME).write_text(json.dumps({"format": "rlcore-checkpoint", "format_version": 99, "files": {}}))

    publish_dir(step_dir(tmp_path, 5), newer)  # whole, its marker standing
    assert "newer rlcore" in (scan(tmp_path)[0].problem or "")
    records: list = []
    checkpointer(tmp_path, FilePolicy(), keep=5, records=records).save(5)
    assert verify(scan(tmp_path)[0]) is None and records[0][1]["checkpoint/bytes"] > 1000


def test_resume_never_starts_over_silently(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nothing to resume from in .*: it holds no checkpoint"):
        choose(tmp_path / "checkpoints", config(), FORMAT)
    checkpointer(tmp_path, FilePolicy()).save(1)
    (step_dir(tmp_path, 1) / POLICY_DIR / "state.json").unlink()
    with pytest.raises(CheckpointError) as info:
        choose(tmp_path, config(), FORMAT)
    assert "found step-00000001 (corrupt: policy/state.json is missing)" in str(info.value)
    assert "checkpoint.every_steps" in str(info.value)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"grpo.learning_rate": 0.1}, "grpo.learning_rate: checkpoint 0.005, this run 0.1"),
        ({"policy.workers": 1}, "policy.workers: checkpoint 2, this run 1"),
        ({"model.tiny.hidden_size": 64}, "model.tiny.hidden_size: checkpoint 128, this run 64"),
    ],
)
def test_a_checkpoint_of_another_config_is_refused_naming_the_difference(
    tmp_path: Path, change: dict[str, Any], words: str
) -> None:
    checkpointer(tmp_path, FilePolicy()).save(1)
    with pytest.raises(CheckpointError) as info:
        choose(tmp_path, config(**change), FORMAT)
    assert words in str(info.value) and "\n" not in str(info.value)
    # What may change on resume does not count: more steps, another generation engine.
    assert choose(tmp_path, config(**{"grpo.steps": 99, "generation.backend": "sglang"}), FORMAT).step == 1


def test_a_checkpoint_of_another_policy_format_is_refused_naming_both_versions(tmp_path: Path) -> None:
    checkpointer(tmp_path, FilePolicy()).save(1)
    newer = PolicyFormat("toy", "toy-files", "2", "rlcore-toy", "0.2")
    with pytest.raises(CheckpointError, match=r"its policy format is toy-files version 1 \(rlcore-toy 0.1\), "
                       r"toy now reads toy-files version 2 \(rlcore-toy 0.2\)"):
        choose(tmp_path, config(), newer)
    with pytest.raises(CheckpointError, match="saved by policy backend 'toy', this run's is 'other'"):
        choose(tmp_path, config(), PolicyFormat("other", "toy-files", "1"))


_KILLED_SAVE = """
import sys, time
from pathlib import Path
from rlcore.publish import publish_dir

def write(staging):
    (staging / "policy").mkdir()
    (staging / "policy" / "half.bin").write_bytes(b"x" * 4096)
    print("writing", flush=True)
    time.sleep(60)

publish_dir(Path(sys.argv[1]) / "step-00000002", write)
"""


def test_a_save_killed_midway_is_ignored_and_cleaned_up(tmp_path: Path) -> None:
    checkpointer(tmp_path, FilePolicy()).save(1)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        assert [p for p in os.listdir(tmp_path) if p.startswith(STAGING_PREFIX)]  # mid-save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    left = [p for p in os.listdir(tmp_path) if p.startswith(STAGING_PREFIX)]
    point = choose(tmp_path, config(), FORMAT)
    assert point.step == 1 and point.skipped == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(STAGING_PREFIX)]  # cleaned at resume
    assert point.cleaned == [f"{name} (what a save that was stopped or killed left)" for name in left]  # and named


def test_an_overlapped_save_runs_beside_the_loop_and_is_joined_before_the_policy_is_used(tmp_path: Path) -> None:
    gate = threading.Event()
    policy, records = FilePolicy(gate=gate), []
    c = checkpointer(tmp_path, policy, overlap=True, records=records)
    c.save(1)  # returns while the policy is still writing
    deadline = time.monotonic() + 30
    while not policy.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.saving and policy.calls == ["save"] and not step_dir(tmp_path, 1).exists()
    threading.Timer(0.3, gate.set).start()
    c.wait()
    assert policy.calls == ["save", "saved"] and verify(scan(tmp_path)[0]) is None
    assert not c.saving
    assert [s for s, _ in records] == [1]
    # Its failure is raised by the join, on the loop's thread.
    failing = checkpointer(tmp_path, FilePolicy(fail=RuntimeError("rank 1 died")), overlap=True)
    failing.save(2)
    with pytest.raises(CheckpointError, match="step 2 could not be saved .*: rank 1 died"):
        failing.wait()


def test_saves_are_due_every_n_steps_and_after_the_last(tmp_path: Path) -> None:
    c = checkpointer(tmp_path, FilePolicy(), every=4)
    assert [s for s in range(1, 11) if c.due(s)] == [4, 8, 10]
    assert not any(checkpointer(tmp_path, FilePolicy(), every=0).due(s) for s in range(1, 11))


def test_resuming_drops_the_metrics_of_the_steps_it_does_again(tmp_path: Path) -> None:
    lines = [{"step": 0, "setup": 1}, {"step": 1}, {"step": 2}, {"step": 3}, {"step": 2, "checkpoint/step": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4')
    assert truncate_metrics(tmp_path, 2) == 2
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [lines[0], lines[1], lines[2], lines[4]]


_FULL_DISK = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_checkpoints import FilePolicy, checkpointer, scan, verify
root = Path(sys.argv[1]) / "checkpoints"
checkpointer(root, FilePolicy(blob=60_000)).save(1)
err = None
try:
    checkpointer(root, FilePolicy(blob=400_000)).save(2)
except Exception as e:
    err = str(e)
found = scan(root)
print(json.dumps({"err": err, "steps": [f.step for f in found], "ok": verify(found[0]) is None,
                  "left": sorted(p.name for p in root.iterdir())}))
"""


def test_a_full_disk_ends_the_save_naming_the_path_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    from tests.app.test_rundir import _in_tmpfs, _namespaces

    if not _namespaces():
        pytest.skip("no user+mount namespace to mount a tmpfs in")
    mnt = tmp_path / "mnt"
    got = _in_tmpfs(mnt, "256k", textwrap.dedent(_FULL_DISK), str(Path(__file__).parent))
    assert got["steps"] == [1] and got["ok"], got
    assert got["err"].startswith(f"the checkpoint of step 2 could not be saved to {mnt}/checkpoints/step-00000002: ")
    assert "No space left on device" in got["err"] and "step-00000001, is intact" in got["err"]
    assert got["left"] == ["step-00000001"]  # no scratch of the failed save


def test_a_slow_loop_never_sees_two_saves_at_once(tmp_path: Path) -> None:
    gate = threading.Event()
    policy = FilePolicy(gate=gate)
    c = checkpointer(tmp_path, policy, overlap=True)
    c.save(1)
    t0 = time.monotonic()
    threading.Timer(0.2, gate.set).start()
    c.save(2)  # joins the first before it starts
    c.wait()
    assert time.monotonic() - t0 >= 0.2
    assert policy.calls == ["save", "saved", "save", "saved"]


def test_rlcore_run_resume_without_a_usable_checkpoint_is_bad_input_before_anything_starts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((REPO / "examples/quickstart.yaml").read_text())
    rlcore = Path(sys.executable).with_name("rlcore")

    def resume() -> str:
        before = sorted(p.name for p in run.iterdir())
        proc = subprocess.run([str(rlcore), "run", "--resume", str(run)], capture_output=True, text=True, cwd=REPO,
                              timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
        assert "Started a local Ray instance" not in proc.stdout + proc.stderr
        assert sorted(p.name for p in run.iterdir()) == before  # nothing written
        return errors[0]

    line = resume()
    assert "nothing to resume from in" in line and "it holds no checkpoint" in line
    # A checkpoint of another policy backend (the quickstart's is fsdp): named, not loaded.
    checkpointer(run / "checkpoints", FilePolicy()).save(1)
    assert "it was saved by policy backend 'toy', this run's is 'fsdp'" in resume()
    # A finished run (its checkpoint is of the last step): said before any setup (issue 44).
    from rlcore_fsdp.checkpoint import FORMAT as FSDP_FORMAT
    from rlcore_fsdp.plugin import CHECKPOINT_VERSION

    fsdp = PolicyFormat("fsdp", FSDP_FORMAT, CHECKPOINT_VERSION)
    done = checkpointer(run / "checkpoints", FilePolicy(), keep=5, cfg=config())
    done.contents = Contents({**done.contents.manifest, "policy": fsdp.__dict__}, "name: x\n", lambda step: None)
    done.save(30)
    line = resume()
    assert "nothing left to do" in line and "after step 30 and grpo.steps is 30" in line and "grpo.steps" in line


def test_a_save_the_disk_cannot_hold_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlcore.app import checkpointing

    checkpointer(tmp_path, FilePolicy(blob=4000)).save(1)
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 3000)  # less than the last one took
    policy = FilePolicy(blob=4000)
    with pytest.raises(CheckpointError) as info:
        checkpointer(tmp_path, policy).save(2)
    text = str(info.value)
    assert "the checkpoint of step 2 was not saved" in text and "the disk is full for it" in text
    assert f"under {tmp_path}" in text and "checkpoint.dir" in text
    assert f"the last complete checkpoint, {step_dir(tmp_path, 1)}, is intact" in text
    assert policy.calls == [] and [f.step for f in scan(tmp_path)] == [1]  # nothing written
    assert not [p for p in os.listdir(tmp_path) if p.startswith(STAGING_PREFIX)]


def test_a_disk_that_fills_during_a_save_is_named_as_full_not_as_what_the_writer_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's writer says "unexpected pos 704 vs 598" where the disk ran out (issue 44)."""
    from rlcore.app import checkpointing

    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 1 << 20)
    failing = checkpointer(tmp_path, FilePolicy(fail=RuntimeError("unexpected pos 704 vs 598")))
    with pytest.raises(CheckpointError) as info:
        failing.save(1)
    assert f"the disk under {tmp_path} is full (1 MiB free): " in str(info.value)
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 50 << 30)  # room: the writer's own words
    with pytest.raises(CheckpointError) as info:
        checkpointer(tmp_path, FilePolicy(fail=RuntimeError("a rank died"))).save(1)
    assert "is full" not in str(info.value) and "a rank died" in str(info.value)


def test_metrics_are_flushed_to_the_device_once_a_checkpoint_is_published_and_recorded(tmp_path: Path) -> None:
    events: list = []
    c = checkpointer(tmp_path, FilePolicy())
    c.record = lambda m, step: events.append(("record", step, verify(scan(tmp_path)[0]) is None))
    c.flush = lambda: events.append(("flush",))
    c.save(3)
    assert events == [("record", 3, True), ("flush",)]


def test_a_resume_whose_metrics_lack_steps_up_to_the_checkpoint_names_them() -> None:
    from rlcore.app.session import _missing_steps, _spans

    history = [{"step": s} for s in (1, 2, 3, 7)]
    missing = _missing_steps(history, 9)
    assert missing == [4, 5, 6, 8, 9] and _spans(missing) == "4-6, 8-9"
    assert _missing_steps(history[:3], 3) == []


def test_keep_every_keeps_milestones_for_good_also_across_a_restart(tmp_path: Path) -> None:
    c = checkpointer(tmp_path, FilePolicy(), keep=1, keep_every=3)
    for step in range(1, 8):
        c.save(step)
    assert [f.step for f in scan(tmp_path)] == [7, 6, 3]
    checkpointer(tmp_path, FilePolicy(), keep=1, keep_every=3).save(8)  # a new process: same rule
    assert [f.step for f in scan(tmp_path)] == [8, 6, 3]
    checkpointer(tmp_path, FilePolicy(), keep=1).save(9)  # without it, milestones go like the rest
    assert [f.step for f in scan(tmp_path)] == [9]


def test_a_corrupt_checkpoint_that_cannot_be_set_aside_is_named_and_the_resume_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlcore.app import checkpoints

    c = checkpointer(tmp_path, FilePolicy(), keep=5)
    for step in (2, 4):
        c.save(step)
    shard = step_dir(tmp_path, 4) / POLICY_DIR / "shard-0.bin"
    shard.write_bytes(b"x")

    def refuse(src: Any, dst: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoints.os, "rename", refuse)
    point = choose(tmp_path, config(), FORMAT)
    assert point.step == 2
    assert point.skipped[0].endswith("not set aside (Permission denied): remove it by hand")


# -- staged saves (contract 2.3) ----------------------------------------------------------


class StagedPolicy(FilePolicy):
    """A policy whose save copies its state at ``stage_checkpoint`` and writes it on a thread
    of its own (held by ``gate``), as DCP's and megatron-core's asynchronous saves do."""

    def __init__(self, gate: threading.Event | None = None, fail: BaseException | None = None) -> None:
        super().__init__(gate=gate, fail=fail)
        self.writer: threading.Thread | None = None
        self.error: BaseException | None = None
        self.polls = 0

    def stage_checkpoint(self, directory: str) -> dict[str, float]:
        assert self.writer is None or not self.writer.is_alive(), "two staged saves at once"
        staged = {"value": self.value}  # the copy: what is written is the state now
        self.calls.append("stage")

        def write() -> None:
            try:
                if self.gate is not None:
                    assert self.gate.wait(30)
                if self.fail is not None:
                    raise self.fail
                Path(directory, "state.json").write_text(json.dumps(staged))
                Path(directory, "shard-0.bin").write_bytes(os.urandom(self.blob))
                self.calls.append("written")
            except BaseException as err:  # noqa: BLE001 - handed to checkpoint_written
                self.error = err

        self.writer = threading.Thread(target=write, daemon=True)
        self.writer.start()
        return {"host_bytes": 4096.0}

    def checkpoint_written(self) -> bool:
        self.polls += 1
        if self.writer is not None and self.writer.is_alive():
            return False
        err, self.error = self.error, None
        if err is not None:
            raise err
        return True


def staged_checkpointer(root: Path, policy: StagedPolicy, records: list, **kw: Any) -> Checkpointer:
    c = checkpointer(root, policy, records=records)
    c.schedule = Schedule(every=1, last_step=10, keep=2, overlap=False, staged=True)
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_a_staged_save_holds_the_loop_only_for_the_copy_and_writes_the_state_it_copied(tmp_path: Path) -> None:
    gate, records = threading.Event(), []
    policy = StagedPolicy(gate=gate)
    policy.value = 7
    c = staged_checkpointer(tmp_path, policy, records)
    c.save(1)  # returns once staged, the files not yet written
    assert policy.calls == ["stage"] and c.saving and not step_dir(tmp_path, 1).exists()
    c.wait()  # before the policy's next call: no join, the write goes on
    assert c.saving
    policy.value = 8  # the policy trains on while its files are written
    gate.set()
    c.finish()
    assert policy.calls == ["stage", "written"] and policy.polls >= 1
    found = scan(tmp_path)[0]
    assert found.step == 1 and verify(found) is None
    assert json.loads((found.path / POLICY_DIR / "state.json").read_text()) == {"value": 7}
    [(step, line)] = records
    assert step == 1 and line["checkpoint/host_bytes"] == 4096.0
    assert line["checkpoint/stage_time_s"] <= line["checkpoint/save_time_s"]


def test_the_next_staged_save_waits_for_the_last_to_be_published(tmp_path: Path) -> None:
    gate, records = threading.Event(), []
    policy = StagedPolicy(gate=gate)
    c = staged_checkpointer(tmp_path, policy, records)
    c.save(1)
    second = threading.Thread(target=c.save, args=(2,))
    second.start()
    second.join(0.5)
    assert second.is_alive() and policy.calls == ["stage"]  # one staged save in flight
    gate.set()
    second.join(30)
    c.finish()
    assert policy.calls == ["stage", "written", "stage", "written"]
    assert [f.step for f in scan(tmp_path)] == [2, 1] and [s for s, _ in records] == [1, 2]


def test_a_background_write_that_fails_is_raised_naming_the_step_and_the_last_checkpoint_stays(
    tmp_path: Path,
) -> None:
    records: list = []
    c = staged_checkpointer(tmp_path, StagedPolicy(), records)
    c.save(1)
    c.finish()
    failing = staged_checkpointer(tmp_path, StagedPolicy(fail=OSError(28, "No space left on device")), records)
    failing.save(2)  # staged: the failure comes with the write
    with pytest.raises(CheckpointError, match="step 2 could not be saved") as err:
        failing.finish()
    assert "step-00000001" in str(err.value) and "intact" in str(err.value)
    assert [f.step for f in scan(tmp_path)] == [1] and not [p for p in os.listdir(tmp_path) if p.startswith(STAGING_PREFIX)]


def test_a_cancelled_run_stops_waiting_for_a_background_write(tmp_path: Path) -> None:
    from rlcore.errors import Cancelled, CancelToken

    token = CancelToken()
    c = staged_checkpointer(tmp_path, StagedPolicy(gate=threading.Event()), [], cancel=token)
    c.save(1)
    token.cancel("the run was interrupted")
    with pytest.raises(Cancelled):
        c.finish()
    assert scan(tmp_path) == []


_KILLED_STAGED_SAVE = """
import sys, threading, time
from pathlib import Path
from rlcore.app.checkpointing import Checkpointer, Contents, Schedule
from rlcore.publish import publish_dir

class Policy:
    def stage_checkpoint(self, directory):
        def write():
            (Path(directory) / "half.bin").write_bytes(b"x" * 4096)
            sys.stdout.write("writing\\n")  # one write: the main thread prints too
            sys.stdout.flush()
            time.sleep(60)
        threading.Thread(target=write, daemon=True).start()
        return {}
    def checkpoint_written(self):
        return False

c = Checkpointer(
    Path(sys.argv[1]), policy=Policy(), publish=lambda dest, write: publish_dir(dest, write),
    contents=Contents(manifest={}, config_yaml="", env_state=lambda step: None),
    schedule=Schedule(every=1, last_step=10, keep=2, overlap=False, staged=True), record=lambda m, s: None,
)
c.save(2)
sys.stdout.write("staged\\n")
sys.stdout.flush()
c.finish()
"""


def test_a_run_killed_during_a_background_write_resumes_from_the_checkpoint_before(tmp_path: Path) -> None:
    checkpointer(tmp_path, FilePolicy()).save(1)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_STAGED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert sorted(proc.stdout.readline().strip() for _ in range(2)) == ["staged", "writing"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert not step_dir(tmp_path, 2).exists()
    point = choose(tmp_path, config(), FORMAT)
    assert point.step == 1 and len(point.cleaned) == 1

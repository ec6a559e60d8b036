"""End to end: the README's main job on real backends (FSDP + vLLM + arithmetic env).

One shared run (``quickstart``, a session fixture of tests/e2e/conftest.py: ``rlcore run`` in a
subprocess, as a user starts it, saving checkpoints; tests/e2e/test_e2e_export.py exports them)
is checked from several angles, among them that every socket its processes listen on
is on loopback (issue 12, item 3); a second run kills a generation worker mid-run and
must end with an error naming it.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")

from quickstart_run import CHECKPOINTS, QUICKSTART, REPO, RLCORE, STEPS, Quickstart, stop_at_line  # noqa: E402  (the shared run)

from rlcore.app.records import read_metrics  # noqa: E402
from rlcore.app.run import run_job  # noqa: E402
from rlcore.errors import RlcoreError  # noqa: E402
from rlcore.hookspecs import hookimpl  # noqa: E402

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@pytest.fixture(scope="module")
def quickstart_run(quickstart: Quickstart) -> Path:
    return quickstart.dir


def test_every_socket_of_the_run_is_on_loopback(quickstart: Quickstart) -> None:
    """No listener beyond loopback on a single host: each socket another host could reach
    is on 127.0.0.1 or ::1."""
    owners = set(quickstart.sockets.values())
    # The sample saw the run's servers, so the check below is not vacuous.
    for expected in ("gcs_server", "raylet"):
        assert expected in owners, sorted(owners)
    assert any("FSDPWorker" in o for o in owners) and any("VLLMWorker" in o for o in owners), sorted(owners)
    outside = sorted(
        f"{owner}: {ip}:{port}/{kind}" for (ip, port, kind), owner in quickstart.sockets.items() if ip not in LOOPBACK
    )
    assert not outside, f"sockets reachable from other hosts: {outside}"


def test_run_directory_files_exist_and_parse(quickstart_run: Path) -> None:
    for name in ("metrics.jsonl", "trace.json", "setup_timeline.png", "reward.png", "config.yaml"):
        assert (quickstart_run / name).is_file(), name
    trace = json.loads((quickstart_run / "trace.json").read_text())
    spans = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"init:policy", "init:generation", "init:env", "refit:initial", "generate", "train", "refit"} <= spans
    for png in ("setup_timeline.png", "reward.png"):
        assert (quickstart_run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_setup_metrics_are_logged(quickstart_run: Path) -> None:
    records = read_metrics(quickstart_run / "metrics.jsonl")
    setup = records[0]
    for key in (
        "timing/setup/total_setup_time_s",
        "timing/setup/critical_path_s",
        "timing/setup/serial_sum_s",
        "timing/setup/init:policy_time_s",
        "timing/setup/init:generation_time_s",
        "timing/setup/init:env_time_s",
        "timing/setup/refit:initial_time_s",
        "timing/setup/weight_sync_time_s",
        "timing/setup/collective_init_time_s",
    ):
        assert isinstance(setup[key], float) and setup[key] >= 0, key
    # Policy and generation overlapped: their init spans in the trace intersect (that the
    # overlap also saves time on 2 shared cores is a timing claim: the perf test below).
    trace = json.loads((quickstart_run / "trace.json").read_text())["traceEvents"]
    span = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("ph") == "X"}
    (p0, p1), (g0, g1) = span["init:policy"], span["init:generation"]
    assert max(p0, g0) < min(p1, g1)


@pytest.mark.perf
def test_overlapped_setup_beats_serial(quickstart_run: Path) -> None:
    setup = read_metrics(quickstart_run / "metrics.jsonl")[0]
    assert setup["timing/setup/total_setup_time_s"] < setup["timing/setup/serial_sum_s"]


def test_every_step_logged_and_refit_exact(quickstart_run: Path) -> None:
    steps = [r for r in read_metrics(quickstart_run / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    errors = [r["refit/token_mult_prob_error"] for r in read_metrics(quickstart_run / "metrics.jsonl") if "refit/token_mult_prob_error" in r]
    assert len(errors) == STEPS + 1  # refit:initial and every step
    assert all(1.0 <= e < 1.05 for e in errors), errors
    for r in steps:
        assert r["refit/weight_sync_time_s"] > 0 and r["refit/bytes"] > 0


def test_checkpoints_are_staged_and_published_whole(quickstart_run: Path) -> None:
    """The FSDP policy stages its saves (contract 2.3): each save's line says what the loop
    waited (the copy) apart from the whole save and the host memory the copy holds, and every
    checkpoint kept is published whole (its digests check)."""
    from rlcore.app.checkpoints import scan, verify

    saves = [r for r in read_metrics(quickstart_run / "metrics.jsonl") if "checkpoint/save_time_s" in r]
    assert [r["checkpoint/step"] for r in saves] == [4, 8, 12]
    for r in saves:
        assert 0 < r["checkpoint/stage_time_s"] <= r["checkpoint/save_time_s"]
        assert r["checkpoint/host_bytes"] > 0
    kept = scan(quickstart_run / "checkpoints")
    assert [f.step for f in kept] == [12, 8] and all(verify(f) is None for f in kept)


def _losses(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    return {
        r["step"]: (r["train/loss"], r["train/grad_norm"], r["reward/mean"])
        for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r
    }


def _trend(run_dir: Path) -> dict:
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "health/reward_first" in r]
    return {k: v for k, v in lines[-1].items() if k.startswith("health/")}


def test_a_run_stopped_by_sigterm_saves_and_resumes_to_the_same_losses(quickstart_run: Path, tmp_path: Path) -> None:
    """Preemption: SIGTERM mid-run finishes the step and saves it (exit 143); ``rlcore run
    --resume DIR`` continues from it and, on this deterministic CPU, every step's loss,
    gradient norm and reward equal the run that never stopped (the shared run)."""
    run_dir = tmp_path / "run"
    code, out = stop_at_line(
        [str(RLCORE), "run", QUICKSTART, f"grpo.steps={STEPS}", *CHECKPOINTS,
         f"setup.cache_dir={tmp_path / 'cache'}", "--out", str(run_dir)], "step   5", cwd=REPO,
    )
    assert code == 128 + signal.SIGTERM, out[-3000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    last = int(saved[-1].removeprefix("step-"))
    assert last > 4 and f"checkpoint of step {last}: " in out and "held for it" in out, out[-3000:]
    assert saved == [f"step-{4:08d}", f"step-{last:08d}"]  # keep=2
    resumed = subprocess.run(
        [str(RLCORE), "run", "--resume", str(run_dir)], capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / saved[-1]} (step {last}" in resumed.stdout
    # No step before the checkpoint was done again, and one line per step in the records.
    done_again = [int(x.split()[1]) for x in resumed.stdout.splitlines() if x.startswith("step ")]
    assert done_again == list(range(last + 1, STEPS + 1))
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert steps == list(range(1, STEPS + 1))
    assert _losses(run_dir) == _losses(quickstart_run)
    assert json.loads((run_dir / "run.json").read_text())["steps_done"] == STEPS
    # The health figures cover the whole run, not the resumed process's steps (issue 44).
    assert _trend(run_dir) == _trend(quickstart_run)
    resume_line = next(r for r in read_metrics(run_dir / "metrics.jsonl") if "checkpoint/resumed_from" in r)
    assert resume_line["checkpoint/metrics_missing_steps"] == []


def test_reward_rises(quickstart_run: Path) -> None:
    rewards = [r["reward/mean"] for r in read_metrics(quickstart_run / "metrics.jsonl") if "reward/mean" in r]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.1, rewards


def test_every_step_writes_its_samples_and_the_cli_reads_them(quickstart_run: Path) -> None:
    from rlcore.app.samples import newest

    lines = newest(quickstart_run, 0)
    # logging.samples_per_step (4) of every step, one per prompt: different prompts, decoded.
    assert [line["step"] for line in lines] == [s for s in range(1, STEPS + 1) for _ in range(4)]
    first = [line for line in lines if line["step"] == 1]
    assert len({line["prompt"] for line in first}) == 4 and all(line["prompt"].endswith("=") for line in first)
    assert all(isinstance(line["reward"], float) and line["weight_version"] == line["step"] - 1 for line in lines)
    shown = subprocess.run([str(RLCORE), "samples", str(quickstart_run), "-n", "2"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count(f"step {STEPS} ") == 2 and shown.stdout.count("completion: ") == 2


class KillGenerationWorker:
    """Test-only wrapper plugin: SIGKILLs the generation worker process before refit step 2."""

    def __init__(self) -> None:
        self.killed: int | None = None

    @hookimpl(wrapper=True)
    def rlcore_refit(self, generation, ctx):
        if ctx.step == 2 and self.killed is None:
            self.killed = generation.group.pids()[0]
            os.kill(self.killed, signal.SIGKILL)
        return (yield)


# tests/e2e/test_worker_loss_e2e.py kills the same engine of the same run by default and checks
# more (the role, the metrics written): this one repeats it, so it is soak.
@pytest.mark.soak
def test_killed_generation_worker_fails_the_run_naming_it(tmp_path: Path) -> None:
    killer = KillGenerationWorker()
    t0 = time.monotonic()
    with pytest.raises(RlcoreError) as info:
        run_job(
            QUICKSTART,
            ["grpo.steps=4", f"setup.cache_dir={tmp_path / 'cache'}", "refit.timeout_s=60"],
            out=str(tmp_path / "run"),
            extra_plugins=[("kill-generation", killer)],
        )
    assert killer.killed is not None
    assert "vllm-generation" in str(info.value)
    assert time.monotonic() - t0 < 240

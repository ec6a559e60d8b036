"""End to end: FSDP policy + vLLM generation (server mode) + a NeMo Gym env.

One shared run (module fixture) of examples/nemo_gym.yaml is checked from
several angles; two more runs fail on purpose during setup and must end with a
SetupError that names the failure, in bounded time, leaving no process behind:
the first refit fails while Gym waits for the endpoint, and a Gym server
cannot start (unknown env) while policy and generation are still starting.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")
pytest.importorskip("rlcore_nemo_gym")

from rlcore.app.records import read_metrics  # noqa: E402
from rlcore.app.run import run_job  # noqa: E402
from rlcore.errors import ConfigError, RefitError, SetupError  # noqa: E402
from rlcore.hookspecs import hookimpl  # noqa: E402
from rlcore.testing import LeakCheck  # noqa: E402
from rlcore_nemo_gym.servers import find_gym_python  # noqa: E402


def _gym_installed() -> bool:
    try:
        find_gym_python(None)
        return True
    except ConfigError:
        return False


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not _gym_installed(),
        reason="the NeMo Gym venv (.venv-gym) is not installed: run bash install.sh --all",
    ),
]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "nemo_gym.yaml")
MEGATRON_EXAMPLE = str(REPO / "examples" / "megatron_nemo_gym.yaml")
STEPS = 3


def _processes_mentioning(path: Path) -> list[str]:
    """Live processes anywhere whose command line names ``path`` (vLLM and Gym servers
    name files under the run's directories; a re-parented orphan is found too)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if str(path) in cmd:
            out.append(f"pid {p.pid}: {cmd[:160]}")
    return out


def _assert_nothing_left(tmp: Path, leaks: LeakCheck, settle_s: float = 30.0) -> None:
    left = leaks.problems(settle_s)
    end = time.monotonic() + settle_s
    while _processes_mentioning(tmp) and time.monotonic() < end:
        time.sleep(0.5)
    assert not left, f"child processes or threads left behind: {left}"
    assert not _processes_mentioning(tmp), _processes_mentioning(tmp)


def _gym_launchers(run_dir: Path) -> list[int]:
    """Launcher pids (= process groups of Gym's servers) recorded in the run directory."""
    pids = []
    for status in (run_dir / "nemo_gym").glob("*/status.json"):
        pids.append(json.loads(status.read_text())["pid"])
    return pids


def _group_alive(pgid: int) -> list[int]:
    import os

    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (OSError, psutil.Error):
            pass
    return out


@pytest.fixture(scope="module")
def gym_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nemo-gym")
    cache = tmp_path_factory.mktemp("cache")
    return run_job(
        EXAMPLE, [f"grpo.steps={STEPS}", f"setup.cache_dir={cache}"], out=str(out / "run")
    )


def test_setup_metrics_and_rewards_per_step(gym_run: Path) -> None:
    records = read_metrics(gym_run / "metrics.jsonl")
    setup = records[0]
    for key in (
        "timing/setup/init:env_time_s",
        "timing/setup/init:generation_time_s",
        "timing/setup/init:policy_time_s",
        "timing/setup/refit:initial_time_s",
        "timing/setup/total_setup_time_s",
        "timing/setup/critical_path_s",
    ):
        assert isinstance(setup[key], float) and setup[key] > 0, key
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert 0.0 <= r["reward/mean"] <= 1.0
        # Gym's token ids (prompt and completion, from vLLM through Gym) score the same
        # under the policy as vLLM scored them: the ids and logprobs are consistent.
        assert 1.0 <= r["train/gen_vs_policy_mult_prob_error"] < 1.01, r


def test_gym_started_with_the_other_inits_and_waited_for_the_endpoint(gym_run: Path) -> None:
    trace = json.loads((gym_run / "trace.json").read_text())
    spans = {e["name"]: e for e in trace["traceEvents"] if e.get("ph") == "X"}
    env, gen, refit = spans["init:env"], spans["init:generation"], spans["refit:initial"]
    assert abs(env["ts"] - gen["ts"]) < 1e6  # started together (µs)
    assert env["ts"] + env["dur"] >= refit["ts"] + refit["dur"]  # and waited for the first refit
    timings = json.loads(next((gym_run / "nemo_gym").glob("*/timings.json")).read_text())
    # Gym's servers were up while generation was still starting: off the critical path.
    assert timings["servers_ready"] < timings["endpoint_event"] <= timings["ready"]


def test_no_gym_process_outlives_the_run(gym_run: Path) -> None:
    launchers = _gym_launchers(gym_run)
    assert launchers
    for pgid in launchers:
        assert _group_alive(pgid) == [], f"Gym process group {pgid} still alive"
    assert not _processes_mentioning(gym_run)


class FailFirstRefit:
    """Test-only wrapper plugin: the first refit (refit:initial) fails."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl(wrapper=True)
    def rlcore_refit(self, ctx):
        self.calls += 1
        if ctx.step == 0:
            raise RefitError("test: injected failure of refit:initial")
        return (yield)


@pytest.mark.timeout(480)  # bounded: a hang would wait out the 1800 s setup deadline
@pytest.mark.parametrize(
    "generation",
    # vLLM's case repeats Megatron's through the same setup path, with the slowest start
    # (vLLM's server, ~60 s on two cores): soak.
    [pytest.param("vllm", marks=pytest.mark.soak), "megatron"],
)
def test_refit_failing_while_gym_waits_tears_everything_down(
    tmp_path: Path, generation: str
) -> None:
    """Gym waits for the endpoint while the first refit fails: a SetupError in bounded time,
    and every Gym process, generation process and endpoint thread (Megatron's runs in
    this process) is gone."""
    example = EXAMPLE if generation == "vllm" else MEGATRON_EXAMPLE
    pytest.importorskip(f"rlcore_{generation}")
    leaks = LeakCheck()
    fail = FailFirstRefit()
    with pytest.raises(SetupError) as info:
        run_job(
            example,
            [f"setup.cache_dir={tmp_path / 'cache'}", "grpo.steps=1"],
            out=str(tmp_path / "run"),
            extra_plugins=[("fail-first-refit", fail)],
        )
    err = info.value
    assert fail.calls == 1 and err.task == "refit:initial"
    assert "injected failure" in str(err)
    assert any(a.startswith("init:env") for a in err.aborted), (
        err.aborted
    )  # Gym was waiting: cancelled
    assert "init:generation" in " ".join(err.shut_down), err.shut_down
    for pgid in _gym_launchers(tmp_path / "run"):
        assert _group_alive(pgid) == [], f"Gym process group {pgid} still alive"
    _assert_nothing_left(tmp_path, leaks)


@pytest.mark.timeout(480)  # bounded: a hang would wait out the 1800 s setup deadline
def test_gym_server_failing_to_start_tears_policy_and_generation_down(tmp_path: Path) -> None:
    leaks = LeakCheck()
    with pytest.raises(SetupError) as info:
        run_job(
            EXAMPLE,
            [
                f"setup.cache_dir={tmp_path / 'cache'}",
                "grpo.steps=1",
                "env.options.env_name=no_such_gym_env",
            ],
            out=str(tmp_path / "run"),
        )
    err = info.value
    assert err.task == "init:env" and err.backend == "nemo_gym"
    assert isinstance(err.cause, ConfigError) and "no_such_gym_env" in str(err)
    # Policy and generation were still starting: cancelled, and shut down when they returned.
    stopped = " ".join(err.aborted + err.shut_down)
    assert "init:policy" in stopped and "init:generation" in stopped, (err.aborted, err.shut_down)
    _assert_nothing_left(tmp_path, leaks)


# ---------------------------------------------------------------------------
# Megatron generation behind rlcore's OpenAI-compatible endpoint
# ---------------------------------------------------------------------------

MEGATRON_STEPS = 2


@pytest.fixture(scope="module")
def megatron_gym_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LeakCheck]:
    pytest.importorskip("rlcore_megatron")
    out = tmp_path_factory.mktemp("megatron-gym")
    cache = tmp_path_factory.mktemp("cache")
    leaks = LeakCheck()
    run = run_job(
        MEGATRON_EXAMPLE,
        [f"grpo.steps={MEGATRON_STEPS}", f"setup.cache_dir={cache}"],
        out=str(out / "run"),
    )
    return run, leaks


def test_megatron_endpoint_serves_gym_rollouts(megatron_gym_run: tuple[Path, LeakCheck]) -> None:
    run, _ = megatron_gym_run
    records = read_metrics(run / "metrics.jsonl")
    setup = records[0]
    assert setup["timing/setup/init:env_time_s"] > 0
    # Three-way overlap: Gym's init started before policy and generation were up (its
    # span intersects theirs); that setup then equals its critical path is the perf test's.
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    span = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("ph") == "X"}
    env0 = span["init:env"][0]
    assert env0 < span["init:policy"][1] and env0 < span["init:generation"][1]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, MEGATRON_STEPS + 1))
    for r in steps:
        assert 0.0 <= r["reward/mean"] <= 1.0
        # Gym took prompt ids, completion ids and logprobs from the Megatron endpoint;
        # the policy scores them the same: ids and logprobs are those the engine sampled.
        assert 1.0 <= r["train/gen_vs_policy_mult_prob_error"] < 1.01, r
        assert r["refit/token_mult_prob_error"] < 1.05
    trace = json.loads((run / "trace.json").read_text())
    spans = {e["name"]: e for e in trace["traceEvents"] if e.get("ph") == "X"}
    env, gen, refit = spans["init:env"], spans["init:generation"], spans["refit:initial"]
    assert abs(env["ts"] - gen["ts"]) < 1e6
    assert env["ts"] + env["dur"] >= refit["ts"] + refit["dur"]


@pytest.mark.perf
def test_megatron_gym_setup_is_its_critical_path(megatron_gym_run: tuple[Path, LeakCheck]) -> None:
    setup = read_metrics(megatron_gym_run[0] / "metrics.jsonl")[0]
    assert setup["timing/setup/total_setup_time_s"] <= 1.15 * setup["timing/setup/critical_path_s"]


def test_megatron_gym_run_leaves_nothing_behind(megatron_gym_run: tuple[Path, LeakCheck]) -> None:
    run, leaks = megatron_gym_run
    for pgid in _gym_launchers(run):
        assert _group_alive(pgid) == [], f"Gym process group {pgid} still alive"
    # The endpoint's server thread is among the threads checked here.
    _assert_nothing_left(run.parent, leaks)

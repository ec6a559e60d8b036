"""Real NeMo Gym servers (from the Gym venv) against a TEST-ONLY stub endpoint.

Rollouts come back with rewards and token ids whether the endpoint is announced
before or after the servers are up; every failure path ends with an RlcoreError
that names what failed, within its deadline, and leaves no process behind.
Skipped only when the Gym venv is not installed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from gym_helpers import StubEndpoint, gym_python, make_ctx, post_later, rollout_request

from rlcore.errors import Cancelled, ConfigError, DeadlineExceeded, RlcoreError
from rlcore.handles import Endpoint
from rlcore.testing import LeakCheck
from rlcore_nemo_gym.handle import NemoGymEnv, start_env
from rlcore_nemo_gym.servers import GymError, GymServers

pytestmark = pytest.mark.skipif(
    gym_python() is None, reason="the NeMo Gym venv (.venv-gym) is not installed: run bash install.sh --all"
)

ENV = "bunsenbench_chemistry_mcq"
# Long enough for the stub's full reply, so the first row scores 1.0.
GRPO = {"max_new_tokens": 64, "temperature": 1.0}


@pytest.fixture
def stub() -> Iterator[StubEndpoint]:
    s = StubEndpoint().start()
    yield s
    s.stop()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ports(env: NemoGymEnv) -> list[int]:
    info = env.servers.info or {}
    ports = [int(s["url"].rsplit(":", 1)[1]) for s in info["servers"].values()]
    return [*ports, env.servers.spec.head_port]


def _assert_rollouts(env: NemoGymEnv) -> None:
    groups = env.collect_rollouts(rollout_request(3, 4, step=1))
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    for g in groups:
        for s in g:
            assert set(s) >= {"prompt_ids", "token_ids", "logprobs", "reward"}
            assert s["prompt_ids"] and s["token_ids"]
            assert len(s["logprobs"]) == len(s["token_ids"])
            assert all(isinstance(t, int) for t in s["token_ids"])
            assert isinstance(s["reward"], float)
    # The stub always answers H2O: right for row 0 only.
    assert [s["reward"] for s in groups[0]] == [1.0] * 4
    assert all(s["reward"] == 0.0 for g in groups[1:] for s in g)
    assert groups[0][0]["token_ids"] == list(b"<choice>H2O</choice>")
    # Step 2 takes the next rows (3, 4 and 0 again of the five).
    step2 = env.collect_rollouts(rollout_request(3, 1, step=2))
    assert [g[0]["reward"] for g in step2] == [0.0, 0.0, 1.0]


def _shutdown_leaves_nothing(env: NemoGymEnv) -> None:
    pids = env.pids()
    ports = _ports(env)
    assert len(pids) >= 5, pids  # the launcher (head server) and four Gym servers
    assert all(_listening(p) for p in ports)
    env.shutdown()
    assert env.pids() == []
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    )
    assert not any(_listening(p) for p in ports)
    env.shutdown()  # idempotent


def test_endpoint_up_before_the_servers(
    tmp_path: Path, stub: StubEndpoint, leaks: LeakCheck
) -> None:
    ctx = make_ctx(tmp_path, {"env_name": ENV, "verify_on_init": True}, grpo=GRPO)
    ctx.events.post("generation.endpoint", stub.endpoint)
    env = start_env(ctx)
    try:
        assert env.timings["endpoint_published"] < env.timings["servers_ready"]
        assert env.timings["verify"] > 0  # one rollout ran at the end of init
        assert env.run_url.endswith("/run") and env.agent_name == f"{ENV}_simple_agent"
        _assert_rollouts(env)
        # Gym asked the endpoint for token ids and logprobs.
        req = stub.requests[-1]
        assert req["model"] == "policy" and req["logprobs"] is True
        assert req["return_token_ids"] is True and req["return_tokens_as_token_ids"] is True
    finally:
        _shutdown_leaves_nothing(env)


def test_endpoint_announced_after_the_servers_are_up(tmp_path: Path, leaks: LeakCheck) -> None:
    ctx = make_ctx(tmp_path, {"env_name": ENV}, grpo=GRPO)
    late: dict[str, StubEndpoint] = {}

    def later() -> Endpoint:
        # Runs in post_later's thread: the endpoint comes up only once Gym is ready.
        while True:
            status = list((tmp_path / "run" / "nemo_gym").glob("*/status.json"))
            if status and json.loads(status[0].read_text()).get("state") == "ready":
                break
            time.sleep(0.1)
        late["stub"] = StubEndpoint().start()
        return late["stub"].endpoint

    post_later(ctx, 0.0, later)
    env = start_env(ctx)
    try:
        assert env.timings["servers_ready"] < env.timings["endpoint_event"]
        _assert_rollouts(env)
    finally:
        _shutdown_leaves_nothing(env)
        late["stub"].stop()


def test_endpoint_with_another_model_name_restarts_gym_with_it(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    other = StubEndpoint(model="other-model").start()
    try:
        ctx = make_ctx(tmp_path, {"env_name": ENV}, grpo=GRPO)
        ctx.events.post("generation.endpoint", other.endpoint)
        env = start_env(ctx)
        try:
            assert env.servers.spec.model_name == "other-model"
            assert env.collect_rollouts(rollout_request(1, 2, step=1))[0][0]["reward"] == 1.0
        finally:
            _shutdown_leaves_nothing(env)
        assert len(list((tmp_path / "run" / "nemo_gym").glob("*/status.json"))) == 2
    finally:
        other.stop()


def test_multi_turn_env_samples_the_last_model_turn(tmp_path: Path, leaks: LeakCheck) -> None:
    tools = StubEndpoint(tool_calls=True, reply="it is sunny").start()
    try:
        ctx = make_ctx(tmp_path, {"env_name": "example_single_tool_call"}, grpo=GRPO)
        ctx.events.post("generation.endpoint", tools.endpoint)
        env = start_env(ctx)
        try:
            [[s]] = env.collect_rollouts(rollout_request(1, 1, step=1))
        finally:
            _shutdown_leaves_nothing(env)
        # Turn 1 called the weather tool; turn 2 answered after seeing its result.
        assert s["model_turns"] == 2
        assert s["token_ids"] == list(b"it is sunny")
        first_prompt = json.dumps(tools.requests[0]["messages"]).encode()
        assert len(s["prompt_ids"]) > len(
            first_prompt
        )  # the conversation so far, tool result included
        assert any(m.get("role") == "tool" for m in tools.requests[-1]["messages"])
    finally:
        tools.stop()


def test_endpoint_without_token_ids_fails_the_check_rollout(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    plain = StubEndpoint(token_ids=False).start()
    try:
        ctx = make_ctx(tmp_path, {"env_name": ENV, "verify_on_init": True}, grpo=GRPO)
        ctx.events.post("generation.endpoint", plain.endpoint)
        with pytest.raises(RlcoreError) as info:
            start_env(ctx)
        assert "token" in str(info.value), str(info.value)[-1500:]
    finally:
        plain.stop()


def test_bad_env_name_is_a_config_error_naming_it(tmp_path: Path, leaks: LeakCheck) -> None:
    ctx = make_ctx(tmp_path, {"env_name": "bunsenbench_chemistry_mcqq"})
    with pytest.raises(ConfigError) as info:
        start_env(ctx)
    msg = str(info.value)
    assert info.value.key == "env.options.env_name"
    assert "bunsenbench_chemistry_mcqq" in msg and "Did you mean bunsenbench_chemistry_mcq" in msg
    assert not (tmp_path / "run" / "nemo_gym").exists()  # checked before anything starts


def test_the_launcher_checks_the_env_too(tmp_path: Path, leaks: LeakCheck) -> None:
    # Past the plugin's quick check (it only knows Gym's built-in envs): Gym's own paths.
    ctx = make_ctx(
        tmp_path, {"env_name": ENV, "config_path": "resources_servers/nope/configs/nope.yaml"}
    )
    with pytest.raises(ConfigError) as info:
        start_env(ctx)
    assert info.value.key == "env.options.config_path" and "nope.yaml" in str(info.value)


def test_port_conflict_fails_naming_the_port(tmp_path: Path, leaks: LeakCheck) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ctx = make_ctx(tmp_path, {"env_name": ENV, "head_port": port})
        with pytest.raises(RlcoreError) as info:
            start_env(ctx)
    assert f"127.0.0.1:{port}" in str(info.value) and "head_port" in str(info.value)


def test_a_server_that_crashes_at_start_fails_init_naming_it(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    py = gym_python()
    assert py is not None
    site = subprocess.run(
        [
            str(py),
            "-c",
            "import nemo_gym, pathlib; print(pathlib.Path(nemo_gym.__file__).parent.parent)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    config = Path(site) / "resources_servers" / ENV / "configs" / f"{ENV}.yaml"
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        config.read_text().replace("entrypoint: app.py", "entrypoint: no_such_app.py", 1)
    )
    ctx = make_ctx(tmp_path, {"env_name": ENV, "config_path": str(broken)})
    ctx.events.post("generation.endpoint", Endpoint("http://127.0.0.1:9/v1", "policy"))
    with pytest.raises(RlcoreError) as info:  # named as it dies, not at the task's deadline
        start_env(ctx)
    assert f"`{ENV}` finished unexpectedly" in str(info.value), str(info.value)[-2000:]


def test_endpoint_never_announced_is_a_deadline_naming_the_event(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    # The task's deadline passes while Gym's servers are still starting (a few seconds
    # in) or after they are up (a loaded machine may take either path): the error names
    # the event it waited for, and the task, either way.
    ctx = make_ctx(tmp_path, {"env_name": ENV}, deadline_s=4.0)
    with pytest.raises(DeadlineExceeded) as info:
        start_env(ctx)
    assert "generation.endpoint" in str(info.value) and "init:env" in str(info.value)
    assert "which never came" in str(info.value)


def test_announced_endpoint_that_never_answers_is_a_deadline_naming_it(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed again: nothing listens there
    ctx = make_ctx(tmp_path, {"env_name": ENV, "endpoint_timeout_s": 3.0})
    ctx.events.post("generation.endpoint", Endpoint(f"http://127.0.0.1:{dead}/v1", "policy"))
    with pytest.raises(DeadlineExceeded) as info:  # endpoint_timeout_s, not the task's
        start_env(ctx)
    assert f"http://127.0.0.1:{dead}/v1" in str(info.value)


def test_cancel_during_start_stops_everything(
    tmp_path: Path, leaks: LeakCheck, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled, Gym's servers are ended at once, not asked to stop and waited for: the
    executor abandons a task that takes more than a few seconds to stop, and Gym's graceful
    stop took longer than that beside busy processes (its servers then outlived the run)."""
    ctx = make_ctx(tmp_path, {"env_name": ENV})
    import threading

    stops: list[tuple[float, float]] = []
    real_stop = GymServers.stop

    def recording_stop(self: GymServers, grace_s: float = 15.0, term_s: float = 3.0) -> None:
        stops.append((grace_s, term_s))
        real_stop(self, grace_s, term_s)

    monkeypatch.setattr(GymServers, "stop", recording_stop)
    timer = threading.Timer(3.0, ctx.cancel.cancel, args=("test: another task failed",))
    timer.start()
    with pytest.raises(Cancelled, match="another task failed"):  # not the 1800 s deadline
        start_env(ctx)
    timer.join()
    assert stops and stops[0] == (0.0, 1.0), stops


# Each of Gym's server kinds, killed between two steps (as a crash meets a run): the
# next rollouts fail naming that server, its kind, its exit status and the log's tail.
DEAD_PARTS = {
    "resources": ("resources_servers", r"Gym's resources server '{name}' \(http://127\.0\.0\.1:\d+\) died \(killed by SIGKILL\)"),
    "agent": ("responses_api_agents", r"Gym's agent server '{name}' \(http://127\.0\.0\.1:\d+\) died \(killed by SIGKILL\)"),
    "model": ("responses_api_models", r"Gym's model server '{name}' \(http://127\.0\.0\.1:\d+\) died \(killed by SIGKILL\)"),
    "head": (None, r"the Gym launcher, which runs Gym's head server \(pid {pid}\), exited \(killed by SIGKILL\)"),
}


# The resources and agent servers die through the same path as the model server (a Gym
# server process of the launcher's): soak; the default suite kills a server and the head.
@pytest.mark.parametrize(
    "part",
    [pytest.param(p, marks=pytest.mark.soak) if p in ("resources", "agent") else p for p in DEAD_PARTS],
)
def test_a_dead_server_is_named_by_the_next_rollouts(
    tmp_path: Path, stub: StubEndpoint, leaks: LeakCheck, part: str
) -> None:
    server_type, expected = DEAD_PARTS[part]
    ctx = make_ctx(tmp_path, {"env_name": ENV, "verify_on_init": False}, grpo=GRPO)
    ctx.events.post("generation.endpoint", stub.endpoint)
    env = start_env(ctx)
    try:
        if part == "resources":  # while all run: every socket of Gym's processes is on loopback
            outside = [
                f"{pid}: {c.laddr.ip}:{c.laddr.port}"
                for pid in env.pids()
                for c in psutil.Process(pid).net_connections("inet")
                if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1")
            ]
            assert not outside, outside
        assert len(env.collect_rollouts(rollout_request(1, 2, step=1))) == 1  # step 1 works
        servers = env.servers.info["servers"]
        if server_type is None:
            name, victim = "head", env.servers.proc.pid
        else:
            name = next(n for n, s in servers.items() if s["type"] == server_type)
            victim = env.servers.server_processes[name].pid
        assert env.servers.alive()
        os.kill(victim, signal.SIGKILL)
        if part == "head":  # the rollouts do not need the head: the check before them sees it
            env.servers.proc.wait(timeout=10)
        with pytest.raises(GymError) as err:
            env.collect_rollouts(rollout_request(2, 2, step=2))
    finally:
        env.shutdown()
    message = str(err.value)
    assert re.search(expected.format(name=re.escape(name), pid=victim), message), message
    assert f"end of {env.servers.log_path}" in message
    assert "ClientPayloadError" not in message.split("(the rollouts failed")[0]
    assert env.pids() == []


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


_ORPHAN = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from gym_helpers import StubEndpoint, make_ctx
    from rlcore_nemo_gym.handle import start_env
    stub = StubEndpoint().start()
    ctx = make_ctx(Path({tmp!r}), {{"env_name": {env!r}, "verify_on_init": False}})
    ctx.events.post("generation.endpoint", stub.endpoint)
    env = start_env(ctx)
    print(env.servers.pgid, flush=True)
    time.sleep(600)
    """
)


def test_servers_stop_when_the_rlcore_process_dies(tmp_path: Path) -> None:
    script = _ORPHAN.format(tests=str(Path(__file__).parent), tmp=str(tmp_path), env=ENV)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip().isdigit(), f"child did not start Gym: {line!r}"
        pgid = int(line)
        assert len(_group(pgid)) >= 5
        proc.kill()  # no shutdown(): the launcher sees its stdin close
        proc.wait(10)
        end = time.monotonic() + 30
        while _group(pgid) and time.monotonic() < end:
            time.sleep(0.2)
        if _group(pgid):
            os.killpg(pgid, signal.SIGKILL)
            pytest.fail(f"Gym's process group {pgid} outlived the rlcore process by 30s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

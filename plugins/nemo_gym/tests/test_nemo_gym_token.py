"""NeMo Gym in a run across nodes (issue 14): Gym gets the run's token as its API key and
calls a generation endpoint on another address that checks it; Gym's own servers stay on
loopback beside the driver, and an env placed on other nodes is refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gym_helpers import StubEndpoint, gym_python, make_ctx, rollout_request

from rlcore.config import NodeSelector
from rlcore.config.placement import Network
from rlcore.errors import ConfigError
from rlcore.testing import LeakCheck
from rlcore.testing.fixtures import outward_address
from rlcore_nemo_gym.handle import start_env

ENV = "bunsenbench_chemistry_mcq"
GRPO = {"max_new_tokens": 64, "temperature": 1.0}


def test_an_env_placed_on_other_nodes_is_refused(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, {"env_name": ENV})
    ctx.config.placement.nodes.env = NodeSelector(resources={"node_c": 0.01})
    with pytest.raises(ConfigError, match="placement.nodes.env") as err:
        start_env(ctx)
    assert err.value.key == "placement.nodes.env"
    assert not (tmp_path / "run" / "nemo_gym").exists()  # nothing was started


@pytest.mark.skipif(gym_python() is None, reason="the NeMo Gym venv (.venv-gym) is not installed")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gym_calls_a_guarded_endpoint_elsewhere_with_the_runs_token(tmp_path: Path, leaks: LeakCheck) -> None:
    network = Network.spread()
    stub = StubEndpoint(host=outward_address(), token=network.token).start()
    try:
        ctx = make_ctx(tmp_path, {"env_name": ENV}, grpo=GRPO)
        ctx.network = network
        ctx.events.post("generation.endpoint", stub.endpoint)
        env = start_env(ctx)
        try:
            # Gym was started with the token: the endpoint's key matched, no restart.
            assert env.servers.spec.api_key == network.token and "endpoint_published" in env.timings
            groups = env.collect_rollouts(rollout_request(2, 2, step=1))
            assert [s["reward"] for s in groups[0]] == [1.0, 1.0]
            assert stub.requests and set(stub.authorizations) == {f"Bearer {network.token}"}
            # Gym's own servers stay beside the driver, on loopback.
            urls = [s["url"] for s in (env.servers.info or {})["servers"].values()]
            assert urls and all(u.startswith("http://127.0.0.1:") for u in urls), urls
        finally:
            env.shutdown()
        assert httpx.get(stub.endpoint.base_url + "/models", timeout=10).status_code == 401
    finally:
        stub.stop()

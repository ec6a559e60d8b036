"""Which Ray cluster a run uses and the checks before it joins one (issue 32).

The choice is a function of the config and the environment; the checks here need no Ray
cluster (a closed port, a cluster's answer given as :class:`ClusterFacts`). The same
checks against real ``ray start`` processes are in ``tests/e2e/test_ray_start.py``.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from rlcore.app.cli import main
from rlcore.config import ClusterConfig, load_config
from rlcore.config.placement import NodeInfo
from rlcore.errors import ConfigError
from rlcore.runtime import join
from rlcore.runtime.join import (
    JOB_CONFIG_ENV,
    ClusterFacts,
    check_join,
    choose_cluster,
    is_loopback,
    job_env_vars,
    token_sources,
)
from rlcore.setup.preflight import check_joined_resources

REPO = Path(__file__).resolve().parents[2]
JOB = {JOB_CONFIG_ENV: json.dumps({"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "4"}}}), "RAY_ADDRESS": "10.0.0.5:6379"}


@pytest.fixture(autouse=True)
def _no_ray_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is no Ray driver here, whatever an earlier test left connected."""
    monkeypatch.setattr(join, "_ray_connected", lambda: False)


def test_an_explicit_address_wins_and_local_is_always_embedded() -> None:
    choice = choose_cluster(ClusterConfig(address="127.0.0.1:6379"), JOB)
    assert (choice.address, choice.why) == ("127.0.0.1:6379", "cluster.address")
    local = choose_cluster(ClusterConfig(address="local"), JOB)
    assert local.address is None and not local.joined and "cluster.address=local" in local.describe()


def test_the_driver_of_a_ray_job_joins_the_jobs_cluster() -> None:
    choice = choose_cluster(ClusterConfig(), JOB)
    assert choice.address == "10.0.0.5:6379" and "driver of a Ray job" in choice.why
    assert choice.describe().startswith("the Ray cluster at 10.0.0.5:6379 (this is the driver of a Ray job")
    assert job_env_vars(JOB) == {"OMP_NUM_THREADS": "4"}


def test_ray_address_joins_as_rays_tools_would_but_a_cluster_file_alone_never_does() -> None:
    assert choose_cluster(ClusterConfig(), {"RAY_ADDRESS": "h:1"}).address == "h:1"
    # No address anywhere: embedded, even where `ray start` left /tmp/ray/ray_current_cluster
    # (auto would read it; only cluster.address=auto asks for that).
    for env in ({}, {"RAY_ADDRESS": "auto"}, {"RAY_ADDRESS": "local"}):
        choice = choose_cluster(ClusterConfig(), env)
        assert choice.address is None and not choice.joined, env
        assert "cluster file alone is never joined" in choice.describe()


def test_a_process_already_connected_to_ray_uses_that_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(join, "_ray_connected", lambda: True)
    choice = choose_cluster(ClusterConfig(), {})
    assert choice.attached and choice.joined and choice.address is None
    assert "connected to" in choice.describe()


def test_token_sources_are_where_rays_loader_reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert token_sources({}) == []
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    path = tmp_path / "tok"
    path.write_text("t")
    assert token_sources({"RAY_AUTH_TOKEN": "x", "RAY_AUTH_TOKEN_PATH": str(path)}) == [
        "RAY_AUTH_TOKEN", f"RAY_AUTH_TOKEN_PATH={path}", str(tmp_path / ".ray" / "auth_token"),
    ]


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1:6379") and is_loopback("localhost:1") and is_loopback("[::1]:6379")
    assert not is_loopback("10.0.0.5:6379")


def test_nothing_listening_is_one_line_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        with pytest.raises(ConfigError, match="nothing is listening") as err:
            check_join(address)
    assert str(err.value).startswith(f"cannot join the Ray cluster at {address}:")
    assert "\n" not in str(err.value) and err.value.key == "cluster.address"


def _facts(*nodes: tuple[dict[str, float], dict[str, str]]) -> ClusterFacts:
    return ClusterFacts("h:1", "2.60.0", "3.11.7", [NodeInfo(f"n{i}", r, lab) for i, (r, lab) in enumerate(nodes)])


def _config(*overrides: str):  # noqa: ANN202 - a RunConfig
    return load_config(str(REPO / "examples" / "quickstart.yaml"), ["cluster.address=h:1", *overrides])


def test_a_cluster_with_too_few_cpus_is_refused_naming_the_key_and_both_counts() -> None:
    small = _facts(({"CPU": 1.0}, {}))
    with pytest.raises(ConfigError, match=r"policy's 2 workers x 0.5 CPU need 1 CPU, but the Ray cluster at h:1 has 0.5") as err:
        check_joined_resources(_config("policy.workers=2", "generation.devices_per_worker=1"), _facts(({"CPU": 0.5}, {})))
    assert err.value.key == "policy.workers"
    check_joined_resources(_config(), _facts(({"CPU": 2.0}, {}), ({"CPU": 2.0}, {})))  # fits: nothing raised
    with pytest.raises(ConfigError, match="generation.workers"):
        check_joined_resources(_config("generation.workers=2", "generation.devices_per_worker=1"), small)


def test_a_selector_no_node_matches_is_refused_naming_the_nodes_resources() -> None:
    facts = _facts(({"CPU": 2.0, "node_a": 1.0, "node:10.0.0.1": 1.0}, {}))
    with pytest.raises(ConfigError, match=r"no alive node of the Ray cluster at h:1 has resources \{'node_z': 0.01\}.*\['node_a'\]"):
        check_joined_resources(_config("placement.nodes.policy.resources={node_z: 0.01}"), facts)
    # The selected nodes must hold the role, whatever the rest of the cluster has.
    two = _facts(({"CPU": 1.0, "node_a": 1.0}, {}), ({"CPU": 8.0}, {}))
    with pytest.raises(ConfigError, match="the 1 node\\(s\\) placement.nodes.policy selects has 1"):
        check_joined_resources(
            _config("placement.nodes.policy.resources={node_a: 0.01}", "policy.workers=4"), two
        )


def test_a_gpu_cluster_is_counted_in_gpu_bundles() -> None:
    facts = _facts(({"CPU": 8.0, "GPU": 1.0}, {}))
    with pytest.raises(ConfigError, match="need 2 GPU.*has 1"):
        check_joined_resources(_config("policy.workers=1", "policy.devices_per_worker=1",
                                       "generation.devices_per_worker=1"), facts)


def test_plan_says_which_cluster_and_why(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    monkeypatch.delenv(JOB_CONFIG_ENV, raising=False)
    assert main(["plan", str(REPO / "examples" / "quickstart.yaml")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "cluster: the Ray cluster at 10.0.0.5:6379 (RAY_ADDRESS is set" in out
    assert main(["plan", str(REPO / "examples" / "quickstart.yaml"), "cluster.address=local", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == {
        "address": None, "attached": False, "why": "cluster.address=local",
    }

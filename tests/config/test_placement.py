"""rlcore.config.placement: a role's node selector in Ray's terms, and when a run spans nodes."""

from __future__ import annotations

import pytest

from rlcore.config import load_config
from rlcore.config.placement import Network, NodeInfo, RolePlacement, role_placement, spans_nodes

BASE = ["policy.backend=fsdp", "generation.backend=vllm"]
NODES = [
    NodeInfo("head", {"CPU": 1, "node_head": 1}, {}),
    NodeInfo("a", {"CPU": 2, "node_a": 1}, {"zone": "a"}),
    NodeInfo("b", {"CPU": 2, "node_b": 1}, {"zone": "b"}),
]


def test_role_placement_reads_the_config_in_rays_terms() -> None:
    cfg = load_config(None, [*BASE, "placement.nodes.policy.resources={node_a: 0.01}", "placement.nodes.env.labels={zone: b}"])
    policy, env, gen = (role_placement(cfg, r) for r in ("policy", "env", "generation"))
    assert policy.ray_options() == {"resources": {"node_a": 0.01}}
    assert env.ray_options() == {"label_selector": {"zone": "b"}}
    assert gen.ray_options() == {} and not gen.pinned and policy.pinned


def test_a_selector_matches_nodes_by_resources_and_labels() -> None:
    both = RolePlacement("policy", {"node_a": 0.5}, {"zone": "a"})
    assert [n.node_id for n in NODES if both.matches(n.resources, n.labels)] == ["a"]
    assert not RolePlacement("policy", {"node_a": 2}).matches(NODES[1].resources, NODES[1].labels)
    assert not RolePlacement("env", labels={"zone": "c"}).matches(NODES[2].resources, NODES[2].labels)


def test_a_run_spans_nodes_when_roles_or_the_driver_may_be_apart() -> None:
    on_a = [RolePlacement(r, {"node_a": 0.01}) for r in ("policy", "generation", "env")]
    assert not spans_nodes(on_a, NODES, driver_node="a")  # everything on the driver's node
    assert spans_nodes(on_a, NODES, driver_node="head")  # the driver reads from elsewhere
    apart = [RolePlacement("policy", {"node_a": 0.01}), RolePlacement("generation", {"node_b": 0.01})]
    assert spans_nodes(apart, NODES, driver_node="a")
    unpinned = [RolePlacement("policy")]
    assert spans_nodes(unpinned, NODES, driver_node="head")  # Ray may put it anywhere
    assert not spans_nodes(unpinned, NODES[:1], driver_node="head")  # one node: never


def test_a_network_across_nodes_has_a_token_and_one_on_a_node_none() -> None:
    spread, local = Network.spread(), Network()
    assert spread.readers_elsewhere and len(spread.token or "") >= 32
    assert Network.spread().token != spread.token  # per run
    assert spread.auth_headers() == {"Authorization": f"Bearer {spread.token}"}
    assert local.auth_headers() == {} and local.server_env() == {}
    with pytest.raises(ValueError, match="token"):
        Network(readers_elsewhere=True)


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        (["placement.nodes.policy.resources={node_a: 0.01}"], "placement.nodes.policy", "cluster.address"),
        (["cluster.address=auto", "placement.nodes.env.labels={zone: a}"], "placement.nodes.env", "env.backend"),
        (["cluster.address=auto", "placement.nodes.generation.resources={GPU: 1}"],
         "placement.nodes.generation.resources.GPU", "devices_per_worker"),
        (["cluster.address=auto", "placement.nodes.policy.labels={zone: ''}"], "placement.nodes.policy.labels", "empty"),
        (["cluster.address=auto", "placement.colocated=true", "placement.nodes.policy.resources={node_a: 1}"],
         "placement.nodes.generation", "colocated"),
    ],
    ids=["embedded-cluster", "env-without-backend", "reserved-resource", "empty-label", "colocated-apart"],
)
def test_bad_placement_is_one_line_naming_the_key(overrides: list[str], key: str, text: str) -> None:
    from rlcore.errors import ConfigError
    from rlcore.setup.preflight import check_placement

    with pytest.raises(ConfigError) as err:
        check_placement(load_config(None, [*BASE, *overrides]))
    assert err.value.key == key and text in str(err.value) and "\n" not in str(err.value)


def test_good_placement_passes_preflight() -> None:
    from rlcore.setup.preflight import check_placement

    check_placement(load_config(None, [
        *BASE, "env.backend=arithmetic", "cluster.address=auto",
        "placement.nodes.policy.resources={node_a: 0.01, 'node:192.0.2.2': 0.01}",
        "placement.nodes.env.labels={zone: c}",
    ]))

"""rlcore run on a Ray cluster of several nodes that it joins by address (issue 14, item 1).

A four-node Ray cluster (a head and nodes a, b, c, each with its own custom resource and
label) runs on this machine as Ray's own ``ray.cluster_utils.Cluster`` starts it. The
quickstart job joins it by ``cluster.address`` with the policy placed by resource on
node a, the generation (vLLM behind its OpenAI-compatible server) by label on node b and
the env by resource on node c; the run's ``placement.json`` (node ids the workers report)
must show each role where the config put it, the refit rendezvous on the policy's node
address, and the servers exposed with a token. While it runs, the sockets of the run's
workers are sampled: none listens on every interface, and the vLLM server listens on the
node's address and answers 401 to a request without the run's token (the run's own
requests carry it, or the run would fail). After the run the cluster and its four nodes
must still be alive and serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from rlcore.testing.fixtures import listening_sockets
from rlcore.testing.waits import wait_for

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")

REPO = Path(__file__).resolve().parents[2]
RLCORE = Path(sys.executable).with_name("rlcore")
NODES = ("a", "b", "c")
LABEL = "rlcore-test-node"
#: Processes of the run whose sockets are sampled (Ray names actors' processes ray::<Class>).
WORKERS = ("ray::FSDPWorker", "ray::VLLMWorker", "ray::EnvWorker", "vllm.entrypoints.openai.api_server")
WILDCARD = {"0.0.0.0", "::"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # num_cpus above the 2 physical cores: Ray counts, it does not pin.
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_head": 1}})
    try:
        for n in NODES:
            made.add_node(num_cpus=2, resources={f"node_{n}": 1}, labels={LABEL: n})
        made.wait_for_nodes()
        yield made
    finally:
        made.shutdown()


_NODES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], include_dashboard=False, logging_level="ERROR")
keys = ("NodeID", "Alive", "NodeManagerAddress", "Resources", "Labels")
print(json.dumps([{k: n[k] for k in keys} for n in ray.nodes()]))
"""

_SERVE_SCRIPT = """
import sys, ray
ray.init(address=sys.argv[1], include_dashboard=False, logging_level="ERROR")
where = ray.remote(lambda: ray.get_runtime_context().get_node_id())
refs = [where.options(num_cpus=0, resources={"node_" + n: 0.01}).remote() for n in sys.argv[2:]]
print(" ".join(ray.get(refs, timeout=120)))
"""


def _driver(script: str, *args: str) -> str:
    """The last line a separate Ray driver prints (connected to the cluster under test)."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=180, check=True)
    return out.stdout.strip().splitlines()[-1]


def _sample_workers(seen: dict[tuple[str, int], str]) -> None:
    """Record the listening sockets of the run's worker processes (and vLLM's server)."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            kind = next((w for w in WORKERS if w in cmd), None)
            if kind is not None:
                for ip, port, _ in listening_sockets(p, udp=False):
                    seen.setdefault((ip, port), kind)
        except psutil.Error:
            continue  # exited meanwhile


def _run_processes() -> list[str]:
    """Processes of the run's workers (and vLLM's server) still running on this host."""
    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(w in cmd for w in WORKERS):
                left.append(f"{p.pid}: {cmd[:80]}")
        except psutil.Error:
            continue
    return left


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:  # not serving yet (or gone): asked again at the next sample
        return -1


def _nodes(address: str) -> list[dict[str, Any]]:
    """The cluster's nodes as a separate driver sees them (``ray.nodes()``)."""
    return json.loads(_driver(_NODES_SCRIPT, address))


def _serves_on_every_node(address: str) -> list[str]:
    """Run one task pinned to each of nodes a, b, c; the node ids they ran on."""
    return _driver(_SERVE_SCRIPT, address, *NODES).split()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_roles_run_on_the_nodes_the_config_picks_and_the_cluster_survives(cluster: Any, tmp_path: Path) -> None:
    before = {n["NodeID"] for n in _nodes(cluster.address) if n["Alive"]}
    assert len(before) == 4
    run_dir = tmp_path / "run"
    argv = [
        str(RLCORE), "run", str(REPO / "examples" / "quickstart.yaml"), "grpo.steps=2",
        f"cluster.address={cluster.address}", "cluster.num_cpus=null",
        "placement.nodes.policy.resources={node_a: 0.01}",
        f"placement.nodes.generation.labels={{{LABEL}: b}}",
        "placement.nodes.env.resources={node_c: 0.01}", "generation.options.serve_openai=true",
        f"setup.cache_dir={tmp_path / 'cache'}", "--out", str(run_dir),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    seen: dict[tuple[str, int], str] = {}
    unauthorized: dict[tuple[str, int], int] = {}  # the vLLM server's answer without a token
    try:
        deadline = time.monotonic() + 800
        while proc.poll() is None and time.monotonic() < deadline:
            _sample_workers(seen)
            for (ip, port), kind in seen.items():
                if kind.startswith("vllm") and unauthorized.get((ip, port), -1) == -1:
                    unauthorized[(ip, port)] = _status(f"http://{ip}:{port}/v1/models")
            time.sleep(0.2)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-4000:]

    nodes = {n["NodeID"]: n for n in _nodes(cluster.address)}
    by_name = {n: next(i for i, v in nodes.items() if f"node_{n}" in v["Resources"]) for n in NODES}
    placed = json.loads((run_dir / "placement.json").read_text())
    where = {g["role"]: set(g["nodes"]) for g in placed["groups"]}
    assert where == {"policy": {by_name["a"]}, "generation": {by_name["b"]}, "env": {by_name["c"]}}, placed
    assert nodes[by_name["b"]]["Labels"][LABEL] == "b"
    assert len({g["group"] for g in placed["groups"]}) == 3
    # The refit channel meets at the policy rank 0's node address, not an assumed loopback.
    assert placed["refit"]["transport"] == "collective"
    assert placed["refit"]["addr"] == nodes[by_name["a"]]["NodeManagerAddress"]
    assert not placed["refit"]["addr"].startswith("127.")
    assert placed["readers_elsewhere"] is True
    # What rlcore binds listens on node addresses, never on every interface (Ray's own
    # worker ports on a joined cluster are Ray's choice): the refit store on the policy's...
    print("listening sockets of the run's workers:", sorted(seen.items()))
    kinds = set(seen.values())
    assert {"ray::FSDPWorker", "vllm.entrypoints.openai.api_server"} <= kinds, seen
    refit_port = placed["refit"]["port"]
    assert seen.get((placed["refit"]["addr"], refit_port)) == "ray::FSDPWorker", seen
    assert not [ip for ip, port in seen if port == refit_port and ip != placed["refit"]["addr"]], seen
    # ... and vLLM's server on the generation's node, guarded.
    node_b = nodes[by_name["b"]]["NodeManagerAddress"]
    assert not [sock for sock, k in seen.items() if k.startswith("vllm") and sock[0] in WILDCARD], seen
    served = {sock for sock, k in seen.items() if k.startswith("vllm")}
    assert served and all(ip == node_b for ip, _ in served), served
    assert unauthorized and set(unauthorized.values()) == {401}, unauthorized
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("step", 0) for m in metrics) >= 1

    # Only the run's own actors went: none of its processes is left, and every node is
    # alive and runs work.
    assert wait_for(lambda: not _run_processes(), timeout_s=15, step_s=0.2), _run_processes()
    after = {i for i, n in nodes.items() if n["Alive"]}
    assert after == before
    assert _serves_on_every_node(cluster.address) == [by_name[n] for n in NODES]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["placement.nodes.policy.resources={node_z: 0.01}"], ["placement.nodes.policy", "node_z", "node_a"]),
        # Node a has 2 CPUs: 3 ranks of 1 CPU never fit there, whatever the cluster's total.
        (["placement.nodes.policy.resources={node_a: 0.01}", "policy.workers=3", "policy.devices_per_worker=1"],
         ["3 workers x 1 CPU", "the 1 node(s) placement.nodes.policy selects has 2"]),
    ],
    ids=["no-node-matches", "selected-nodes-too-small"],
)
def test_a_placement_that_cannot_hold_the_role_fails_at_once_naming_the_key(
    cluster: Any, tmp_path: Path, overrides: list[str], expected: list[str]
) -> None:
    argv = [
        str(RLCORE), "run", str(REPO / "examples" / "quickstart.yaml"), "grpo.steps=1",
        f"cluster.address={cluster.address}", "cluster.num_cpus=null", *overrides,
        f"setup.cache_dir={tmp_path / 'cache'}", "--out", str(tmp_path / "run"),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=280)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    flat = " ".join(output.split())  # the console wraps long lines
    assert all(e in flat for e in expected), output[-3000:]
    assert len([n for n in _nodes(cluster.address) if n["Alive"]]) == 4

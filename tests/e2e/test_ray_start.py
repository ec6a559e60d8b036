"""rlcore on a Ray cluster started the way operators start one (issue 32).

One head and one worker node run as Ray's own ``ray start --block`` processes on
127.0.0.1 (Ray's single-host switch, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; the worker
nodes through ``python -m rlcore.runtime.join``, as docs/ray-cluster.md says), each with
its own custom resource, with Ray's token authentication on: the token is made by
``ray get-auth-token --generate`` in a home directory of the test's own, so the head
turns token authentication on by itself, as it does on an operator's machine where a
token exists, and the run is given the token only the way Ray's CLI finds it there.
The head is shared by every test of the module and stopped at its end (each ``ray
start --block`` process is SIGTERMed by its pid and stops its node; anything of the node
still there 20 s later is SIGKILLed).

The runs: one joined by address with the policy placed on the worker node by resource,
and the same job submitted with ``ray job submit`` (Ray sets ``RAY_ADDRESS`` for its
driver), its working directory a runtime environment the run's actors must get. Each
way a join fails ends with one ``error:`` line, exit code 2, before ``--out`` exists.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from ray_cli import LOOPBACK, RAY, REPO, RLCORE, alive_nodes, home_env

from rlcore.runtime.addresses import free_port
from rlcore.testing.fixtures import listening_sockets
from rlcore.testing.waits import wait_for

pytest.importorskip("rlcore_fsdp")



@dataclass
class Head:
    address: str  # the GCS, host:port
    dashboard: str  # the job server, http://host:port
    env: dict[str, str]  # what a process on this "machine" has (HOME with the token)
    tmp: Path
    procs: list[subprocess.Popen[bytes]]  # the `ray start --block` processes
    ray_dir: Path  # Ray's --temp-dir: short, its sockets' paths must stay under 108 bytes


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket's view
    return (mapped or addr).is_loopback


def _listening_beyond_loopback(head: Head) -> list[tuple[str, str, int]]:
    """Sockets of the nodes' processes (GCS, raylets, agents, workers) listening elsewhere than 127.0.0.1."""
    out = []
    for p in head.procs:
        with contextlib.suppress(psutil.Error):
            for proc in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    out += [(proc.name(), ip, port) for ip, port, _ in listening_sockets(proc, udp=False) if not _loopback(ip)]
    return out


def _start(args: list[str], env: dict[str, str], log: Path, *, worker: bool = False) -> subprocess.Popen[bytes]:
    # A worker node beside a head on loopback: Ray's CLI refuses it or moves it off
    # loopback; `python -m rlcore.runtime.join` is `ray start` without either (docs/ray-cluster.md).
    cli = [sys.executable, "-m", "rlcore.runtime.join"] if worker else [str(RAY), "start"]
    if worker:
        # A worker node's `ray start` turns token authentication on only when told to
        # (unlike the head's, it does not look for a token by itself).
        env = {**env, "RAY_AUTH_MODE": "token"}
    with log.open("wb") as out:
        return subprocess.Popen([*cli, "--block", *args], env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each ``ray start --block`` (it stops its node), then SIGKILL what is left."""
    family: list[psutil.Process] = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            family += [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    for p in reversed(procs):  # worker nodes before the head
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=20)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    for p in procs:
        p.wait(timeout=5)


def _nodes_alive(env: dict[str, str], address: str, count: int) -> bool:
    return alive_nodes(env, address) == count


def _alive(env: dict[str, str], address: str) -> int:
    """How many nodes of the cluster are alive."""
    count = alive_nodes(env, address)
    assert count is not None, f"the GCS at {address} did not answer"
    return count


def _up(proc: subprocess.Popen[bytes], env: dict[str, str], address: str, nodes: int) -> bool:
    """Whether the node ``proc`` starts is up (``nodes`` alive), within 3 minutes; False once it has exited."""
    wait_for(lambda: proc.poll() is not None or _nodes_alive(env, address, nodes), timeout_s=180, step_s=1)
    return proc.poll() is None and _nodes_alive(env, address, nodes)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    tmp = tmp_path_factory.mktemp("raystart")
    env = home_env(tmp / "home", token=True, pythonpath=True)
    port, dash = free_port(), free_port()
    address = f"{LOOPBACK}:{port}"
    # Not under tmp: pytest's base temp can be long enough to push Ray's AF_UNIX socket paths
    # (<temp-dir>/session_<date>_<pid>/sockets/dash_MetricsHead) past 107 bytes.
    ray_dir = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    common = ["--node-ip-address", LOOPBACK, "--disable-usage-stats"]
    procs = [_start([
        "--head", "--port", str(port), "--num-cpus", "2", "--resources", '{"node_head": 1}',
        "--include-dashboard", "true", "--dashboard-host", LOOPBACK, "--dashboard-port", str(dash), *common,
        "--temp-dir", str(ray_dir / "head"),
    ], env, tmp / "head.log")]
    try:
        assert _up(procs[0], env, address, 1), (tmp / "head.log").read_text()
        procs.append(_start(
            # Each node its own --temp-dir, as each machine of a real cluster has its own /tmp:
            # nodes sharing one have their runtime-env agents delete each other's working
            # directories (a job's driver then lost its cwd, and MKL could not load libtorch).
            ["--address", address, "--num-cpus", "2", "--resources", '{"node_a": 1}', *common,
             "--temp-dir", str(ray_dir / "a")], env, tmp / "a.log",
            worker=True,
        ))
        assert _up(procs[1], env, address, 2), (tmp / "a.log").read_text()
        yield Head(address, f"http://{LOOPBACK}:{dash}", env, tmp, procs, ray_dir)
    finally:
        _stop(procs)
        shutil.rmtree(ray_dir, ignore_errors=True)


def _rlcore(
    head: Head, tmp: Path, *overrides: str, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    argv = [
        str(RLCORE), "run", str(REPO / "examples" / "quickstart.yaml"), "grpo.steps=1",
        f"setup.cache_dir={tmp / 'cache'}", *overrides, "--out", str(tmp / "run"),
    ]
    return subprocess.run(argv, env=env or head.env, capture_output=True, text=True, cwd=cwd, timeout=500)


def _flat(proc: subprocess.CompletedProcess[str]) -> str:
    return " ".join((proc.stdout + proc.stderr).split())  # the console wraps long lines


def _node_of(head: Head, resource: str) -> str:
    code = (
        "import sys; from ray._raylet import GcsClient; "
        "g = GcsClient(address=sys.argv[1]); "
        "print([k.hex() for k, n in g.get_all_node_info(timeout=5).items() if sys.argv[2] in n.resources_total][0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, head.address, resource], env={**head.env, "RAY_AUTH_MODE": "token"},
        capture_output=True, text=True, timeout=60, check=True,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ray_start_cluster_is_joined_with_the_token_ray_finds_and_roles_placed_by_node(head: Head, tmp_path: Path) -> None:
    # Nothing but the token in ~/.ray/auth_token, as `ray start` left it: no RAY_AUTH_MODE.
    proc = _rlcore(head, tmp_path, f"cluster.address={head.address}", "placement.nodes.policy.resources={node_a: 0.01}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"cluster: the Ray cluster at {head.address} (cluster.address)" in _flat(proc)
    placed = json.loads((tmp_path / "run" / "placement.json").read_text())
    where = {g["role"]: set(g["nodes"]) for g in placed["groups"]}
    assert where["policy"] == {_node_of(head, "node_a")}, placed
    assert _nodes_alive(head.env, head.address, 2)  # the run's end leaves the cluster up
    assert not _listening_beyond_loopback(head)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_submit_runs_on_the_cluster_it_was_submitted_to(head: Head, tmp_path: Path) -> None:
    # The job's working directory is a runtime environment the run's actors must get
    # (a nested cluster could not fetch it: RuntimeEnvSetupError).
    work = tmp_path / "job"
    work.mkdir()
    (work / "quickstart.yaml").write_text((REPO / "examples" / "quickstart.yaml").read_text())
    out = tmp_path / "run"
    argv = [
        str(RAY), "job", "submit", "--address", head.dashboard, "--working-dir", str(work), "--",
        str(RLCORE), "run", "quickstart.yaml", "grpo.steps=1", f"setup.cache_dir={tmp_path / 'cache'}",
        "--out", str(out),
    ]
    # `ray job submit` wants RAY_AUTH_MODE=token to send the token (Ray's CLI, not rlcore).
    env = {**head.env, "RAY_AUTH_MODE": "token"}
    for _ in range(30):  # the head's job agent registers a little after the node is up
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=550)
        if "No available agent to submit job" not in proc.stderr:
            break
        time.sleep(2)
    flat = _flat(proc)
    assert proc.returncode == 0, flat[-4000:]
    assert f"cluster: the Ray cluster at {head.address} (this is the driver of a Ray job" in flat, flat[-4000:]
    assert "Started a local Ray instance" not in flat
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("step", 0) for m in metrics) >= 1
    heads = {_node_of(head, "node_head"), _node_of(head, "node_a")}
    placed = json.loads((out / "placement.json").read_text())
    assert {n for g in placed["groups"] for n in g["nodes"]} <= heads, placed


def _refused(proc: subprocess.CompletedProcess[str], out: Path, *expected: str) -> None:
    """Exit code 2, one ``error:`` line with ``expected`` in it, and no ``--out``."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    flat = " ".join(proc.stderr.split())
    assert all(e in flat for e in expected), flat
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nothing_listening_is_refused_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    address = f"{LOOPBACK}:{free_port()}"
    fake = Head(address, "", env, tmp_path, [], tmp_path)
    _refused(_rlcore(fake, tmp_path, f"cluster.address={address}"), tmp_path / "run", address, "nothing is listening")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"HOME": "{tmp}"}, ["this machine has no token", "ray get-auth-token"]),
        ({"RAY_AUTH_TOKEN": "not-the-token"}, ["refused this machine's token (from RAY_AUTH_TOKEN)"]),
    ],
    ids=["no-token", "wrong-token"],
)
def test_a_token_the_cluster_refuses_is_refused_in_one_line(
    head: Head, tmp_path: Path, change: dict[str, str], expected: list[str]
) -> None:
    env = {**head.env, **{k: v.format(tmp=tmp_path) for k, v in change.items()}}
    proc = _rlcore(head, tmp_path, f"cluster.address={head.address}", env=env)
    _refused(proc, tmp_path / "run", head.address, *expected)


_SET_VERSION = """
import json, sys
from ray._raylet import GcsClient
g = GcsClient(address=sys.argv[1])
meta = json.loads(g.internal_kv_get(b"CLUSTER_METADATA", namespace=b"cluster", timeout=5))
print(json.dumps(meta))
meta["ray_version"] = sys.argv[2]
g.internal_kv_put(b"CLUSTER_METADATA", json.dumps(meta).encode(), True, namespace=b"cluster", timeout=5)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cluster_of_another_ray_version_is_refused_in_one_line(head: Head, tmp_path: Path) -> None:
    import ray

    def set_version(version: str) -> None:
        subprocess.run(
            [sys.executable, "-c", _SET_VERSION, head.address, version], env={**head.env, "RAY_AUTH_MODE": "token"},
            capture_output=True, text=True, timeout=60, check=True,
        )

    # What the head's GCS tells every driver about its versions (set by `ray start`).
    set_version("2.59.0")
    try:
        proc = _rlcore(head, tmp_path, f"cluster.address={head.address}")
    finally:
        set_version(ray.__version__)
    _refused(proc, tmp_path / "run", head.address, "runs Ray 2.59.0", f"this driver Ray {ray.__version__}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["policy.workers=3", "policy.devices_per_worker=2"], ["policy.workers", "need 6 CPU", "has 4"]),
        (["placement.nodes.policy.resources={node_z: 0.01}"], ["placement.nodes.policy", "node_z", "node_a"]),
    ],
    ids=["too-few-cpus", "no-node-matches"],
)
def test_too_few_resources_are_refused_in_one_line(
    head: Head, tmp_path: Path, overrides: list[str], expected: list[str]
) -> None:
    proc = _rlcore(head, tmp_path, f"cluster.address={head.address}", *overrides)
    _refused(proc, tmp_path / "run", head.address, *expected)


@pytest.fixture(scope="module")
def node_b(head: Head, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second worker node (resource node_b) whose Python differs from the driver's: its
    rlcore_vllm cannot be imported (vLLM missing there) and its rlcore-fsdp is another
    version. Started last: a role left unpinned may land on it, so the tests that use it
    come last in the module."""
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / "rlcore_vllm").mkdir()
    (shadow / "rlcore_vllm" / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'vllm\'", name="vllm")\n')
    dist = shadow / "rlcore_fsdp-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlcore-fsdp\nVersion: 0.0.1\n")
    env = {**head.env, "PYTHONPATH": f"{shadow}:{head.env.get('PYTHONPATH', '')}"}
    args = ["--address", head.address, "--num-cpus", "2", "--resources", '{"node_b": 1}',
            "--node-ip-address", LOOPBACK, "--temp-dir", str(head.ray_dir / "b"), "--disable-usage-stats"]
    proc = _start(args, env, head.tmp / "b.log", worker=True)
    try:
        assert _up(proc, head.env, head.address, 3), (head.tmp / "b.log").read_text()
        yield _node_of(head, "node_b")
    finally:
        _stop([proc])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # The policy elsewhere: the first difference found is the generation's.
        (["placement.nodes.policy.resources={node_a: 0.01}", "placement.nodes.generation.resources={node_b: 0.01}"], ["where generation may run, cannot import rlcore_vllm.plugin of generation's backend vllm "
                        "(distribution rlcore-vllm): ModuleNotFoundError: No module named 'vllm'"]),
        (["placement.nodes.policy.resources={node_b: 0.01}"], ["where policy may run, has policy's backend fsdp (distribution rlcore-fsdp) 0.0.1, the driver 0.1.0"]),
    ],
    ids=["cannot-import", "other-version"],
)
def test_a_node_without_the_roles_backend_is_refused_naming_node_backend_and_versions(
    head: Head, node_b: str, tmp_path: Path, overrides: list[str], expected: list[str]
) -> None:
    proc = _rlcore(head, tmp_path, f"cluster.address={head.address}", *overrides)
    _refused(proc, tmp_path / "run", head.address, f"node {node_b[:12]} (127.0.0.1)", *expected)


@pytest.fixture
def node_c(head: Head, tmp_path: Path) -> Iterator[str]:
    """A worker node (resource node_c) whose installed rlcore is another version (0.0.1)
    than the driver's; stopped at the end of its test."""
    site = tmp_path / "site"
    dist = site / "rlcore-0.0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlcore\nVersion: 0.0.1\n")
    env = {**head.env, "PYTHONPATH": f"{site}:{head.env.get('PYTHONPATH', '')}"}
    args = ["--address", head.address, "--num-cpus", "2", "--resources", '{"node_c": 1}',
            "--node-ip-address", LOOPBACK, "--temp-dir", str(head.ray_dir / "c"), "--disable-usage-stats"]
    nodes = _alive(head.env, head.address) + 1
    proc = _start(args, env, head.tmp / "c.log", worker=True)
    try:
        assert _up(proc, head.env, head.address, nodes), (head.tmp / "c.log").read_text()
        yield _node_of(head, "node_c")
    finally:
        _stop([proc])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_with_another_rlcore_is_refused_when_the_driver_runs_from_a_checkout(
    head: Head, node_c: str, tmp_path: Path
) -> None:
    # The driver runs from a checkout whose metadata says the driver's version: Ray puts the
    # driver's working directory first on every worker's sys.path, and node c read it there
    # instead of its own install (issue 48): it passed.
    from importlib import metadata

    version = metadata.version("rlcore")
    checkout = tmp_path / "checkout"
    (checkout / "rlcore.egg-info").mkdir(parents=True)
    (checkout / "rlcore.egg-info" / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: rlcore\nVersion: {version}\n")
    proc = _rlcore(
        head, tmp_path, f"cluster.address={head.address}", "placement.nodes.policy.resources={node_c: 0.01}",
        "placement.nodes.generation.resources={node_a: 0.01}", "placement.nodes.env.resources={node_a: 0.01}",
        cwd=checkout,
    )
    _refused(proc, tmp_path / "run", head.address, f"node {node_c[:12]} (127.0.0.1) has rlcore 0.0.1, the driver {version}")

"""docs/ray-cluster.md's commands for several nodes on one host, run as written (issue 48, item 7).

The doc's fenced blocks marked ``bash single-host`` are pasted, in order, into one bash
shell in the checkout, as an operator would: the first makes a head and node a on
127.0.0.1 (the token made in a home directory of the test's own), the second joins the
cluster with ``rlcore run ... cluster.address=...`` and submits the same run with ``ray job
submit``, the third stops the two nodes by their pids. Only the ports and the nodes'
directory are the test's own, given as the variables the doc's first block reads
(``PORT``, ``DASH_PORT``, ``CLIENT_PORT``, ``NODES``). Between the blocks the test checks
that the cluster has its two nodes, that they listen on loopback only, that both runs
joined it and finished with the policy on node a, and at the end that no process of the
two nodes is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ray_cli import still_running

from rlcore.runtime.addresses import free_port
from rlcore.testing.fixtures import listening_sockets
from rlcore.testing.waits import wait_for

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ray-cluster.md"
BIN = Path(sys.executable).parent
BLOCK = re.compile(r"^```bash single-host\n(.*?)^```$", re.S | re.M)


def single_host_blocks() -> list[str]:
    """The doc's blocks marked ``bash single-host``, in order."""
    return BLOCK.findall(DOC.read_text())


class Shell:
    """One bash process that is given the blocks one after another, as pasted into a terminal."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            ["bash"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env, cwd=cwd, start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, block: str, timeout_s: float) -> str:
        """Everything the block printed, once its last command has returned."""
        assert self.proc.stdin is not None
        marker = f"@@block-done-{time.monotonic_ns()}"
        self.proc.stdin.write(f"{block}\necho {marker}\n")
        self.proc.stdin.flush()
        out: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the block did not finish in {timeout_s:.0f} s:\n{''.join(out)[-4000:]}") from None
            if line is None:
                raise AssertionError(f"the shell exited:\n{''.join(out)[-4000:]}")
            if line.strip() == marker:
                return "".join(out)
            out.append(line)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


_NODES_SCRIPT = """
import json, sys
from ray._raylet import GcsClient
nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5)
print(json.dumps({k.hex(): sorted(n.resources_total) for k, n in nodes.items() if n.state == 0}))
"""


def _alive_nodes(env: dict[str, str], address: str) -> dict[str, list[str]]:
    """The cluster's alive nodes: id -> names of its resources (asked of the GCS with the token)."""
    out = subprocess.run(
        [sys.executable, "-c", _NODES_SCRIPT, address], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _family(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants that are alive now."""
    out: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(pid)
            out += [top, *top.children(recursive=True)]
    return out


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def _listening_beyond_loopback(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            out += [(p.name(), ip, port) for ip, port, _ in listening_sockets(p, udp=False) if not _loopback(ip)]
    return out




def _mentioning(text: str) -> list[str]:
    """Processes on this host whose command line names ``text`` (the nodes' directory)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.info["cmdline"] or [])
            if text in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid}: {cmd[:100]}")
    return out


def _kill(procs: list[psutil.Process]) -> None:
    """Whatever of the test's own nodes is still there, if the doc's stop did not run."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


@pytest.fixture
def nodes_dir() -> Iterator[Path]:
    # Not under pytest's base temp: Ray's socket paths under --temp-dir must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="sh", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_docs_single_host_commands_make_join_and_stop_a_two_node_cluster(tmp_path: Path, nodes_dir: Path) -> None:
    blocks = single_host_blocks()
    assert len(blocks) == 3, blocks  # start, run, stop
    start, run, stop = blocks
    home = tmp_path / "home"
    home.mkdir()
    port, dash = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_ENABLE_WINDOWS"))}
    env.update({
        "HOME": str(home), "PATH": f"{BIN}:{env.get('PATH', '')}", "PORT": str(port), "DASH_PORT": str(dash),
        "CLIENT_PORT": str(free_port()), "NODES": str(nodes_dir),
    })
    address = f"127.0.0.1:{port}"
    ask = {**env, "RAY_AUTH_MODE": "token"}  # what the doc's shell has for Ray's CLI
    shell = Shell(env, REPO)
    pids: list[int] = []
    try:
        t0 = time.monotonic()
        out = shell.run(start, timeout_s=300)
        pids = [int((nodes_dir / f"{n}.pid").read_text()) for n in ("head", "a")]
        print(f"two nodes up in {time.monotonic() - t0:.1f}s")
        nodes = _alive_nodes(ask, address)
        assert len(nodes) == 2, (out, nodes)
        node_a = next(i for i, res in nodes.items() if "node_a" in res)
        assert not _listening_beyond_loopback(_family(pids))

        t0 = time.monotonic()
        out = shell.run(run, timeout_s=800)
        print(f"the run and the job in {time.monotonic() - t0:.1f}s")
        flat = " ".join(out.split())  # the console wraps long lines
        assert f"cluster: the Ray cluster at {address} (cluster.address)" in flat, out[-4000:]
        assert f"cluster: the Ray cluster at {address} (this is the driver of a Ray job" in flat, out[-4000:]
        assert re.search(r"Job '\S+' succeeded", flat), out[-4000:]
        for name in ("run", "job"):
            metrics = [json.loads(line) for line in (nodes_dir / name / "metrics.jsonl").read_text().splitlines()]
            assert max(m.get("step", 0) for m in metrics) == 2, (name, metrics)
        placed = json.loads((nodes_dir / "run" / "placement.json").read_text())
        assert {n for g in placed["groups"] if g["role"] == "policy" for n in g["nodes"]} == {node_a}, placed
        assert len(_alive_nodes(ask, address)) == 2  # the runs leave the cluster up

        family = _family(pids)
        t0 = time.monotonic()
        shell.run(stop, timeout_s=120)
        print(f"stopped in {time.monotonic() - t0:.1f}s ({len(family)} processes)")
        assert wait_for(lambda: not still_running(family), timeout_s=15, step_s=0.2), still_running(family)
        assert not _mentioning(str(nodes_dir)), _mentioning(str(nodes_dir))
    finally:
        shell.close()
        _kill(_family(pids))
        for log in sorted(nodes_dir.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-2000:]}")

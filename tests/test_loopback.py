"""No listener beyond loopback on a single host (issue 12, item 3).

A real quickstart run (FSDP policy, vLLM generation, arithmetic env on the
embedded Ray cluster) is started with ``.venv/bin/rlcore run``; while it runs,
the sockets of every process of its tree (Ray's GCS, raylet and agents, the
worker actors, vLLM inside them, the driver) are sampled. Each TCP socket that
listens, and each UDP socket that is bound, must be on 127.0.0.1 or ::1.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
RLCORE = Path(sys.executable).with_name("rlcore")
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")


def _listening(proc: psutil.Process) -> list[tuple[str, int, str]]:
    """(ip, port, kind) of the TCP sockets ``proc`` listens on and the UDP ones it bound."""
    out = []
    for c in proc.net_connections("inet"):
        if not c.laddr:
            continue
        if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
            out.append((c.laddr.ip, c.laddr.port, "tcp"))
        elif c.type == socket.SOCK_DGRAM and not c.raddr:
            out.append((c.laddr.ip, c.laddr.port, "udp"))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_socket_of_a_quickstart_run_is_on_loopback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [str(RLCORE), "run", str(REPO / "examples" / "quickstart.yaml"), "grpo.steps=2", "--out", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )
    seen: dict[tuple[str, int, str], str] = {}  # socket -> the process that had it
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    for sock in _listening(p):
                        seen.setdefault(sock, p.name())
                except psutil.Error:
                    pass  # exited meanwhile
            time.sleep(0.1)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    owners = set(seen.values())
    # The sample saw the run's servers, so the check below is not vacuous.
    for expected in ("gcs_server", "raylet"):
        assert expected in owners, sorted(owners)
    assert any("FSDPWorker" in o for o in owners) and any("VLLMWorker" in o for o in owners), sorted(owners)
    outside = sorted(f"{owner}: {ip}:{port}/{kind}" for (ip, port, kind), owner in seen.items() if ip not in LOOPBACK)
    assert not outside, f"sockets reachable from other hosts: {outside}"

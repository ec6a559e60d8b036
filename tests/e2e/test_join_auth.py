"""Joining a Ray cluster that runs without token authentication from a machine that has a
Ray token (issue 48, item 5).

Ray writes ``~/.ray/auth_token`` the first time a local cluster starts, so an operator's
machine often has one; a head started on another machine (here: another home directory)
without a token runs with authentication off. rlcore used to turn token authentication on
in its driver whenever a token existed, and then every actor of the run died before it
started. The test controls the token's presence with ``HOME`` (never the machine's own):
the head's home has none, the driver's has one, made by ``ray get-auth-token --generate``.
tests/e2e/test_ray_start.py covers the other way round (a head with token authentication,
joined with the token).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_cli import LOOPBACK, RAY, REPO, RLCORE, home_env

from rlcore.runtime.addresses import free_port
from rlcore.testing.waits import wait_for

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")



def _home(tmp: Path, name: str) -> dict[str, str]:
    return home_env(tmp / name)


def _node_up(env: dict[str, str], address: str) -> bool:
    """Whether the head's node is alive with its CPUs (the GCS answers before its raylet registers)."""
    code = (
        "import sys; from ray._raylet import GcsClient; "
        "nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5).values(); "
        "sys.exit(0 if any(n.state == 0 and n.resources_total.get('CPU', 0) > 0 for n in nodes) else 1)"
    )
    done = subprocess.run([sys.executable, "-c", code, address], env=env, capture_output=True, timeout=60)
    return done.returncode == 0


@pytest.fixture(scope="module")
def open_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A ``ray start --head --block`` without token authentication (its home holds no token)."""
    tmp = tmp_path_factory.mktemp("openhead")
    env = _home(tmp, "head-home")
    address = f"{LOOPBACK}:{free_port()}"
    ray_dir = Path(tempfile.mkdtemp(prefix="oh", dir="/tmp"))
    log = tmp / "head.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(RAY), "start", "--head", "--block", "--port", address.rsplit(":", 1)[1], "--num-cpus", "2",
             "--node-ip-address", LOOPBACK, "--include-dashboard", "false", "--disable-usage-stats",
             "--temp-dir", str(ray_dir)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: proc.poll() is not None or _node_up(env, address), timeout_s=180, step_s=1)
        assert proc.poll() is None, log.read_text()
        yield address, tmp
    finally:
        from test_ray_start import _stop  # the same stop as the token-authenticated head's

        _stop([proc])
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_a_cluster_without_token_authentication_is_joined_from_a_machine_with_a_token(
    open_head: tuple[str, Path],
) -> None:
    address, tmp = open_head
    driver = _home(tmp, "driver-home")
    subprocess.run([str(RAY), "get-auth-token", "--generate"], env=driver, capture_output=True, check=True, timeout=60)
    assert (Path(driver["HOME"]) / ".ray" / "auth_token").is_file()
    done = subprocess.run(
        [str(RLCORE), "run", str(REPO / "examples" / "quickstart.yaml"), "grpo.steps=1", f"cluster.address={address}",
         f"setup.cache_dir={tmp / 'cache'}", "--out", str(tmp / "run")],
        env=driver, capture_output=True, text=True, cwd=REPO, timeout=500,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (tmp / "run" / "metrics.jsonl").read_text().count('"reward/mean"') == 1

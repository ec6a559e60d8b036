"""What a node must have for the roles that may land on it (issue 32): the answer a node
gives and its comparison with the driver's, read from each node's own install even where
the driver runs from a checkout (issue 48). Real nodes: ``tests/e2e/test_ray_start.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from rlcore.errors import ConfigError
from rlcore.runtime.node_check import Needed, _compare, driver_dirs, installed, installed_versions

NODE, WHERE = "node 0123456789ab (10.0.0.7)", "the Ray cluster at h:1"
GEN = Needed("generation", "vllm", "rlcore_vllm.plugin", "rlcore-vllm", "0.1.0")
HERE = {"rlcore": "0.3.0", "rlcore-vllm": "0.1.0"}


def test_a_node_answers_its_import_errors_and_versions() -> None:
    answer = installed(["json", "no_such_module_rlcore_test"], ["rlcore", "no-such-distribution-rlcore-test"])
    assert answer["errors"]["json"] is None
    assert answer["errors"]["no_such_module_rlcore_test"].startswith("ModuleNotFoundError: No module named")
    assert answer["versions"]["rlcore"] and answer["versions"]["no-such-distribution-rlcore-test"] is None


def test_the_same_versions_pass() -> None:
    _compare(NODE, WHERE, [GEN], HERE, {"errors": {GEN.module: None}, "versions": dict(HERE)})


@pytest.mark.parametrize(
    ("answer", "expected", "key"),
    [
        ({"errors": {GEN.module: "ModuleNotFoundError: No module named 'vllm'"}, "versions": HERE},
         "node 0123456789ab (10.0.0.7), where generation may run, cannot import rlcore_vllm.plugin of generation's "
         "backend vllm (distribution rlcore-vllm): ModuleNotFoundError: No module named 'vllm'; the driver has "
         "rlcore-vllm 0.1.0", "generation.backend"),
        ({"errors": {GEN.module: None}, "versions": {**HERE, "rlcore-vllm": "0.0.9"}},
         "has generation's backend vllm (distribution rlcore-vllm) 0.0.9, the driver 0.1.0", "generation.backend"),
        ({"errors": {GEN.module: None}, "versions": {**HERE, "rlcore": "0.2.0"}},
         "node 0123456789ab (10.0.0.7) has rlcore 0.2.0, the driver 0.3.0", "cluster.address"),
    ],
    ids=["cannot-import", "backend-version", "rlcore-version"],
)
def test_a_difference_is_one_line_naming_node_backend_distribution_and_versions(
    answer: dict, expected: str, key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _compare(NODE, WHERE, [GEN], HERE, answer)
    assert expected in str(err.value) and str(err.value).startswith(WHERE) and err.value.key == key
    assert "\n" not in str(err.value)


def _checkout(at: Path, version: str) -> Path:
    """A directory like a checkout of rlcore: metadata of ``version`` beside the code."""
    info = at / f"rlcore-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rlcore\nVersion: {version}\n")
    return at


def test_the_versions_leave_out_the_directories_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.version("rlcore")
    checkout = _checkout(tmp_path / "checkout", "9.9.9")
    monkeypatch.setattr(sys, "path", [str(checkout), *sys.path])  # first, as Ray puts the driver's
    assert installed_versions(["rlcore"]) == {"rlcore": "9.9.9"}
    assert installed_versions(["rlcore"], [str(checkout)]) == {"rlcore": real} and real != "9.9.9"
    assert installed(["json"], ["rlcore"], [str(checkout)])["versions"] == {"rlcore": real}


def test_the_driver_leaves_out_its_working_directory_and_its_scripts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "bin" / "rlcore"), "run"])
    assert driver_dirs() == sorted({str(tmp_path), str(tmp_path / "bin")})


_ON_A_WORKER = """
import json, ray
from importlib import metadata
from rlcore.config import ClusterConfig
from rlcore.runtime.cluster import Cluster
from rlcore.runtime.node_check import driver_dirs, installed

cluster = Cluster(ClusterConfig(num_cpus=1)).start()
try:
    plain = ray.remote(num_cpus=0)(lambda: metadata.version("rlcore"))
    check = ray.remote(num_cpus=0)(installed)
    print(json.dumps({
        "plain": ray.get(plain.remote(), timeout=120),
        "check": ray.get(check.remote([], ["rlcore"], driver_dirs()), timeout=120)["versions"]["rlcore"],
    }))
finally:
    cluster.shutdown()
"""


@pytest.mark.timeout(300)
def test_a_worker_reports_its_installed_version_where_the_driver_runs_from_a_checkout(tmp_path: Path) -> None:
    # The driver's working directory holds another version's metadata; Ray puts it first on
    # the worker's sys.path, where a plain lookup finds it instead of the install.
    checkout = _checkout(tmp_path / "checkout", "9.9.9")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["HOME"] = str(home)  # the embedded cluster's token, not the machine's
    done = subprocess.run(
        [sys.executable, "-c", _ON_A_WORKER], cwd=checkout, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer == {"plain": "9.9.9", "check": metadata.version("rlcore")}, answer

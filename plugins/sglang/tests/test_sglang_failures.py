"""The server fails to start (a checkpoint it cannot read, its port taken): an error naming
SGLang with the end of its log, and nothing it started left running; through rlcore's
setup, a SetupError naming init:generation and backend sglang."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest
from sglang_helpers import processes_mentioning, start

from rlcore.errors import RlcoreError


def _assert_nothing_left(marker: str) -> None:
    deadline = time.monotonic() + 20
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"processes still running for {marker}: {left}"


@pytest.mark.timeout(400)
def test_bad_checkpoint(ray_cluster: None, tiny_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RlcoreError) as info:
        start(broken, tmp_path, refit_fed=False)
    message = str(info.value)
    assert "SGLang server exited" in message and "end of its log" in message, message
    assert "safetensors" in message.lower(), message  # the server's own words, from its log
    _assert_nothing_left(str(broken))


# SGLang's server failing at start is named with its log's tail by test_bad_checkpoint; this
# repeats that path through a whole setup (two inits, a teardown) at a minute of CI: soak.
@pytest.mark.soak
@pytest.mark.timeout(400)
def test_port_taken_is_a_setup_error(ray_cluster: None, tiny_model: Path, tmp_path: Path) -> None:
    from rlcore.config import load_config
    from rlcore.errors import SetupError
    from rlcore.setup.registry import load_registry
    from rlcore.setup.runner import run_setup

    repo = Path(__file__).resolve().parents[3]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = load_config(
            repo / "examples" / "sglang.yaml",
            [f"model.path={tiny_model}", f"setup.cache_dir={tmp_path / 'cache'}",
             f"generation.options.port={port}", "policy.workers=1", "policy.devices_per_worker=1"],
        )
        with pytest.raises(SetupError) as info:
            run_setup(config, load_registry(), run_dir=tmp_path / "run")
    err = info.value
    assert err.task == "init:generation" and err.backend == "sglang", (err.task, err.backend)
    assert "SGLang server" in str(err) and "end of its log" in str(err), str(err)
    assert str(port) in str(err)  # the log tail says which port
    _assert_nothing_left(f"--port {port}")

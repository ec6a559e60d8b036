"""vLLM's server bound beyond loopback checks the run's token on every route (issue 14).

The server is started as the worker starts it in server mode (``ServerProcess``, the
launcher, rlcore's ``BearerGuard`` as vLLM middleware), on this host's outward address:
a request without ``Authorization: Bearer <token>`` gets 401, on ``/v1`` and on the dev
routes refit uses alike; with the token, 200. Off loopback without a token it refuses.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlcore.config.placement import Network
from rlcore.runtime.addresses import free_port
from rlcore.testing.fixtures import outward_address
from rlcore_vllm.server import ServerError, ServerProcess


def _status(url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_off_loopback_without_a_token_the_server_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="token"):
        ServerProcess(["--model", "x"], port=free_port(), log_path=tmp_path / "log", env={}, host=outward_address())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_on_the_nodes_address_answers_401_without_the_token_and_200_with_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    network, host = Network.spread(), outward_address()
    args = ["--model", str(tiny_model), "--served-model-name", "policy", "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "128"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    server = ServerProcess(args, port=free_port(), log_path=tmp_path / "server.log", env=env,
                           host=host, token=network.token)
    try:
        server.wait_ready(240)  # /health is open: liveness only
        base = f"http://{host}:{server.port}"
        completion = {"model": "policy", "prompt": [3, 4, 5], "max_tokens": 2}
        routes = [("/v1/models", None), ("/v1/completions", completion), ("/tokenize", {"prompt": "1+1="}),
                  ("/collective_rpc", {"method": "get_model_config"})]
        for path, body in routes:
            assert _status(base + path, body) == 401, path
            assert _status(base + path, body, {"Authorization": "Bearer wrong"}) == 401, path
        for path, body in routes[:3]:
            assert _status(base + path, body, network.auth_headers()) == 200, path
        assert server.post("/v1/completions", completion)["choices"]  # the handle's own calls carry it
    finally:
        server.stop()

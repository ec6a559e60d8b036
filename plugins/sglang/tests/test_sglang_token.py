"""SGLang with the run's token (a run across nodes, issue 14): the server checks it on
every route (SGLang's key check, the token as api and admin key, so weight updates still
work) and the handle's own calls carry it; rlcore's endpoint in front of it checks it too.
The embedded cluster's node is loopback, so here the servers stay on 127.0.0.1: where they
bind across nodes is tests/e2e/test_multinode.py's (for vLLM) and rlcore.runtime.addresses'."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from sglang_helpers import PROMPTS, init_context, make_config

from rlcore.config.placement import Network
from rlcore.handles import SamplingParams


def _status(url: str, body: dict | None = None, token: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_servers_with_the_runs_token_answer_401_without_it(ray_cluster: None, tiny_model: Path, tmp_path: Path) -> None:
    from rlcore_sglang.plugin import rlcore_init_generation

    network = Network.spread()
    ctx = init_context(make_config(tiny_model, tmp_path / "cache", refit_fed=False, endpoint="rlcore"), tmp_path / "run")
    ctx.network = network
    gen = rlcore_init_generation(ctx)
    try:
        own, ours = gen.endpoints[0], gen.endpoint
        assert own.api_key == network.token and ours is not None and ours.api_key == network.token
        base = own.base_url.removesuffix("/v1")
        generate = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
        for url, body in [(own.base_url + "/models", None), (base + "/generate", generate),
                          (base + "/update_weights_from_disk", {"model_path": str(tiny_model)}),
                          (ours.base_url + "/models", None)]:
            assert _status(url, body) == 401, url
            assert _status(url, body, "wrong") == 401, url
        assert _status(own.base_url + "/models", None, network.token) == 200
        assert _status(ours.base_url + "/models", None, network.token) == 200
        assert _status(base + "/health") == 200
        # The handle's own requests carry the token (generate goes over SGLang's HTTP API).
        groups = gen.generate(PROMPTS[:2], SamplingParams(1, 2, 1.0, 0))
        assert [len(g) for g in groups] == [1, 1]
    finally:
        gen.shutdown()

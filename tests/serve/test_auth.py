"""Servers bound beyond loopback check the run's token: rlcore.serve.auth and the
OpenAI-compatible endpoint (real uvicorn on this host's outward address)."""

from __future__ import annotations

import httpx
import pytest

from rlcore.config.placement import TOKEN_ENV, Network
from rlcore.errors import RlcoreError
from rlcore.models.tiny import build_tokenizer
from rlcore.serve.auth import BearerGuard, authorized
from rlcore.serve.openai_endpoint import Listen, OpenAIEndpoint, ServedModel
from rlcore.testing.fixtures import outward_address


class _Engine:
    def generate(self, prompt_ids, params):
        m = params.max_tokens
        return [[{"token_ids": [5] * m, "logprobs": [-0.1] * m}] * params.n for _ in prompt_ids]


def test_authorized_wants_the_exact_bearer_token() -> None:
    assert authorized("Bearer s3cret", "s3cret") and authorized("bearer s3cret", "s3cret")
    for header in (None, "", "Bearer", "Bearer s3cre", "Basic s3cret", "s3cret"):
        assert not authorized(header, "s3cret"), header


def test_a_guard_without_a_token_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        BearerGuard(app=None)


def test_an_endpoint_beyond_loopback_needs_a_token() -> None:
    server = OpenAIEndpoint(_Engine(), build_tokenizer(), ServedModel("policy", 64), listen=Listen(outward_address()))
    with pytest.raises(RlcoreError, match="without a token"):
        server.start(timeout_s=10)


def test_an_endpoint_on_the_nodes_address_answers_401_without_the_token_and_200_with_it() -> None:
    network = Network.spread()
    host = outward_address()
    server = OpenAIEndpoint(_Engine(), build_tokenizer(), ServedModel("policy", 64), listen=Listen(host, token=network.token))
    endpoint = server.start(timeout_s=10)
    try:
        assert endpoint.base_url.startswith(f"http://{host}:") and endpoint.api_key == network.token
        body = {"model": "policy", "prompt": "1+2=", "max_tokens": 2}
        with httpx.Client(base_url=endpoint.base_url, timeout=10) as client:
            for path, method, payload in [("/models", "GET", None), ("/completions", "POST", body)]:
                bare = client.request(method, path, json=payload)
                assert bare.status_code == 401, (path, bare.text)
                wrong = client.request(method, path, json=payload, headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 401, path
                ok = client.request(method, path, json=payload, headers=network.auth_headers())
                assert ok.status_code == 200, (path, ok.text)
            assert ok.json()["choices"][0]["text"] is not None
            tokenize = httpx.post(f"http://{host}:{server.port}/tokenize", json={"prompt": "1"}, timeout=10)
            assert tokenize.status_code == 401  # every route, not only /v1
            assert httpx.get(f"http://{host}:{server.port}/health", timeout=10).status_code == 200
    finally:
        server.stop()


def test_an_endpoint_on_loopback_without_a_token_answers_everyone() -> None:
    server = OpenAIEndpoint(_Engine(), build_tokenizer(), ServedModel("policy", 64))
    endpoint = server.start(timeout_s=10)
    try:
        assert endpoint.base_url.startswith("http://127.0.0.1:") and endpoint.api_key == "EMPTY"
        assert httpx.get(endpoint.base_url + "/models", timeout=10).status_code == 200
    finally:
        server.stop()

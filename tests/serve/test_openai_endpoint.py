"""rlcore.serve.openai_endpoint over a scripted engine (HTTP through httpx, real uvicorn).

The engine here is a test double that records its calls and returns tokens
derived from the prompt, so every field of the responses can be checked
against what the engine produced. The real engine behind it (Megatron
generation) is exercised by plugins/megatron/tests and tests/e2e/test_e2e_nemo_gym.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator, Sequence

import httpx
import pytest

from rlcore.errors import NotServingError, RlcoreError
from rlcore.handles import SamplingParams
from rlcore.models.tiny import build_tokenizer
from rlcore.serve.openai_endpoint import Batching, OpenAIEndpoint, RequestBatcher, ServedModel

EOS = 2


class ScriptedEngine:
    """Completion token ``i`` is ``prompt[-1] + 1 + i`` (wrapping in the alphabet), logprob
    ``-(i + 1) / 10``; ``eos_after`` ends samples with EOS at that length."""

    def __init__(
        self, tokenizer, *, eos_after: int | None = None, fail: BaseException | None = None
    ) -> None:
        self.vocab = len(tokenizer)
        self.eos_after = eos_after
        self.fail = fail
        self.calls: list[dict] = []
        self.gate: threading.Event | None = None

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams):
        n, max_tokens, temperature, seed = params.n, params.max_tokens, params.temperature, params.seed
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append(
            {
                "prompts": [list(p) for p in prompt_ids],
                "n": n,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": seed,
            }
        )
        if self.fail is not None:
            raise self.fail
        out = []
        for p in prompt_ids:
            length = max_tokens if self.eos_after is None else min(max_tokens, self.eos_after)
            ids = [5 + (p[-1] + 1 + i) % (self.vocab - 5) for i in range(length)]
            if self.eos_after is not None and length == self.eos_after:
                ids[-1] = EOS
            out.append([{"token_ids": ids, "logprobs": [-(i + 1) / 10 for i in range(length)]}] * n)
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def serve(tokenizer) -> Iterator:
    servers = []

    def start(engine, **kwargs) -> tuple[OpenAIEndpoint, httpx.Client]:
        server = OpenAIEndpoint(
            engine, tokenizer, ServedModel("policy", kwargs.pop("max_len", 64), [EOS]), batching=Batching(**kwargs)
        )
        endpoint = server.start(timeout_s=10)
        servers.append(server)
        root = endpoint.base_url.removesuffix("/v1")
        return server, httpx.Client(base_url=root, timeout=20, trust_env=False)

    yield start
    for s in servers:
        s.stop()


GYM_BODY = {
    # What NeMo Gym's vllm_model server sends with return_token_id_information.
    "model": "policy",
    "messages": [{"role": "user", "content": "What is 2+3?"}],
    "max_tokens": 6,
    "temperature": 1.0,
    "logprobs": True,
    "top_logprobs": 0,
    "return_tokens_as_token_ids": True,
}


def test_chat_completion_carries_the_engines_tokens_and_logprobs(serve, tokenizer) -> None:
    engine = ScriptedEngine(tokenizer)
    _, client = serve(engine)
    r = client.post("/v1/chat/completions", json=GYM_BODY)
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(
            GYM_BODY["messages"], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    assert engine.calls[0]["prompts"] == [prompt] and engine.calls[0]["max_tokens"] == 6
    ids = engine.generate([prompt], SamplingParams(1, 6, 1.0, 0))[0][0]["token_ids"]
    choice = body["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": tokenizer.decode(ids, skip_special_tokens=True),
    }
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
        [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    )
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 6,
        "total_tokens": len(prompt) + 6,
    }
    assert body["model"] == "policy" and body["object"] == "chat.completion"
    # Without token ids requested, the response has none; /tokenize gives the prompt's.
    assert "prompt_token_ids" not in body and "token_ids" not in choice
    tok = client.post(
        "/tokenize", json={"model": "policy", "messages": GYM_BODY["messages"]}
    ).json()
    assert tok["tokens"] == prompt and tok["count"] == len(prompt)


def test_token_ids_text_tokens_and_finish_reason(serve, tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, eos_after=3)
    _, client = serve(engine)
    body = {**GYM_BODY, "return_tokens_as_token_ids": False, "return_token_ids": True}
    r = client.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["token_ids"][-1] == EOS and len(choice["token_ids"]) == 3
    assert choice["finish_reason"] == "stop"
    assert r["prompt_token_ids"] == engine.calls[0]["prompts"][0]
    # Token strings are the decoded tokens when ids are not asked for.
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        tokenizer.decode([t]) for t in choice["token_ids"]
    ]


def test_completions_take_text_or_token_ids(serve, tokenizer) -> None:
    engine = ScriptedEngine(tokenizer)
    _, client = serve(engine)
    ids = tokenizer.encode("1+1=", add_special_tokens=False)
    for prompt in ("1+1=", ids):
        r = client.post(
            "/v1/completions",
            json={
                "model": "policy",
                "prompt": prompt,
                "max_tokens": 4,
                "logprobs": 0,
                "return_token_ids": True,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == ids
        assert choice["logprobs"]["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
        assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert [c["temperature"] for c in engine.calls] == [0.0, 0.0]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "1+1="}


def test_concurrent_requests_share_engine_calls(serve, tokenizer) -> None:
    engine = ScriptedEngine(tokenizer)
    engine.gate = threading.Event()  # hold the first call so the rest queue up
    server, client = serve(engine, wait_s=0.05, max_batch=16)
    prompts = [f"{i}+{i}=" for i in range(12)]

    def ask(text: str) -> dict:
        body = {**GYM_BODY, "messages": [{"role": "user", "content": text}]}
        return client.post("/v1/chat/completions", json=body).json()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        threading.Timer(0.5, engine.gate.set).start()
        answers = [f.result() for f in futures]
    assert server.batcher.served == 12
    assert len(engine.calls) < 12, "concurrent requests were not batched"
    assert sum(len(c["prompts"]) for c in engine.calls) == 12
    # Each answer is the one for its own prompt.
    for text, answer in zip(prompts, answers, strict=True):
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        want = engine.generate([prompt], SamplingParams(1, 6, 1.0, 0))[0][0][
            "token_ids"
        ]
        got = [
            int(e["token"].removeprefix("token_id:"))
            for e in answer["choices"][0]["logprobs"]["content"]
        ]
        assert got == want


def test_requests_with_different_sampling_run_in_separate_calls() -> None:
    import asyncio

    calls = []

    def run(prompts, max_tokens, temperature, seed):
        calls.append((len(prompts), max_tokens, temperature, seed))
        return [{"token_ids": [1], "logprobs": [0.0]} for _ in prompts]

    async def main() -> None:
        b = RequestBatcher(run, max_batch=2, wait_s=0.01, seed=100)
        await asyncio.gather(
            b.submit([1], max_tokens=4, temperature=1.0, seed=None),
            b.submit([2], max_tokens=4, temperature=1.0, seed=None),
            b.submit([3], max_tokens=4, temperature=1.0, seed=None),  # over max_batch
            b.submit([4], max_tokens=8, temperature=1.0, seed=None),
            b.submit([5], max_tokens=4, temperature=1.0, seed=7),
        )

    asyncio.run(main())
    assert sorted(calls) == sorted(
        [(2, 4, 1.0, 100), (1, 4, 1.0, 101), (1, 8, 1.0, 102), (1, 4, 1.0, 7)]
    )


@pytest.mark.parametrize(
    ("change", "status", "needle"),
    [
        ({"stop": ["\n"]}, 400, "stop"),
        ({"top_p": 0.5}, 400, "top_p"),
        ({"top_logprobs": 3}, 400, "top_logprobs"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 200}, 400, "maximum context length is 64"),
        ({"model": "other"}, 404, "`other` does not exist"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text only"),
        ({"stream": True}, 400, "stream"),
        ({"chat_template_kwargs": {"padding": True}}, 400, "may not set padding"),
    ],
)
def test_bad_requests_name_the_parameter(serve, tokenizer, change, status, needle) -> None:
    engine = ScriptedEngine(tokenizer)
    _, client = serve(engine)
    r = client.post("/v1/chat/completions", json={**GYM_BODY, **change})
    assert r.status_code == status
    assert needle in r.json()["message"]
    assert engine.calls == []


def test_unknown_routes_and_methods_answer_in_openais_error_shape(serve, tokenizer) -> None:
    _, client = serve(ScriptedEngine(tokenizer))
    for r, status in ((client.post("/v1/embeddings", json={}), 404), (client.get("/v1/chat/completions"), 405)):
        assert r.status_code == status
        assert r.json()["object"] == "error" and r.json()["error"]["code"] == status, r.text


def test_engine_errors_reach_the_client(serve, tokenizer) -> None:
    cause = NotServingError("megatron generation rank 0 has no weights yet")
    wrapped = RlcoreError("generate: megatron-generation rank 0 failed")
    wrapped.__cause__ = cause
    _, client = serve(ScriptedEngine(tokenizer, fail=wrapped))
    r = client.post("/v1/chat/completions", json=GYM_BODY)
    assert r.status_code == 503 and "no weights yet" in r.json()["message"]
    _, client = serve(ScriptedEngine(tokenizer, fail=ValueError("shapes differ")))
    r = client.post("/v1/chat/completions", json=GYM_BODY)
    assert r.status_code == 500 and "ValueError: shapes differ" in r.json()["message"]


def test_models_and_stop_releases_the_port(serve, tokenizer) -> None:
    server, client = serve(ScriptedEngine(tokenizer))
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["policy"]
    assert client.get("/health").status_code == 200
    url = server.endpoint.base_url
    thread = server._thread
    server.stop()
    assert server.endpoint is None and not thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", timeout=2, trust_env=False)
    server.stop()  # idempotent


def test_an_endpoint_serves_with_the_tokenizer_prepared_ahead(tokenizer, tmp_path) -> None:
    """prepare() loads the tokenizer of a path in a thread while the engine starts; the
    endpoint given its future serves chat with the same prompt transformers' template
    gives; a path without a tokenizer fails start() with the loader's error."""
    from concurrent.futures import Future

    from rlcore.serve.openai_endpoint import prepare

    tokenizer.save_pretrained(tmp_path)
    ahead = prepare(str(tmp_path))
    assert isinstance(ahead, Future)
    engine = ScriptedEngine(tokenizer)
    server = OpenAIEndpoint(engine, ahead, ServedModel("policy", 64, [EOS]))
    endpoint = server.start(timeout_s=120)
    try:
        with httpx.Client(base_url=endpoint.base_url.removesuffix("/v1"), timeout=20, trust_env=False) as client:
            r = client.post("/v1/chat/completions", json=GYM_BODY)
            assert r.status_code == 200, r.text
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(GYM_BODY["messages"], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        assert engine.calls[0]["prompts"] == [prompt]
        assert server.tokenizer is ahead.result()  # the prepared one, not a second load
    finally:
        server.stop()
    missing = prepare(str(tmp_path / "no-such-model"))
    with pytest.raises(Exception, match="no-such-model"):
        OpenAIEndpoint(engine, missing, ServedModel("policy", 64)).start(timeout_s=120)



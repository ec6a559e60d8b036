"""The HTTP engines' shared path: requests sent at once and in order, samples grouped n per
prompt, rows in the batch's order, a short answer refused, per-sample seeds."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from rlcore.handles import SamplingParams
from rlcore.runtime import engine_http
from rlcore.runtime.engine_http import Request, sample_seeds


class Server:
    """Answers ``/one`` (one prompt per request) after a delay, so concurrency shows."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def request(self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 300.0) -> Any:
        assert body is not None and timeout_s == 7.0
        with self.lock:
            self.bodies.append(body)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(0.05)
        with self.lock:
            self.in_flight -= 1
        if path == "/lp":
            return [[-0.5] * len(c) for _, c in body["pairs"]]
        return [{"ids": [body["prompt"][-1], s], "lps": [-1.0, -2.0]} for s in body["seeds"]]


class PerPrompt:
    """One request per prompt (as vLLM's completions), one per call for logprobs (as SGLang)."""

    def __init__(self, short: bool = False) -> None:
        self.short = short

    def generate_requests(self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int]) -> list[Request]:
        return [Request("/one", {"prompt": p, "seeds": sample_seeds(s, params.n)}, [p]) for p, s in zip(prompts, seeds, strict=True)]

    def samples(self, answer: Any, request: Request) -> list[Any]:
        out = [{"token_ids": a["ids"], "logprobs": a["lps"]} for a in answer]
        return out[:-1] if self.short else out

    def logprobs_requests(self, batch: list[tuple[list[int], list[int]]]) -> list[Request]:
        return [Request("/lp", {"pairs": batch}, batch)]

    def rows(self, answer: Any, request: Request) -> list[list[float]]:
        assert len(answer) == len(request.items)
        return list(answer)


def test_a_call_becomes_requests_sent_at_once_and_samples_in_prompt_order() -> None:
    server = Server()
    out = engine_http.generate(server, PerPrompt(), [[1], [2], [3]], SamplingParams(2, 4, 1.0, 0), [10, 20, 30], timeout_s=7.0)
    assert [[s["token_ids"] for s in g] for g in out] == [[[1, 10], [1, 11]], [[2, 20], [2, 21]], [[3, 30], [3, 31]]]
    assert server.most_in_flight > 1  # the three requests were in flight together
    assert all(isinstance(t, int) for b in server.bodies for t in b["prompt"])
    rows = engine_http.logprobs(server, PerPrompt(), [([1], [2, 3]), ((4,), (5,))], timeout_s=7.0)
    assert rows == [[-0.5, -0.5], [-0.5]]


def test_an_answer_short_of_n_samples_per_prompt_is_refused() -> None:
    with pytest.raises(RuntimeError, match="answered 2 samples for 2 prompts x n=2"):
        engine_http.generate(Server(), PerPrompt(short=True), [[1], [2]], SamplingParams(2, 4, 1.0, 0), [1, 2], timeout_s=7.0)


def test_sample_j_of_a_prompt_is_seeded_its_seed_plus_j_below_2_to_the_62() -> None:
    assert sample_seeds(5, 3) == [5, 6, 7]
    assert sample_seeds((1 << 62) - 1, 2) == [(1 << 62) - 1, 0]


def test_sampling_params_refuse_values_out_of_range() -> None:
    assert SamplingParams(1, 1, 0.0, 0).temperature == 0.0
    for bad, field in (((0, 1, 1.0, 0), "n"), ((1, 0, 1.0, 0), "max_tokens"), ((1, 1, -0.1, 0), "temperature")):
        with pytest.raises(ValueError, match=f"SamplingParams.{field} must be >= 0|SamplingParams.{field} must be >= 1"):
            SamplingParams(*bad)

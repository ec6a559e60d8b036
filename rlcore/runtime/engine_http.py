"""The generate and logprobs path of an engine behind its own HTTP server (vLLM's server
mode, SGLang), on the engine's side of :mod:`rlcore.runtime.generation_group`.

What every such engine does the same way lives here: a call becomes requests
(:class:`Request`), the requests go to the server at once (several concurrently), and the
answers become samples grouped ``n`` per prompt, or logprob rows, in the call's order. What
differs between engines -- routes, payload fields, the answer's shape -- is an
:class:`EngineAPI` each plugin writes. The seeds come from the handle
(:func:`rlcore.runtime.generation_group.prompt_seed`, one per prompt); the ``j``-th sample
of a prompt seeded ``s`` is seeded ``s + j`` (:func:`sample_seeds`), which is what vLLM does
by itself with ``n`` and what SGLang is told per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from rlcore.handles import Pair, Sample, SamplingParams

#: Most requests of one call in flight at once (an engine with one prompt per request).
MAX_CONCURRENT = 16


@dataclass(frozen=True)
class Request:
    """One HTTP request of a call: a route, its JSON body, and the prompts (generate) or
    ``(prompt, completion)`` pairs (logprobs) it covers, in the call's order."""

    route: str
    body: dict[str, Any]
    items: Sequence[Any]


class EngineAPI(Protocol):
    """What an engine's HTTP API asks for and answers (all that differs between engines)."""

    def generate_requests(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Request]:
        """The requests of one generate call; prompt ``i`` samples with ``seeds[i]``."""
        ...

    def samples(self, answer: Any, request: Request) -> list[Sample]:
        """The samples of ``answer``: ``n`` per prompt of ``request.items``, prompt by prompt."""
        ...

    def logprobs_requests(self, batch: list[tuple[list[int], list[int]]]) -> list[Request]:
        """The requests of one logprobs call."""
        ...

    def rows(self, answer: Any, request: Request) -> list[list[float]]:
        """One row per pair of ``request.items``: its completion's logprobs."""
        ...


class Server(Protocol):
    """What is asked of the server (:class:`rlcore.runtime.server.GuardedServer` has it)."""

    def request(self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 300.0) -> Any: ...


def sample_seeds(seed: int, n: int) -> list[int]:
    """The seeds of the ``n`` samples of a prompt seeded ``seed`` (kept below 2**62)."""
    return [int(seed + j) % (1 << 62) for j in range(n)]


def generate(
    server: Server, api: EngineAPI, prompts: Sequence[Sequence[int]], params: SamplingParams,
    seeds: Sequence[int], *, timeout_s: float,
) -> list[list[Sample]]:
    """``params.n`` samples per prompt through ``server``, in prompt order (see the module doc);
    each request waits at most ``timeout_s``."""
    ids = [[int(t) for t in p] for p in prompts]
    requests = api.generate_requests(ids, params, seeds)
    flat = [s for r, a in zip(requests, send(server, requests, timeout_s), strict=True) for s in api.samples(a, r)]
    if len(flat) != len(ids) * params.n:
        raise RuntimeError(f"the engine answered {len(flat)} samples for {len(ids)} prompts x n={params.n}")
    return [flat[i * params.n : (i + 1) * params.n] for i in range(len(ids))]


def logprobs(server: Server, api: EngineAPI, batch: Sequence[Pair], *, timeout_s: float) -> list[list[float]]:
    """Each pair's completion logprobs through ``server``, in the batch's order."""
    pairs = [([int(t) for t in p], [int(t) for t in c]) for p, c in batch]
    requests = api.logprobs_requests(pairs)
    return [row for r, a in zip(requests, send(server, requests, timeout_s), strict=True) for row in api.rows(a, r)]


def send(server: Server, requests: Sequence[Request], timeout_s: float) -> list[Any]:
    """The answers of ``requests``, in their order; several are sent concurrently."""
    if len(requests) == 1:
        return [server.request(requests[0].route, requests[0].body, timeout_s=timeout_s)]
    workers = max(1, min(len(requests), MAX_CONCURRENT))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engine-http") as pool:
        return list(pool.map(lambda r: server.request(r.route, r.body, timeout_s=timeout_s), requests))

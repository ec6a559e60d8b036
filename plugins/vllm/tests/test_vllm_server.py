"""Server mode (``serve_openai``): vLLM's OpenAI-compatible server in the worker.

The endpoint answers ``/v1/completions`` on 127.0.0.1 with the weights refit
loaded; a refit lands in requests in flight (and one that fails aborts them);
shutting the handle down, or killing its worker, leaves no process behind.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
from vllm_helpers import PROMPTS, init_context, make_config, max_abs_diff

from rlcore.errors import CancelToken, WorkerError
from rlcore.handles import SamplingParams
from rlcore.refit.channels import ChannelSpec
from rlcore.refit.sessions import RefitSessions
from rlcore.refit.specs import plan_buckets
from rlcore.refit.sync import refit
from rlcore.setup.runner import refit_context
from rlcore_vllm.plugin import rlcore_init_generation

#: The refit channels of this module's handles (a run owns its sessions; so does this module).
SESSIONS = RefitSessions()

TOL = 1e-4


def group_alive(pgid: int) -> list[int]:
    alive = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def wait_gone(pgid: int, timeout_s: float) -> list[int]:
    end = time.monotonic() + timeout_s
    while (alive := group_alive(pgid)) and time.monotonic() < end:
        time.sleep(0.2)
    return alive


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def endpoint_logprobs(endpoint: Any, batch: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    rows = []
    for prompt, completion in batch:
        ids = prompt + completion
        body = {"model": endpoint.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
        lps = post(endpoint.base_url + "/completions", body)["choices"][0]["prompt_logprobs"]
        rows.append([lps[k][str(ids[k])]["logprob"] for k in range(len(prompt), len(ids))])
    return rows


def start_server(tiny_model: Path, tmp: Path) -> tuple[Any, Any, dict[str, Any]]:
    config = make_config(tiny_model, tmp / "cache", serve_openai=True)
    t0 = time.monotonic()
    gen = rlcore_init_generation(init_context(config, tmp / "run"))
    print(f"vllm server mode: start {time.monotonic() - t0:.1f}s")
    info = ray.get(gen.group.actors[0].endpoint_info.remote())
    return gen, config, info


@pytest.fixture(scope="module")
def served(ray_cluster: None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One server-mode handle shared by the tests that refit it; the last of them shuts it down."""
    gen, config, info = start_server(tiny_model, tmp_path_factory.mktemp("vllm-served"))
    yield gen, config, info
    gen.shutdown()


def test_endpoint_serves_refit_weights(served: Any, policy: Any) -> None:
    gen, config, info = served
    ep = gen.endpoint
    assert (
        ep is not None
        and ep.base_url.startswith("http://127.0.0.1:")
        and ep.base_url.endswith("/v1")
    )
    assert group_alive(info["pgid"])
    probe = [(p, [10, 11, 12]) for p in PROMPTS]
    assert (
        max_abs_diff(endpoint_logprobs(ep, probe), policy.logprobs(probe)) > 0.05
    )  # dummy weights

    assert gen.weight_versions() == [0]  # the server's own label before rlcore's first refit
    long_prompts = [[2] + [(5 * i + k) % 36 + 4 for i in range(199)] for k in range(2)]
    for step, (seed, transport) in enumerate([(None, "collective"), (7, "shared_memory")], start=1):
        gen.generate(long_prompts, SamplingParams(2, 2, 1.0, step))  # fills the prefix cache
        policy.perturb(seed)
        refit(
            policy,
            gen,
            refit_context(
                config, step=step, transport=transport, cancel=CancelToken(),
                sessions=SESSIONS,
            ),
        )
        answered = endpoint_logprobs(ep, probe)
        assert max_abs_diff(answered, policy.logprobs(probe)) < TOL
        assert max_abs_diff(gen.logprobs(probe), answered) < TOL
        again = gen.generate(long_prompts, SamplingParams(2, 3, 1.0, 9))
        batch = [
            (p, s["token_ids"]) for p, g in zip(long_prompts, again, strict=True) for s in g
        ]
        sampled = [s["logprobs"] for g in again for s in g]
        assert max_abs_diff(sampled, policy.logprobs(batch)) < TOL
        # /v1/completions says nothing of versions: the worker's counter of refits does.
        assert gen.weight_versions() == [step]
        assert [s["versions"] for g in again for s in g] == [[step] * len(c) for _, c in batch]

    # Plain text prompts work too (the server has the checkpoint's tokenizer).
    out = post(
        ep.base_url + "/completions",
        {"model": ep.model, "prompt": "12+7=", "max_tokens": 4, "n": 2},
    )
    assert len(out["choices"]) == 2
    groups = gen.generate(PROMPTS, SamplingParams(2, 6, 1.0, 1))
    assert [len(g) for g in groups] == [2] * len(PROMPTS)


def _context(config: Any, step: int, transport: str) -> Any:
    return refit_context(config, step=step, transport=transport, cancel=CancelToken(), sessions=SESSIONS)


class InFlight:
    """``copies`` long greedy completions of ``prompt``, one request streamed from a thread
    (several, so that each decoding step takes longer and the refit lands well before the
    end): in flight once built; :meth:`result` is each one's ``(token ids, logprobs,
    finish reason)``."""

    def __init__(self, endpoint: Any, prompt: list[int], max_tokens: int, copies: int = 16) -> None:
        self.url = endpoint.base_url + "/completions"
        self.body = {
            "model": endpoint.model, "prompt": [prompt] * copies, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
            "stream": True,
        }
        self.first = threading.Event()
        self.reader = ThreadPoolExecutor(1)
        self.future = self.reader.submit(self._read)
        assert self.first.wait(120), "the requests never started"

    def _read(self) -> list[tuple[list[int], list[float], str | None]]:
        req = urllib.request.Request(self.url, json.dumps(self.body).encode(), {"Content-Type": "application/json"})
        outs: dict[int, tuple[list[int], list[float], list[str | None]]] = {}
        with urllib.request.urlopen(req, timeout=300) as r:
            for line in r:
                text = line.decode().strip()
                if not text.startswith("data:") or text == "data: [DONE]":
                    continue
                for c in json.loads(text[5:])["choices"]:
                    ids, lps, finish = outs.setdefault(c["index"], ([], [], [None]))
                    ids += c.get("token_ids") or []
                    lps += (c.get("logprobs") or {}).get("token_logprobs") or []
                    finish[0] = c.get("finish_reason") or finish[0]
                    self.first.set()
        return [(ids, lps, finish[0]) for ids, lps, finish in (outs[i] for i in sorted(outs))]

    def result(self) -> list[tuple[list[int], list[float], str | None]]:
        try:
            return self.future.result(300)
        finally:
            self.reader.shutdown()


def test_a_refit_lands_in_a_request_in_flight(served: Any, policy: Any) -> None:
    """The requests are held while the weights load (/pause keep), then go on with them:
    their tokens up to the landing are the old weights' (greedy; logprobs the policy's),
    the rest the new ones' from the first token on, their KV recomputed (the pause's
    clear_cache preempts them), none a mix; the landing is mid-request for some."""
    gen, config, _ = served
    policy.perturb(5)
    refit(policy, gen, _context(config, 51, "collective"))
    policy.perturb(6)  # sent by the next refit
    tokens = 480
    flight = InFlight(gen.endpoint, PROMPTS[0], tokens)
    refit(policy, gen, _context(config, 52, "collective"))  # GroupGeneration.receive_weights: the refit thread
    outs = flight.result()
    after = policy.logprobs([(PROMPTS[0], ids) for ids, _, _ in outs])
    policy.perturb(5)
    before = policy.logprobs([(PROMPTS[0], ids) for ids, _, _ in outs])
    landings = []
    for (ids, lps, finish), old, new in zip(outs, before, after, strict=True):
        assert len(ids) == len(lps) == tokens and finish == "length"
        landed = next((k for k, (x, y) in enumerate(zip(lps, old, strict=True)) if abs(x - y) > TOL), tokens)
        landings.append(landed)
        assert landed < tokens  # 0: a request not scheduled yet when the refit landed
        assert max_abs_diff([lps[landed:]], [new[landed:]]) < TOL
    print("tokens of the old weights in each request in flight:", landings)
    assert max(landings) > 0


def test_a_refit_that_fails_in_flight_aborts_the_held_requests_and_pauses_nothing(
    served: Any, policy: Any, tmp_path: Path
) -> None:
    """A file channel whose step never comes: the update fails inside vLLM (the layers
    were prepared for reloading). The requests held meanwhile end aborted (none goes on
    with those weights), the server serves again, and the engine refuses to sample until
    a good refit."""
    gen, config, _ = served
    spec = ChannelSpec("shared_memory", "never-published", 1 + gen.refit_ranks, root=str(tmp_path), timeout_s=1.0)
    ray.get(gen.open_refit_channel(spec))
    flight = InFlight(gen.endpoint, PROMPTS[1], 480)
    with pytest.raises(ray.exceptions.RayTaskError, match="gave up waiting for artifact"):
        ray.get(gen.receive_weights(spec, 123, plan_buckets(gen.weight_specs(), 2**20)))
    outs = flight.result()
    print("the held requests:", [(len(ids), finish) for ids, _, finish in outs])
    assert all(finish == "abort" and len(ids) < 480 for ids, _, finish in outs)
    probe = [(p, [10, 11, 12]) for p in PROMPTS]
    assert len(endpoint_logprobs(gen.endpoint, probe)) == len(probe)  # served: not paused
    with pytest.raises(WorkerError, match="refuses to generate"):
        gen.generate(PROMPTS, SamplingParams(1, 2, 1.0, 0))
    policy.perturb(None)
    refit(policy, gen, _context(config, 124, "disk"))
    assert max_abs_diff(gen.logprobs(probe), policy.logprobs(probe)) < TOL


def test_shutdown_leaves_nothing(served: Any) -> None:
    """Last of the tests on the shared server."""
    gen, _, info = served
    gen.shutdown()
    assert wait_gone(info["pgid"], 10) == []
    with pytest.raises(OSError):
        urllib.request.urlopen(info["base_url"] + "/models", timeout=2)


def test_killed_worker_takes_its_server_down(
    ray_cluster: None, tiny_model: Path, tmp_path: Path
) -> None:
    gen, _, info = start_server(tiny_model, tmp_path)
    try:
        ray.kill(gen.group.actors[0], no_restart=True)
        # Named (WorkerError) instead of the call waiting out its 900 s timeout.
        with pytest.raises(WorkerError, match="vllm-generation"):
            gen.logprobs([(PROMPTS[0], [10])])
        # The launcher notices its worker is gone and ends the server's process group.
        assert wait_gone(info["pgid"], 15) == []
    finally:
        gen.shutdown()

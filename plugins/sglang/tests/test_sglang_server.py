"""One real SGLang server (refit-fed) shared by this module's tests, fed by a sender in
the test process: refit over each transport matches transformers, samples follow the
handle's formats, a refit the server rejects keeps the old weights, and a server that
dies mid-run fails the next call with a named error in bounded time."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import ray
from sglang_helpers import PROMPTS, ThreadSender, hf_state, named, reference_logprobs

from rlcore.errors import RefitError, WorkerError
from rlcore.handles import SamplingParams
from rlcore.refit import channels
from rlcore.refit.specs import TensorSpec, plan_buckets, spec_of
from rlcore.runtime.addresses import free_port

TOL = 1e-4
PROBE = [(p, [10, 11, 12, 3]) for p in PROMPTS]


def channel(transport: str, root: Path) -> channels.ChannelSpec:
    key = uuid.uuid4().hex[:12]
    if transport == "collective":
        return channels.ChannelSpec("collective", key, 2, addr="127.0.0.1", port=free_port(), timeout_s=60)
    return channels.ChannelSpec(transport, key, 2, root=str(root), timeout_s=60)


def open_both(gen: Any, spec: channels.ChannelSpec) -> None:
    sender = ThreadSender()
    sender.run(lambda: channels.open_channel(spec, 0))
    ray.get(gen.open_refit_channel(spec), timeout=120)
    sender.join()


def refit(gen: Any, spec: channels.ChannelSpec, step: int, state: dict[str, Any], buckets: list[list[Any]]) -> None:
    """Send ``state`` in ``buckets`` from this process while the server receives."""
    sender = ThreadSender()
    sender.run(lambda: channels.send_weights(spec, step, named(state, buckets), buckets))
    try:
        ray.get(gen.receive_weights(spec, step, buckets), timeout=120)
    finally:
        sender.join()
        channels.remove_step(spec, step)


def server_logprobs(gen: Any, batch: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """Logprobs straight from SGLang's /generate (past the handle's stale-weights guard)."""
    base = gen.endpoints[0].base_url.removesuffix("/v1")  # SGLang's own
    rows = []
    for prompt, completion in batch:
        body = {"input_ids": prompt + completion, "sampling_params": {"max_new_tokens": 1},
                "return_logprob": True, "logprob_start_len": len(prompt) - 1}
        req = urllib.request.Request(base + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            rows.append([e[0] for e in json.loads(r.read())["meta_info"]["input_token_logprobs"][1:]])
    return rows


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.fixture(scope="module")
def specs(server: Any) -> list[TensorSpec]:
    return server.weight_specs()


def versions(groups: list[list[Any]]) -> set[int]:
    """Every weight version the samples' tokens carry (each sample must carry one per token)."""
    assert all(len(s["versions"]) == len(s["token_ids"]) for g in groups for s in g)
    return {v for g in groups for s in g for v in s["versions"]}


def test_weight_versions_are_0_before_any_refit(server: Any) -> None:
    """First in the module: the server's own label before rlcore's first refit is version 0,
    for the engine and for every token it samples (read from SGLang's spans)."""
    assert server.weight_versions() == [0]
    assert versions(server.generate(PROMPTS, SamplingParams(2, 4, 1.0, 3))) == {0}

    def engine_samples(worker: Any) -> Any:  # local: pickled by value into the actor
        return worker._generate(PROMPTS, SamplingParams(2, 4, 1.0, 3), [3] * len(PROMPTS))

    # SGLang's own answer carries them (not the worker's counter, which fills in what is missing).
    assert versions(ray.get(server.group.actors[0].__ray_call__.remote(engine_samples), timeout=120)) == {0}


@pytest.mark.parametrize("transport", ["collective", "disk", "shared_memory"])
def test_refit_loads_the_sent_weights(
    server: Any, tiny_model: Path, specs: list[TensorSpec], transport: str, tmp_path: Path
) -> None:
    state = hf_state(tiny_model, seed=len(transport))
    truth = reference_logprobs(tiny_model, state, PROBE)
    assert max_diff(server_logprobs(server, PROBE), truth) > 0.01  # not these weights yet
    spec = channel(transport, tmp_path)
    open_both(server, spec)
    buckets = plan_buckets(specs, 256 * 1024)  # several buckets
    assert len(buckets) > 2
    step = {"collective": 11, "disk": 12, "shared_memory": 13}[transport]
    refit(server, spec, step, state, buckets)
    assert max_diff(server.logprobs(PROBE), truth) < TOL
    assert server.weight_versions() == [step]
    assert versions(server.generate(PROMPTS, SamplingParams(2, 4, 1.0, 3))) == {step}
    channels.close_channel(spec)


def test_samples_follow_the_handle_formats(server: Any, tiny_model: Path) -> None:
    """Token ids with their temperature-1 logprobs, EOS included and last; n per prompt;
    SGLang's own /v1 answers with the same weights."""
    groups = server.generate(PROMPTS, SamplingParams(3, 6, 1.5, 5))
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    batch = [(p, s["token_ids"]) for p, g in zip(PROMPTS, groups, strict=True) for s in g]
    sampled = [s["logprobs"] for g in groups for s in g]
    assert all(1 <= len(s["token_ids"]) <= 6 and len(s["logprobs"]) == len(s["token_ids"]) for g in groups for s in g)
    # sampled at temperature 1.5, reported at temperature 1: what logprobs() says
    assert max_diff(sampled, server.logprobs(batch)) < TOL
    eos = 3
    for _, completion in batch:
        assert eos not in completion[:-1]
    def complete(base_url: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(base_url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    own = server.endpoints[0]  # SGLang's /v1
    assert own.base_url != server.endpoint.base_url
    assert len(complete(own.base_url, {"model": own.model, "prompt": "12+7=", "max_tokens": 4, "n": 2})["choices"]) == 2
    # rlcore's endpoint in front (endpoint: rlcore): vLLM's token-id extensions, which Gym needs
    ep = server.endpoint
    body = {"model": ep.model, "prompt": PROMPTS[0], "max_tokens": 4, "logprobs": 0,
            "return_tokens_as_token_ids": True, "seed": 3}
    choice = complete(ep.base_url, body)["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert tokens and all(t.startswith("token_id:") for t in tokens), tokens
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert max_diff([choice["logprobs"]["token_logprobs"]], server.logprobs([(PROMPTS[0], ids)])) < TOL


def test_generate_is_seeded(server: Any) -> None:
    """Same seed, same samples (whatever else is in the batch); another seed, others."""
    first = server.generate(PROMPTS, SamplingParams(2, 8, 1.0, 7))
    again = server.generate(PROMPTS[:1], SamplingParams(2, 8, 1.0, 7))
    other = server.generate(PROMPTS, SamplingParams(2, 8, 1.0, 8))
    ids = [[s["token_ids"] for s in g] for g in first]
    assert [s["token_ids"] for s in again[0]] == ids[0]  # logprobs may differ in the last bits
    assert [[s["token_ids"] for s in g] for g in other] != ids


def test_rejected_refit_raises_quoting_the_server_and_keeps_old_weights(
    server: Any, tiny_model: Path, specs: list[TensorSpec], tmp_path: Path
) -> None:
    """A tensor SGLang's loader refuses (wrong shape, first in the plan: the core's own
    check is bypassed here) -> RefitError quoting the server; weight_version and the
    served logprobs are unchanged; the sender is not left blocked; a good refit after."""
    before_version = server.weight_versions()
    before = server_logprobs(server, PROBE)
    state = hf_state(tiny_model, seed=99)
    bad = dict(state)
    bad["model.norm.weight"] = state["model.norm.weight"][:-1].clone()
    order = ["model.norm.weight"] + [s.name for s in specs if s.name != "model.norm.weight"]
    buckets = plan_buckets([spec_of(n, bad[n]) for n in order], 256 * 1024)
    spec = channel("collective", tmp_path)
    open_both(server, spec)
    with pytest.raises(RefitError, match="rejected refit step 21") as info:
        refit(server, spec, 21, bad, buckets)  # the sender finishes (join() inside)
    assert "model.norm.weight" in str(info.value) or "size" in str(info.value).lower()
    assert server.weight_versions() == before_version
    assert max_diff(server_logprobs(server, PROBE), before) < 1e-6
    with pytest.raises(WorkerError, match="refuses to generate until a refit succeeds"):
        server.generate(PROMPTS, SamplingParams(1, 2, 1.0, 0))
    good = plan_buckets(specs, 256 * 1024)
    refit(server, spec, 22, state, good)
    assert max_diff(server.logprobs(PROBE), reference_logprobs(tiny_model, state, PROBE)) < TOL
    assert server.weight_versions() == [22]
    assert versions(server.generate(PROMPTS, SamplingParams(1, 4, 1.0, 0))) == {22}
    channels.close_channel(spec)


class InFlight:
    """``copies`` long greedy requests of ``prompt`` to SGLang's own /generate, one batch
    streamed from a thread (several, so that each decoding step takes longer and the
    refit lands well before the end): in flight once built; :meth:`result` is each one's
    last chunk (the whole output, ``meta_info.weight_versions`` included)."""

    def __init__(self, gen: Any, prompt: list[int], max_new_tokens: int, copies: int = 8) -> None:
        self.base = gen.endpoints[0].base_url.removesuffix("/v1")
        self.body = {
            "input_ids": [prompt] * copies, "return_logprob": True, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        }
        self.first = threading.Event()
        self.sender = ThreadSender()
        self.sender.run(self._read)
        assert self.first.wait(120), "the requests never started"

    def _read(self) -> list[dict[str, Any]]:
        req = urllib.request.Request(self.base + "/generate", json.dumps(self.body).encode(), {"Content-Type": "application/json"})
        last: dict[int, dict[str, Any]] = {}
        with urllib.request.urlopen(req, timeout=300) as r:
            for line in r:
                text = line.decode().strip()
                if text.startswith("data:") and text != "data: [DONE]":
                    out = json.loads(text[5:])
                    last[out.get("index", 0)] = out
                    self.first.set()
        return [last[i] for i in sorted(last)]

    def result(self) -> list[dict[str, Any]]:
        return self.sender.join(300)


def _spans(out: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [(v["version"], v["start"], v["end"]) for v in out["meta_info"]["weight_versions"]]


def test_a_refit_lands_in_a_request_in_flight(
    server: Any, tiny_model: Path, specs: list[TensorSpec], tmp_path: Path
) -> None:
    """The requests are held while the weights load, then go on with them: their tokens
    up to the landing are the old weights' (greedy, their logprobs transformers'), the
    rest the new ones', recomputed from scratch (retract), and SGLang's spans say where;
    the landing is mid-request for some."""
    spec = channel("collective", tmp_path)
    open_both(server, spec)
    buckets = plan_buckets(specs, 256 * 1024)
    old, new = hf_state(tiny_model, seed=31), hf_state(tiny_model, seed=32)
    refit(server, spec, 31, old, buckets)
    tokens = 400
    flight = InFlight(server, PROMPTS[0], tokens)
    refit(server, spec, 32, new, buckets)  # GroupGeneration.receive_weights: the refit thread
    outs = flight.result()
    print("weight_versions of the requests in flight:", [o["meta_info"]["weight_versions"] for o in outs])
    landings, truth = [], {}
    for out in outs:
        spans = _spans(out)
        landed = spans[0][2] if len(spans) == 2 else 0  # 0: not scheduled yet when it landed
        landings.append(landed)
        assert spans == [("step-31", 0, landed), ("step-32", landed, tokens)][2 - len(spans):] and landed < tokens
        entries = out["meta_info"]["output_token_logprobs"]
        ids, lps = [int(t) for _, t, _ in entries], [float(lp) for lp, _, _ in entries]
        assert len(ids) == tokens
        if tuple(ids) not in truth:  # the copies are greedy: mostly the same tokens
            truth[tuple(ids)] = [reference_logprobs(tiny_model, w, [(PROMPTS[0], ids)])[0] for w in (old, new)]
        before, after = truth[tuple(ids)]
        assert landed == 0 or max_diff([lps[:landed]], [before[:landed]]) < TOL
        assert max_diff([lps[landed:]], [after[landed:]]) < TOL
    assert max(landings) > 0  # mid-request for some
    assert server.weight_versions() == [32]
    channels.close_channel(spec)


def test_a_refit_that_fails_in_flight_aborts_the_held_requests_and_pauses_nothing(
    server: Any, tiny_model: Path, specs: list[TensorSpec], tmp_path: Path
) -> None:
    """A tensor SGLang's loader refuses, after other buckets loaded: the request held
    meanwhile ends aborted with the old weights' tokens only (none from half-loaded ones),
    the server is no longer paused (a new request completes), and the engine refuses to
    sample until a good refit."""
    state = hf_state(tiny_model, seed=41)
    bad = dict(state)
    bad["model.norm.weight"] = state["model.norm.weight"][:-1].clone()
    order = [s.name for s in specs if s.name != "model.norm.weight"] + ["model.norm.weight"]
    buckets = plan_buckets([spec_of(n, bad[n]) for n in order], 256 * 1024)
    spec = channel("collective", tmp_path)
    open_both(server, spec)
    version = server.weight_versions()[0]
    flight = InFlight(server, PROMPTS[1], 400)
    with pytest.raises(RefitError, match="rejected refit step 42"):
        refit(server, spec, 42, bad, buckets)
    outs = flight.result()
    print("the held requests:", [(o["meta_info"]["finish_reason"], o["meta_info"]["weight_versions"]) for o in outs])
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert [v for v, _, _ in _spans(out)] == [f"step-{version}"] and len(out["meta_info"]["output_token_logprobs"]) < 400
    assert len(server_logprobs(server, PROBE)) == len(PROBE)  # served: not paused
    with pytest.raises(WorkerError, match="refuses to generate until a refit succeeds"):
        server.generate(PROMPTS, SamplingParams(1, 2, 1.0, 0))
    refit(server, spec, 43, state, plan_buckets(specs, 256 * 1024))
    assert max_diff(server.logprobs(PROBE), reference_logprobs(tiny_model, state, PROBE)) < TOL
    channels.close_channel(spec)


@pytest.mark.timeout(120)
def test_server_killed_mid_run_fails_the_next_call_fast(server: Any) -> None:
    """Last in the module: it kills the shared server."""
    info = ray.get(server.group.actors[0].endpoint_info.remote())
    os.killpg(info["pgid"], signal.SIGKILL)
    with pytest.raises(WorkerError, match="SGLang server .* is gone|SGLang server .* failed"):
        server.generate(PROMPTS, SamplingParams(1, 2, 1.0, 0))

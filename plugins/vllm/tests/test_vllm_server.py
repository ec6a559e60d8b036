"""Server mode (``serve_openai``): vLLM's OpenAI-compatible server in the worker.

The endpoint answers ``/v1/completions`` on 127.0.0.1 with the weights refit
loaded; shutting the handle down, or killing its worker, leaves no process behind.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
from vllm_helpers import PROMPTS, init_context, make_config, max_abs_diff

from rlcore.errors import CancelToken, WorkerError
from rlcore.handles import SamplingParams
from rlcore.refit.sessions import RefitSessions
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


def test_endpoint_serves_refit_weights_and_shutdown_leaves_nothing(
    ray_cluster: None, tiny_model: Path, policy: Any, tmp_path: Path
) -> None:
    gen, config, info = start_server(tiny_model, tmp_path)
    try:
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

        long_prompts = [[2] + [(5 * i + k) % 36 + 4 for i in range(199)] for k in range(2)]
        for step, (seed, transport) in enumerate([(None, "collective"), (7, "shared_memory")]):
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
            served = endpoint_logprobs(ep, probe)
            assert max_abs_diff(served, policy.logprobs(probe)) < TOL
            assert max_abs_diff(gen.logprobs(probe), served) < TOL
            again = gen.generate(long_prompts, SamplingParams(2, 3, 1.0, 9))
            batch = [
                (p, s["token_ids"]) for p, g in zip(long_prompts, again, strict=True) for s in g
            ]
            sampled = [s["logprobs"] for g in again for s in g]
            assert max_abs_diff(sampled, policy.logprobs(batch)) < TOL

        # Plain text prompts work too (the server has the checkpoint's tokenizer).
        out = post(
            ep.base_url + "/completions",
            {"model": ep.model, "prompt": "12+7=", "max_tokens": 4, "n": 2},
        )
        assert len(out["choices"]) == 2
        groups = gen.generate(PROMPTS, SamplingParams(2, 6, 1.0, 1))
        assert [len(g) for g in groups] == [2] * len(PROMPTS)
    finally:
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

"""Test-only helpers: a tiny model, an init context, and a fake policy that sends weights.

The fake policy (:class:`FakePolicy`) wraps a Hugging Face model in a small Ray
actor and implements :class:`rlcore.handles.RefitSender` with the core's channel
code; it exists only to drive the vllm backend's receiving side in tests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import ray

from rlcore.config import GenerationConfig, ModelConfig, RunConfig, SetupConfig
from rlcore.context import InitContext
from rlcore.declarations import Role
from rlcore.testing import fixtures
from rlcore_vllm.options import VLLMOptions

# Ray workers cannot import this module by name: ship the actor class by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPTS = [[2, 5, 17, 6, 9, 25], [2, 12, 7, 14, 20], [2, 30, 31, 8]]


def make_config(model_dir: Path, cache_dir: Path, workers: int = 1, **options: Any) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=str(model_dir)),
        generation=GenerationConfig(
            backend="vllm", refit_fed=True, workers=workers, options=dict(options)
        ),
        setup=SetupConfig(cache_dir=str(cache_dir)),
    )


def init_context(config: RunConfig, run_dir: Path, deadline_s: float = 300.0) -> InitContext:
    """An InitContext built as rlcore.setup.runner builds it for init:generation."""
    return fixtures.init_context(
        Role.GENERATION, "vllm", config, VLLMOptions, run_dir=run_dir, deadline_s=deadline_s
    )


class _PolicyActor:
    """Holds a Hugging Face model; sends its state_dict over rlcore refit channels."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def perturb(self, seed: int | None, scale: float = 0.02) -> None:
        """Reset to the checkpoint's weights, then add seeded noise (None: no noise)."""
        import torch

        gen = torch.Generator().manual_seed(seed or 0)
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                t.copy_(self.base[name])
                if seed is not None:
                    t.add_(scale * torch.randn(t.shape, generator=gen))

    def weight_specs(self) -> list[Any]:
        from rlcore.refit.specs import spec_of

        return [spec_of(n, t) for n, t in self.model.state_dict().items()]

    def refit_address(self) -> tuple[str, int]:
        from rlcore.runtime.addresses import free_port, node_ip

        return node_ip(), free_port()

    def open_refit_channel(self, spec: Any) -> None:
        from rlcore.refit import channels

        channels.open_channel(spec, 0)

    def send_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> int:
        from rlcore.refit import channels

        state = self.model.state_dict()
        names = [s.name for b in buckets for s in b]
        return channels.send_weights(spec, step, ((n, state[n]) for n in names), buckets)

    def logprobs(self, batch: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        import torch

        out = []
        with torch.no_grad():
            for prompt, completion in batch:
                ids = torch.tensor([list(prompt) + list(completion)])
                lp = torch.log_softmax(self.model(ids).logits[0].float(), -1)
                pos = range(len(prompt), ids.shape[1])
                out.append([float(lp[k - 1, ids[0, k]]) for k in pos])
        return out


class FakePolicy:
    """Driver-side RefitSender over one :class:`_PolicyActor` (test only).

    ``spec_tweak`` rewrites the specs it announces (mismatch tests); ``calls``
    records which channel methods ran.
    """

    device_type = "cpu"

    def __init__(self, model_dir: Path) -> None:
        self.actor = ray.remote(num_cpus=0)(_PolicyActor).remote(str(model_dir))
        self.spec_tweak: Any = None
        self.calls: list[str] = []

    def weight_specs(self) -> list[Any]:
        specs = ray.get(self.actor.weight_specs.remote())
        return self.spec_tweak(specs) if self.spec_tweak else specs

    def refit_address(self) -> tuple[str, int]:
        self.calls.append("refit_address")
        return ray.get(self.actor.refit_address.remote())

    def open_refit_channel(self, spec: Any) -> list[Any]:
        self.calls.append("open_refit_channel")
        return [self.actor.open_refit_channel.remote(spec)]

    def send_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        self.calls.append("send_weights")
        return [self.actor.send_weights.remote(spec, step, buckets)]

    def perturb(self, seed: int | None) -> None:
        ray.get(self.actor.perturb.remote(seed))

    def logprobs(self, batch: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        return ray.get(self.actor.logprobs.remote(batch))

    def shutdown(self) -> None:
        ray.kill(self.actor)


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def long_greedy(worker: Any, prompt: list[int], tokens: int, copies: int) -> list[tuple[list[int], list[float], list[tuple[str, int, int]]]]:
    """Run on an in-process VLLMWorker's actor (``__ray_call__``): ``copies`` greedy
    completions of ``prompt`` that ignore EOS, as a generate of the worker's own would run
    (through the worker's step gate, with its adapter where one is loaded); each
    ``(token ids, logprobs, weight version spans)``. A refit that fails half-way during it
    makes it raise, as the worker's generate does."""
    from vllm import SamplingParams as VLLMSampling

    params = VLLMSampling(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False)
    with worker._not_cut_by_refit():
        outs = worker.llm.generate(
            [{"prompt_token_ids": prompt}] * copies, params, use_tqdm=False, lora_request=worker.lora
        )
    return [
        (list(c.token_ids), [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs, strict=True)],
         [(s.version, s.start, s.end) for s in c.weight_versions or []])
        for o in outs for c in o.outputs
    ]


def engine_busy(worker: Any) -> int:
    """Run on an in-process VLLMWorker's actor, on its refit thread: the requests its engine
    holds, read between two steps (through the step gate, as a refit would)."""
    return int(worker.gate.run(worker.llm.llm_engine.get_num_unfinished_requests))


def in_flight(gen: Any, tokens: int, copies: int = 8) -> Any:
    """Long greedy completions on engine 0's default thread (a generate of its own), in
    flight once this returns: its step gate has seen the requests (no sleep, no timing)."""
    from rlcore.runtime.worker_group import REFIT_GROUP

    engine = gen.group.actors[0]
    running = engine.__ray_call__.remote(long_greedy, PROMPTS[0], tokens, copies)
    busy = engine.__ray_call__.options(concurrency_group=REFIT_GROUP)
    for _ in range(10_000):
        if ray.get(busy.remote(engine_busy), timeout=120):
            return running
    raise AssertionError("the requests never reached the engine")


def assert_landed_between_steps(
    outs: list[Any], before: list[list[float]], after: list[list[float]], old_step: int, new_step: int,
    tokens: int, tol: float,
) -> None:
    """Each completion of :func:`long_greedy` (``outs``) that a refit met in flight: its tokens
    up to the landing have the old weights' logprobs (``before``), the rest the new ones'
    (``after``), and vLLM's spans say where; at least one had tokens before the landing."""
    landings = []
    for (ids, lps, spans), old, new in zip(outs, before, after, strict=True):
        assert len(ids) == len(lps) == tokens
        landed = spans[0][2] if len(spans) == 2 else 0  # 0: not scheduled yet when it landed
        landings.append(landed)
        assert spans == [(f"step-{old_step}", 0, landed), (f"step-{new_step}", landed, tokens)][2 - len(spans):]
        assert landed == 0 or max_abs_diff([lps[:landed]], [old[:landed]]) < tol
        assert max_abs_diff([lps[landed:]], [new[landed:]]) < tol
    assert max(landings) > 0

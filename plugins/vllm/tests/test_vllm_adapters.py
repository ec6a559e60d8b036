"""LoRA adapters served in place (refit content ``adapters``, contract 2.6): a vLLM engine
(in-process, and vLLM's server) started through the real init hook with ``InitContext.adapters`` takes each
refit's adapters through vLLM's own LoRA loading and computes what peft computes with the
base model and those adapters. The test kit's peft model stands in for the policy
(:class:`rlcore.testing.adapters.PeftAdapters`, its adapters set by seed)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from vllm_helpers import (
    PROMPTS,
    assert_landed_between_steps,
    in_flight,
    init_context,
    make_config,
    max_abs_diff,
)

from rlcore.errors import CancelToken
from rlcore.handles import AdapterReceiver
from rlcore.refit.adapters import TRANSPORT
from rlcore.refit.sessions import RefitSessions
from rlcore.refit.sync import refit
from rlcore.setup.runner import refit_context
from rlcore.testing.adapters import CHECKED, PeftAdapters
from rlcore_vllm.plugin import rlcore_declare_backend, rlcore_init_generation

LORA = CHECKED
PROBE = [(p, [10, 11, 12, 13]) for p in PROMPTS]
TOL = 1e-4
_steps = itertools.count(1)


@pytest.fixture(scope="module", params=["in-process", "server"])
def setup(
    request: pytest.FixtureRequest, ray_cluster: None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-adapters")
    # refit_fed as the LoRA example sets it: with adapters the engine loads the base anyway.
    config = make_config(tiny_model, tmp / "cache", workers=1, serve_openai=request.param == "server")
    ctx = dataclasses.replace(init_context(config, tmp / "run"), adapters=LORA)
    gen = rlcore_init_generation(ctx)
    yield {"gen": gen, "config": config, "source": PeftAdapters(tiny_model), "mode": request.param}
    gen.shutdown()


def adapter_refit(setup: dict[str, Any]) -> Any:
    ctx = refit_context(
        setup["config"], step=next(_steps), transport="shared_memory", cancel=CancelToken(),
        sessions=RefitSessions(), content="adapters",
    )
    return refit(setup["source"], setup["gen"], ctx)


def test_vllm_declares_that_it_takes_adapters() -> None:
    assert rlcore_declare_backend().takes_adapters


def test_the_engine_starts_from_the_base_weights_and_serves_each_refits_adapters(setup: dict[str, Any]) -> None:
    gen, source = setup["gen"], setup["source"]
    assert isinstance(gen, AdapterReceiver)
    # Base weights from the checkpoint although the config is refit-fed: no refit yet.
    assert max_abs_diff(gen.logprobs(PROBE), source.logprobs(PROBE, base=True)) < TOL
    for seed in (1, 2):
        source.set_adapters(seed)
        report = adapter_refit(setup)
        want = source.logprobs(PROBE)
        assert max_abs_diff(want, source.logprobs(PROBE, base=True)) > 0.05  # the adapters matter
        assert max_abs_diff(gen.logprobs(PROBE), want) < TOL
        assert gen.weight_versions() == [report.step]
        tensors, _ = source.adapter_state()
        assert report.transport == TRANSPORT and report.path == "adapters"
        assert report.tensors == len(tensors) and report.bytes == sum(t.numel() * 4 for t in tensors.values())


def test_samples_are_drawn_with_the_adapters(setup: dict[str, Any]) -> None:
    from rlcore.handles import SamplingParams

    gen, source = setup["gen"], setup["source"]
    source.set_adapters(3)
    adapter_refit(setup)
    groups = gen.generate(PROMPTS, SamplingParams(2, 6, 1.0, 5))
    batch = [(p, s["token_ids"]) for p, g in zip(PROMPTS, groups, strict=True) for s in g]
    sampled = [s["logprobs"] for g in groups for s in g]
    assert max_abs_diff(sampled, source.logprobs(batch)) < TOL


def test_only_the_loaded_adapter_stays_on_disk(setup: dict[str, Any]) -> None:
    adapter_refit(setup)
    step = adapter_refit(setup).step

    def dirs(worker: Any) -> list[str]:  # local: pickled by value into the actor
        return sorted(p.name for p in worker.adapter_dirs.root.iterdir())

    assert ray.get(setup["gen"].group.actors[0].__ray_call__.remote(dirs)) == [f"step-{step}"]


def test_an_adapter_refit_lands_between_two_steps_of_a_generate_in_flight(setup: dict[str, Any]) -> None:
    """In-process, the adapter refit waits for no call either: it loads between two engine
    steps of a generate in flight, whose tokens up to the landing are the old adapter's and
    the rest the new one's, as vLLM's weight-version spans say."""
    if setup["mode"] != "in-process":
        pytest.skip("server mode holds its requests through the load (PAUSE): the in-process landing is tested")
    gen, source = setup["gen"], setup["source"]
    source.set_adapters(7)
    old_step = adapter_refit(setup).step
    source.set_adapters(8)
    tokens = 200
    running = in_flight(gen, tokens)
    new_step = adapter_refit(setup).step
    outs = ray.get(running, timeout=300)
    after = source.logprobs([(PROMPTS[0], ids) for ids, _, _ in outs])
    source.set_adapters(7)
    before = source.logprobs([(PROMPTS[0], ids) for ids, _, _ in outs])
    assert_landed_between_steps(outs, before, after, old_step, new_step, tokens, TOL)

"""Two in-process vLLM engines (data-parallel replicas), started refit-fed through the real
init hook and shared by the tests of this module: refit over each transport (a collective
channel of three ranks), spec mismatch, generation split over the engines, worker death."""

from __future__ import annotations

import itertools
import time
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

from rlcore.errors import CancelToken, RefitError, WorkerError
from rlcore.handles import SamplingParams
from rlcore.refit.channels import ChannelSpec
from rlcore.refit.sessions import RefitSessions
from rlcore.refit.specs import TensorSpec, plan_buckets
from rlcore.refit.sync import refit
from rlcore.setup.runner import refit_context
from rlcore_vllm.plugin import rlcore_init_generation

#: The refit channels of this module's handles (a run owns its sessions; so does this module).
SESSIONS = RefitSessions()

PROBE = [(p, [10, 11, 12, 13]) for p in PROMPTS]  # split 2 + 1 over the engines
TOL = 1e-4
_steps = itertools.count()


@pytest.fixture(scope="module")
def setup(
    ray_cluster: None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-engine")
    config = make_config(tiny_model, tmp / "cache", workers=2)
    t0 = time.monotonic()
    gen = rlcore_init_generation(init_context(config, tmp / "run"))
    start_s = time.monotonic() - t0
    yield {"gen": gen, "config": config, "start_s": start_s}
    gen.shutdown()


def do_refit(policy: Any, gen: Any, config: Any, transport: str) -> Any:
    ctx = refit_context(
        config, step=next(_steps), transport=transport, cancel=CancelToken(), sessions=SESSIONS
    )
    return refit(policy, gen, ctx)


def test_refit_fed_engine_starts_without_checkpoint_weights(
    setup: dict[str, Any], policy: Any
) -> None:
    gen = setup["gen"]
    assert gen.refit_ranks == 2 and gen.endpoint is None
    assert [s.name for s in gen.weight_specs()] == [s.name for s in policy.weight_specs()]
    # Dummy weights: nothing like the checkpoint until the first refit.
    assert max_abs_diff(gen.logprobs(PROBE), policy.logprobs(PROBE)) > 0.05


def engine_samples(gen: Any, params: SamplingParams) -> list[list[list[Any]]]:
    """Each engine's own samples, as vLLM reported them (past the worker base class, which
    would fill in versions an engine left out)."""

    def sample(worker: Any) -> Any:  # local: pickled by value into the actor
        return worker._generate(PROMPTS, params, [7] * len(PROMPTS))

    return ray.get([a.__ray_call__.remote(sample) for a in gen.group.actors], timeout=120)


def test_weight_versions_are_0_before_any_refit(setup: dict[str, Any]) -> None:
    """Before rlcore's first refit, the engines' own weight label is version 0, and vLLM's
    spans give every sampled token that version."""
    gen = setup["gen"]
    assert gen.weight_versions() == [0, 0]
    for engine in engine_samples(gen, SamplingParams(2, 4, 1.0, 0)):
        assert [s["versions"] for g in engine for s in g] == [[0] * len(s["token_ids"]) for g in engine for s in g]


def test_logprobs_compile_nothing_on_cpu(setup: dict[str, Any]) -> None:
    """With enforce_eager on CPU no engine compiles a graph, not even vLLM's logprob-rank
    helper, which inductor would otherwise compile inside the first logprobs request
    (seconds of C++ compilation on a run's first step)."""
    gen = setup["gen"]
    assert len(gen.logprobs(PROBE)) == len(PROBE)

    def _dynamo_stats(worker: Any) -> dict[str, int]:  # local: pickled by value into the actor
        import torch._dynamo.utils

        return dict(torch._dynamo.utils.counters["stats"])

    stats = ray.get([a.__ray_call__.remote(_dynamo_stats) for a in gen.group.actors], timeout=60)
    assert [s.get("unique_graphs", 0) for s in stats] == [0, 0], stats


@pytest.mark.parametrize("transport", ["collective", "disk", "shared_memory"])
def test_refit_loads_the_policy_weights(setup: dict[str, Any], policy: Any, transport: str) -> None:
    gen, config = setup["gen"], setup["config"]
    policy.perturb(None)
    report = do_refit(policy, gen, config, transport)
    assert report.transport == transport and report.tensors == len(gen.weight_specs())
    assert report.bytes == sum(s.nbytes for s in gen.weight_specs())
    original = gen.logprobs(PROBE)
    assert max_abs_diff(original, policy.logprobs(PROBE)) < TOL

    # New weights must really land: the engine follows the policy to perturbed weights.
    policy.perturb(seed=hash(transport) % 1000)
    do_refit(policy, gen, config, transport)
    perturbed = gen.logprobs(PROBE)
    assert max_abs_diff(perturbed, policy.logprobs(PROBE)) < TOL
    assert max_abs_diff(perturbed, original) > 1e-2


@pytest.mark.parametrize(
    "tweak",
    [
        pytest.param(
            lambda s: [TensorSpec(x.name.replace("q_proj", "query"), x.shape, x.dtype) for x in s],
            id="name",
        ),
        pytest.param(
            lambda s: [TensorSpec(x.name, (x.shape[0] + 1, *x.shape[1:]), x.dtype) for x in s],
            id="shape",
        ),
    ],
)
def test_mismatched_specs_are_refused_before_sending(
    setup: dict[str, Any], policy: Any, tweak: Any
) -> None:
    gen, config = setup["gen"], setup["config"]
    policy.perturb(None)
    do_refit(policy, gen, config, "shared_memory")
    before = gen.logprobs(PROBE)
    policy.perturb(seed=99)
    policy.spec_tweak, policy.calls = tweak, []
    try:
        with pytest.raises(RefitError, match="refused before writing anything"):
            do_refit(policy, gen, config, "collective")
    finally:
        policy.spec_tweak = None
    assert policy.calls == []  # no channel opened, nothing sent
    assert gen.logprobs(PROBE) == before


def test_generate_returns_samples_with_matching_logprobs(
    setup: dict[str, Any], policy: Any
) -> None:
    gen, config = setup["gen"], setup["config"]
    policy.perturb(None)
    do_refit(policy, gen, config, "shared_memory")
    t0 = time.monotonic()
    groups = gen.generate(PROMPTS, SamplingParams(4, 8, 1.0, 5))
    gen_s = time.monotonic() - t0
    assert len(groups) == len(PROMPTS) and all(len(g) == 4 for g in groups)
    for g in groups:
        for s in g:
            assert 1 <= len(s["token_ids"]) <= 8 and len(s["logprobs"]) == len(s["token_ids"])
            assert all(lp <= 0.0 for lp in s["logprobs"])
    batch = [(p, s["token_ids"]) for p, g in zip(PROMPTS, groups, strict=True) for s in g]
    sampled = [s["logprobs"] for g in groups for s in g]
    assert max_abs_diff(sampled, gen.logprobs(batch)) < TOL
    assert max_abs_diff(sampled, policy.logprobs(batch)) < TOL
    # Seeded: the same call gives the same samples; another seed gives others.
    assert gen.generate(PROMPTS, SamplingParams(4, 8, 1.0, 5)) == groups
    assert gen.generate(PROMPTS, SamplingParams(4, 8, 1.0, 6)) != groups
    assert len({tuple(s["token_ids"]) for s in groups[0]}) > 1
    # Seeds follow the prompt's index, not the engine serving it: with two prompts,
    # prompt 1 moves from engine 0 to engine 1 and still gets the same samples.
    assert gen.generate(PROMPTS[:2], SamplingParams(4, 8, 1.0, 5)) == groups[:2]
    print(
        f"vllm in-process: start {setup['start_s']:.1f}s, generate 3x4x8 tokens {gen_s * 1e3:.0f} ms"
    )


def test_weight_versions_follow_the_refits(setup: dict[str, Any], policy: Any) -> None:
    """After the refit of step t every engine holds version t, and vLLM's spans give every
    token it samples version t."""
    gen, config = setup["gen"], setup["config"]
    policy.perturb(None)
    step = do_refit(policy, gen, config, "shared_memory").step
    assert step > 0 and gen.weight_versions() == [step, step]
    for engine in engine_samples(gen, SamplingParams(2, 4, 1.0, 0)):
        assert {v for g in engine for s in g for v in s["versions"]} == {step}
    groups = gen.generate(PROMPTS, SamplingParams(2, 4, 1.0, 0))
    assert [s["versions"] for g in groups for s in g] == [[step] * len(s["token_ids"]) for g in groups for s in g]


def test_refit_invalidates_cached_prompts(setup: dict[str, Any], policy: Any) -> None:
    """Prompt KV cached under the old weights must not be reused after a refit
    (prefix caching keeps full blocks, 128 tokens on CPU: hence long prompts)."""
    gen, config = setup["gen"], setup["config"]
    long_prompts = [[2] + [(7 * i + k) % 36 + 4 for i in range(299)] for k in range(2)]
    policy.perturb(None)
    do_refit(policy, gen, config, "shared_memory")
    gen.generate(long_prompts, SamplingParams(2, 4, 1.0, 5))
    policy.perturb(seed=11)
    do_refit(policy, gen, config, "collective")
    again = gen.generate(long_prompts, SamplingParams(2, 4, 1.0, 5))
    batch = [(p, s["token_ids"]) for p, g in zip(long_prompts, again, strict=True) for s in g]
    assert max_abs_diff([s["logprobs"] for g in again for s in g], policy.logprobs(batch)) < TOL


def test_failed_refit_blocks_generation_until_a_good_one(
    setup: dict[str, Any], policy: Any, tmp_path: Path
) -> None:
    gen, config = setup["gen"], setup["config"]
    # A file channel whose step never gets published: the receive times out inside
    # vLLM's weight update, after the layers were prepared for reloading.
    spec = ChannelSpec(
        "shared_memory", "never-published", 1 + gen.refit_ranks, root=str(tmp_path), timeout_s=1.0
    )
    ray.get(gen.open_refit_channel(spec))
    buckets = plan_buckets(gen.weight_specs(), 2**20)
    with pytest.raises(ray.exceptions.RayTaskError, match="never-published"):
        ray.get(gen.receive_weights(spec, 123, buckets))
    with pytest.raises(WorkerError, match="refuses to generate"):
        gen.logprobs(PROBE)
    policy.perturb(None)
    do_refit(policy, gen, config, "disk")
    assert max_abs_diff(gen.logprobs(PROBE), policy.logprobs(PROBE)) < TOL




def test_a_refit_lands_between_two_steps_of_a_generate_in_flight(setup: dict[str, Any], policy: Any) -> None:
    """The refit waits for no call: it loads between two engine steps of engine 0's
    generate, whose requests are preempted and go on with the new weights. Their tokens up
    to the landing are the old weights' (greedy; logprobs the policy's), the rest the new
    ones' from the first token on, and vLLM's spans say where."""
    gen, config = setup["gen"], setup["config"]
    policy.perturb(5)
    old_step = do_refit(policy, gen, config, "collective").step
    policy.perturb(6)  # sent by the next refit
    tokens = 400
    running = in_flight(gen, tokens)
    new_step = do_refit(policy, gen, config, "collective").step
    outs = ray.get(running, timeout=300)
    print("weight versions of the requests in flight:", [spans for _, _, spans in outs])
    after = policy.logprobs([(PROMPTS[0], ids) for ids, _, _ in outs])
    policy.perturb(5)
    before = policy.logprobs([(PROMPTS[0], ids) for ids, _, _ in outs])
    assert_landed_between_steps(outs, before, after, old_step, new_step, tokens, TOL)


def test_a_refit_that_fails_between_steps_aborts_the_call_in_flight(
    setup: dict[str, Any], policy: Any, tmp_path: Path
) -> None:
    """A file channel whose step never comes: the update fails between two steps of a
    generate in flight. Its requests are aborted and the call fails (none of its samples
    mixes weights); the engine refuses to sample until a good refit."""
    gen, config = setup["gen"], setup["config"]
    spec = ChannelSpec("shared_memory", "never-in-flight", 1 + gen.refit_ranks, root=str(tmp_path), timeout_s=1.0)
    ray.get(gen.open_refit_channel(spec))
    running = in_flight(gen, 400)
    with pytest.raises(ray.exceptions.RayTaskError, match="gave up waiting for artifact"):
        ray.get(gen.receive_weights(spec, 321, plan_buckets(gen.weight_specs(), 2**20)))
    with pytest.raises(ray.exceptions.RayTaskError, match="a refit failed half-way during this call"):
        ray.get(running, timeout=300)
    with pytest.raises(WorkerError, match="refuses to generate"):
        gen.logprobs(PROBE)
    policy.perturb(None)
    do_refit(policy, gen, config, "disk")
    assert max_abs_diff(gen.logprobs(PROBE), policy.logprobs(PROBE)) < TOL


def test_killed_worker_fails_the_next_call_fast(setup: dict[str, Any]) -> None:
    """Runs last in this module: it kills the shared engine."""
    gen = setup["gen"]
    ray.kill(gen.group.actors[0], no_restart=True)
    # The dead engine is named (WorkerError) instead of the call waiting out its 900 s timeout.
    with pytest.raises(WorkerError, match="vllm-generation"):
        gen.generate(PROMPTS, SamplingParams(1, 2, 1.0, 0))
    gen.shutdown()
    gen.shutdown()  # idempotent

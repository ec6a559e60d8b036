"""megatron-core's dynamic engine behind ``MegatronGenerationWorker`` (one CUDA device).

GPU only (``-m gpu``; skipped without CUDA, never in CI): a float32 TP=1 policy and
a refit-fed generation in one process, fed over the disk transport. The dynamic
engine must return what the static engine returns for the same weights (greedy
tokens), logprobs equal to the policy's, the same samples for the same seed,
never a padded-vocabulary token, samples cut after their end-of-sequence token,
and nothing of the previous weights after a refit. A refit sent while a generate
samples lands between two engine steps (issue 30): the requests go on with the new
weights, each token carrying its version and the logprob its weights give; one that
fails half-way fails that call, and the engine serves again after the next refit.

    PYTHONPATH=.:plugins/megatron python -m pytest plugins/megatron/tests/test_megatron_dynamic_gpu.py -m gpu
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _megatron_helpers import llama_config

from rlcore.handles import SamplingParams
from rlcore.testing.reference import max_diff

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VOCAB = 1000  # padded to 1024
EOS = 2
PROMPTS = [[1, 5, 6, 7], [1, 11], [1, 30, 31, 32, 33, 34, 35], [1, 900]]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    from rlcore.runtime.addresses import free_port
    from rlcore_megatron.options import MegatronOptions
    from rlcore_megatron.worker import MegatronGenerationWorker, MegatronPolicyWorker

    model_dir = tmp_path_factory.mktemp("llama")
    (model_dir / "config.json").write_text(json.dumps(llama_config()))
    policy = MegatronPolicyWorker(0, 1)
    policy.init_process_group("127.0.0.1", free_port(), "nccl", 120.0)
    gen = MegatronGenerationWorker(0, 1)  # shares the process group and the parallel state
    try:
        policy.load(str(model_dir), "float32", MegatronOptions(seed=3), "cuda", random_init=True)
        with torch.no_grad():  # livelier logits than the default init: fewer near-ties
            for p in policy.model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.08)
        info = gen.start(
            str(model_dir),
            "float32",
            MegatronOptions(max_batch_size=6, max_sequence_length=96, seed=3),
            "cuda",
        )
        yield policy, gen, info, tmp_path_factory.mktemp("refit")
    finally:
        gen.teardown()
        policy.teardown()


def refit(policy, gen, root: Path, step: int) -> None:  # type: ignore[no-untyped-def]
    spec, buckets = _send(policy, root, step)
    gen.receive_weights(spec, step, buckets)


def static_greedy(gen, prompts: list[list[int]], tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The static engine over the generation's model, for comparison."""
    from rlcore_megatron.inference import build_static_engine

    static = build_static_engine(
        gen.model,
        gen.engine.controller.tokenizer,
        gen.spec,
        tp=gen.tp_size,
        make_vocab_size_divisible_by=gen.divisible,
        max_batch_size=8,
        max_sequence_length=96,
    )
    saved = gen.engine, gen.engine_kind
    gen.engine, gen.engine_kind = static, "static"
    try:
        return [g[0]["token_ids"] for g in gen.generate(prompts, SamplingParams(1, tokens, 0.0, 0))]
    finally:
        gen.engine, gen.engine_kind = saved


def test_engine_is_dynamic_on_cuda(workers: tuple) -> None:
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    _, gen, info, _ = workers
    assert info["engine"] == "dynamic" == gen.engine_kind
    assert isinstance(gen.engine, DynamicInferenceEngine)


def test_greedy_matches_the_static_engine_and_logprobs_the_policy(workers: tuple) -> None:
    policy, gen, _, root = workers
    refit(policy, gen, root, 1)
    out = gen.generate(PROMPTS, SamplingParams(1, 12, 0.0, 0))
    greedy = [g[0]["token_ids"] for g in out]
    assert greedy == static_greedy(gen, PROMPTS, 12)
    rows = [(p, ids) for p, ids in zip(PROMPTS, greedy, strict=True)]
    assert max_diff([g[0]["logprobs"] for g in out], policy.logprobs(rows)) < 1e-4


def test_samples_are_seeded_in_vocabulary_and_scored_like_the_policy(workers: tuple) -> None:
    policy, gen, _, root = workers
    refit(policy, gen, root, 2)
    head = dict(gen.model.named_parameters())["output_layer.weight"]
    assert head.shape[0] == 1024 > VOCAB
    with torch.no_grad():
        head[VOCAB:] = 50.0  # unmasked, the padded rows would win every draw
    try:
        # 8 requests through a 6-request engine: the last ones wait for a slot.
        out = gen.generate(PROMPTS, SamplingParams(2, 10, 1.0, 7))
        assert [len(g) for g in out] == [2] * len(PROMPTS)
        assert gen.generate(PROMPTS, SamplingParams(2, 10, 1.0, 7)) == out
        assert gen.generate(PROMPTS, SamplingParams(2, 10, 1.0, 8)) != out
        rows = [(p, s["token_ids"]) for p, g in zip(PROMPTS, out, strict=True) for s in g]
        assert all(0 <= t < VOCAB for _, ids in rows for t in ids)
        assert all(EOS not in ids[:-1] and 1 <= len(ids) <= 10 for _, ids in rows)
        lps = [s["logprobs"] for g in out for s in g]
        assert [len(x) for x in lps] == [len(ids) for _, ids in rows]
        assert max_diff(lps, policy.logprobs(rows)) < 1e-4
    finally:
        with torch.no_grad():
            head[VOCAB:] = 0.0


def test_a_sample_ends_at_end_of_sequence_which_is_kept(workers: tuple) -> None:
    policy, gen, _, root = workers
    refit(policy, gen, root, 3)
    first = gen.generate(PROMPTS[:1], SamplingParams(1, 8, 0.0, 0))[0][0]["token_ids"][0]
    head = dict(gen.model.named_parameters())["output_layer.weight"]
    saved = head[EOS].clone()
    with torch.no_grad():
        head[EOS] = 3.0 * head[first]  # 3x the (positive) winning logit of prompt 0's first step
    try:
        out = gen.generate(PROMPTS, SamplingParams(1, 8, 0.0, 0))
        assert out[0][0]["token_ids"] == [EOS] and len(out[0][0]["logprobs"]) == 1
        for g in out:
            ids = g[0]["token_ids"]
            assert EOS not in ids[:-1] and len(g[0]["logprobs"]) == len(ids)
    finally:
        with torch.no_grad():
            head[EOS] = saved


def test_a_refit_leaves_no_request_or_kv_block_behind(workers: tuple) -> None:
    policy, gen, _, root = workers
    refit(policy, gen, root, 4)
    before = [g[0]["token_ids"] for g in gen.generate(PROMPTS, SamplingParams(1, 12, 0.0, 0))]
    batch = [(p, [3, 4, 5]) for p in PROMPTS]
    policy.train_step(batch, [1.0, -1.0, 0.5, -0.5], None, 0.2, 5e-2)
    refit(policy, gen, root, 5)
    context = gen.engine.context
    assert context.total_request_count == 0 and not gen.engine.requests
    assert context.block_allocator.total_avail == context.block_allocator.total_count - 1
    after = gen.generate(PROMPTS, SamplingParams(1, 12, 0.0, 0))
    greedy = [g[0]["token_ids"] for g in after]
    assert greedy == static_greedy(gen, PROMPTS, 12)
    assert greedy != before  # the new weights are the ones served
    rows = [(p, ids) for p, ids in zip(PROMPTS, greedy, strict=True)]
    assert max_diff([g[0]["logprobs"] for g in after], policy.logprobs(rows)) < 1e-4


def test_too_long_a_request_is_refused_and_the_engine_still_serves(workers: tuple) -> None:
    policy, gen, _, root = workers
    refit(policy, gen, root, 6)
    with pytest.raises(ValueError, match="max_sequence_length"):
        gen.generate([[1] * 90], SamplingParams(1, 10, 0.0, 0))
    assert len(gen.generate(PROMPTS, SamplingParams(1, 4, 0.0, 0))) == len(PROMPTS)


# -- Refits in flight (issue 30): landing between two engine steps ------------------------------


def _sample_in_background(gen, prompts, params):  # type: ignore[no-untyped-def]
    import threading

    out: list = []
    call = threading.Thread(target=lambda: out.append(_capture(lambda: gen.generate(prompts, params))), daemon=True)
    call.start()
    return call, out


def _capture(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except BaseException as err:  # handed to the test's thread
        return err


def _send(policy, root: Path, step: int):  # type: ignore[no-untyped-def]
    from rlcore.refit.channels import ChannelSpec
    from rlcore.refit.specs import plan_buckets

    spec = ChannelSpec("disk", "dynamic-gpu", 2, root=str(root), timeout_s=60)
    buckets = plan_buckets(policy.weight_specs(), 1 << 20)
    policy.send_weights(spec, step, buckets)
    return spec, buckets


def _once_sampling(gen, steps: int = 4) -> None:  # type: ignore[no-untyped-def]
    from rlcore.testing.waits import wait_for

    assert wait_for(lambda: gen.engine.step_count >= steps, timeout_s=60)


def test_a_refit_lands_between_engine_steps_and_each_token_carries_its_version(workers: tuple) -> None:
    """A refit sent while a generate samples (the refit thread of an in-flight worker: here
    the test's thread) lands between two engine steps: the requests in flight go on with
    the new weights (their KV computed again), each token says which weights sampled it,
    and its logprob is the one those weights give."""
    policy, gen, _, root = workers
    refit(policy, gen, root, 10)
    old = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy.train_step([(p, [3, 4, 5]) for p in PROMPTS], [1.0, -1.0, 0.5, -0.5], None, 0.2, 5e-2)
    spec, buckets = _send(policy, root, 11)
    params = SamplingParams(3, 40, 1.0, 5)  # 12 requests through 6 slots, 40 tokens each
    call, out = _sample_in_background(gen, PROMPTS, params)
    _once_sampling(gen)
    gen.receive_weights(spec, 11, buckets)  # returns once landed
    call.join(120)
    assert not isinstance(out[0], BaseException), out[0]
    samples = [s for g in out[0] for s in g]
    versions = [s["versions"] for s in samples]
    assert all(v == sorted(v) and set(v) <= {10, 11} and len(v) == len(s["token_ids"]) for v, s in zip(versions, samples, strict=True))
    assert any(10 in v and 11 in v for v in versions), versions  # landed mid-sample
    assert any(set(v) == {11} for v in versions)  # requests still waiting started on the new ones
    assert gen.loaded_version == 11 == gen.weight_version()
    rows = [(p, s["token_ids"]) for p, g in zip(PROMPTS, out[0], strict=True) for s in g]
    scored_new = policy.logprobs(rows)
    now = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            p.copy_(old[n])
        scored_old = policy.logprobs(rows)
        for n, p in policy.model.named_parameters():
            p.copy_(now[n])
    gap = [abs(a - (o if v == 10 else w)) for s, o_row, w_row in zip(samples, scored_old, scored_new, strict=True)
           for a, v, o, w in zip(s["logprobs"], s["versions"], o_row, w_row, strict=True)]
    assert max(gap) < 1e-4, max(gap)
    # The versions matter: the two weights score the same tokens differently.
    assert max(abs(o - w) for o_row, w_row in zip(scored_old, scored_new, strict=True) for o, w in zip(o_row, w_row, strict=True)) > 1e-2


def test_a_refit_failing_in_flight_fails_that_call_and_the_next_refit_serves(
    workers: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half-loaded weights never sample: the call in flight fails naming the refit, the
    engine refuses to serve until a refit succeeds, then serves as before."""
    from rlcore.errors import NotServingError
    from rlcore_megatron import convert

    policy, gen, _, root = workers
    refit(policy, gen, root, 20)
    spec, buckets = _send(policy, root, 21)
    real = convert.load_hf_stream

    def half_way(model, stream, *args, **kwargs):  # type: ignore[no-untyped-def]
        next(iter(stream))
        raise RuntimeError("injected: load failed after one tensor")

    monkeypatch.setattr(convert, "load_hf_stream", half_way)
    call, out = _sample_in_background(gen, PROMPTS, SamplingParams(3, 40, 1.0, 5))
    _once_sampling(gen)
    with pytest.raises(RuntimeError, match="injected"):
        gen.receive_weights(spec, 21, buckets)
    call.join(120)
    assert isinstance(out[0], RuntimeError) and "a refit failed half-way" in str(out[0]), out[0]
    assert not gen.engine.has_unfinished_requests()
    with pytest.raises(NotServingError, match="did not complete"):
        gen.generate(PROMPTS, SamplingParams(1, 4, 0.0, 0))
    monkeypatch.setattr(convert, "load_hf_stream", real)
    refit(policy, gen, root, 22)
    out = gen.generate(PROMPTS, SamplingParams(1, 12, 0.0, 0))
    assert [g[0]["versions"] for g in out] == [[22] * len(g[0]["token_ids"]) for g in out]
    rows = [(p, g[0]["token_ids"]) for p, g in zip(PROMPTS, out, strict=True)]
    assert max_diff([g[0]["logprobs"] for g in out], policy.logprobs(rows)) < 1e-4


def test_sleep_and_wake_leave_what_the_engine_samples_unchanged(workers: tuple) -> None:
    """A colocated engine sleeps and wakes every step (megatron-core's ``suspend`` /
    ``resume``): after it, the same call samples what it sampled before. Without pointing the
    controller at the metadata ``resume`` allocated, it took its termination ids from a stale
    tensor (zeros, from the reset before the sleep), so a sampled token 0 ended its sample (a
    resumed run then sampled otherwise than one never stopped)."""
    policy, gen, _, root = workers
    refit(policy, gen, root, 20)
    params = SamplingParams(8, 32, 1.0, 5)
    before = gen.generate(PROMPTS, params)
    gen.sleep()
    gen.wake()
    controller, context = gen.engine.controller, gen.engine.context
    assert controller._request_metadata["termination_id"] is context.request_metadata["termination_id"]
    assert gen.generate(PROMPTS, params) == before

"""megatron-core's dynamic engine behind ``MegatronGenerationWorker`` (one CUDA device).

GPU only (``-m gpu``; skipped without CUDA, never in CI): a float32 TP=1 policy and
a refit-fed generation in one process, fed over the disk transport. The dynamic
engine must return what the static engine returns for the same weights (greedy
tokens), logprobs equal to the policy's, the same samples for the same seed,
never a padded-vocabulary token, samples cut after their end-of-sequence token,
and nothing of the previous weights after a refit.

    PYTHONPATH=.:plugins/megatron python -m pytest plugins/megatron/tests/test_megatron_dynamic_gpu.py -m gpu
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


def llama_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "pad_token_id": 0,
    }


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
    from rlcore.refit.channels import ChannelSpec
    from rlcore.refit.specs import plan_buckets

    spec = ChannelSpec("disk", "dynamic-gpu", 2, root=str(root), timeout_s=60)
    buckets = plan_buckets(policy.weight_specs(), 1 << 20)
    policy.send_weights(spec, step, buckets)
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

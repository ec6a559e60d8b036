"""The Megatron workers in this process (no Ray): one policy and one generation rank, TP=1.

Both share this process's torch.distributed group (world size 1, gloo) and
megatron-core parallel state, as two workers of one process may. References are
plain transformers, one unpadded row at a time. Ray, tensor parallelism and the
init hooks are tested in ``test_megatron_ray.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _megatron_helpers import (
    BATCH,
    LR,
    check_logprobs,
    check_on_policy_step,
    check_train_step,
    hf_model,
    in_process_policy,
    max_diff,
    reference_logprobs,
)

from rlcore.errors import NotServingError
from rlcore.handles import SamplingParams
from rlcore.refit.channels import ChannelSpec
from rlcore.refit.specs import plan_buckets, spec_of
from rlcore_megatron import convert
from rlcore_megatron.options import MegatronOptions
from rlcore_megatron.worker import MegatronGenerationWorker, MegatronPolicyWorker, shard_range

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's own

OPTIONS = MegatronOptions(micro_batch_size=2)  # 5 rows: three micro-batches


@pytest.fixture(scope="module")
def policy(llama_dir: Path) -> Iterator[MegatronPolicyWorker]:
    with in_process_policy(llama_dir, OPTIONS) as w:
        yield w


@pytest.fixture(scope="module")
def generation(policy: MegatronPolicyWorker, llama_dir: Path) -> MegatronGenerationWorker:
    g = MegatronGenerationWorker(0, 1)  # shares the policy's process group and parallel state
    g.start(str(llama_dir), "float32", MegatronOptions(max_batch_size=16))
    return g


def refit(
    policy: MegatronPolicyWorker, generation: MegatronGenerationWorker, root: Path, step: int
) -> None:
    """Policy -> generation over the disk transport, in this process."""
    spec = ChannelSpec("disk", "workers-test", 2, root=str(root), timeout_s=30)
    buckets = plan_buckets(policy.weight_specs(), 100_000)
    policy.send_weights(spec, step, buckets)
    generation.receive_weights(spec, step, buckets)


def test_sharding() -> None:
    for n in range(9):
        for parts in (1, 2, 3):
            ranges = [shard_range(n, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_policy_logprobs_match_transformers(policy: MegatronPolicyWorker, llama_dir: Path) -> None:
    check_logprobs(policy, llama_dir)


def test_export_is_the_hf_state_dict_in_spec_order(
    policy: MegatronPolicyWorker, llama_dir: Path
) -> None:
    stream = list(policy.export_stream())
    want = hf_model(llama_dir).state_dict()
    assert [n for n, _ in stream] == [s.name for s in policy.weight_specs()]
    assert sorted(want) == sorted(n for n, _ in stream)
    assert all(torch.equal(t, want[n]) for n, t in stream)
    assert policy.weight_specs() == [spec_of(n, t) for n, t in stream]


def test_train_step_matches_reference(policy: MegatronPolicyWorker, llama_dir: Path) -> None:
    # AdamW moves every element by about lr whatever its gradient's size, so an element
    # whose gradient is ~1e-8 (at Adam's eps) turns float-rounding differences between
    # Megatron's and transformers' kernels into a visible share of one step: bound the
    # difference by 2% of the step (lr), not by an absolute number (with transformers
    # 5.19, 1 element in 65,536 of layers.1.mlp.down_proj differed by 1.2e-5 at lr 1e-3).
    check_train_step(policy, llama_dir, weight_atol=0.02 * LR)


def test_on_policy_step_without_old_logprobs(policy: MegatronPolicyWorker) -> None:
    check_on_policy_step(policy)


def test_refit_fed_generation_serves_only_after_refit(
    policy: MegatronPolicyWorker, generation: MegatronGenerationWorker, tmp_path: Path
) -> None:
    assert generation.weight_specs() == policy.weight_specs()
    with pytest.raises(NotServingError, match="no weights yet"):
        generation.generate([[2, 5]], SamplingParams(1, 2, 1.0, 0))
    assert generation.weight_version() == 0
    refit(policy, generation, tmp_path, 1)
    assert max_diff(generation.logprobs(BATCH), policy.logprobs(BATCH)) < 1e-6
    assert generation.weight_version() == 1


def test_generate_samples_and_logprobs(
    policy: MegatronPolicyWorker,
    generation: MegatronGenerationWorker,
    tmp_path: Path,
    llama_dir: Path,
) -> None:
    refit(policy, generation, tmp_path, 2)
    prompts = [[2, 5, 6], [2, 11], [2, 30, 31, 32]]
    out = generation.generate(prompts, SamplingParams(4, 6, 1.0, 7))
    assert [len(g) for g in out] == [4, 4, 4]
    eos = 3  # </s> of the tiny tokenizer
    for group in out:
        for s in group:
            ids = s["token_ids"]
            assert 1 <= len(ids) <= 6 and len(s["logprobs"]) == len(ids)
            assert all(0 <= t < policy.spec.vocab_size for t in ids)
            assert eos not in ids[:-1]  # cut after the first end-of-sequence, which is kept
            assert s["versions"] == [2] * len(ids)  # every token sampled by refit 2's weights
    rows = [(p, s["token_ids"]) for p, g in zip(prompts, out, strict=True) for s in g]
    assert max_diff([s["logprobs"] for g in out for s in g], policy.logprobs(rows)) < 1e-5
    assert generation.generate(prompts, SamplingParams(4, 6, 1.0, 7)) == out  # same seed, same samples
    assert generation.generate(prompts, SamplingParams(4, 6, 1.0, 8)) != out
    # Greedy is transformers' greedy continuation of the same weights.
    greedy = generation.generate(prompts[:1], SamplingParams(1, 6, 0.0, 0))[0][0]["token_ids"]
    ref = hf_model(llama_dir, policy.export_state_dict())
    want = ref.generate(
        torch.tensor([prompts[0]]),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )[0, len(prompts[0]) :].tolist()
    assert greedy == want


def test_padded_vocabulary_is_never_sampled(
    policy: MegatronPolicyWorker, generation: MegatronGenerationWorker, tmp_path: Path
) -> None:
    """Give the padded rows of the output layer huge logits: unmasked, they would win."""
    refit(policy, generation, tmp_path, 3)
    vocab = generation.spec.vocab_size
    head = dict(generation.model.named_parameters())["output_layer.weight"]
    assert head.shape[0] == 128 > vocab  # padded to make_vocab_size_divisible_by
    with torch.no_grad():
        head[vocab:] = 50.0
    try:
        out = generation.generate([[2, 5, 6], [2, 11]], SamplingParams(8, 4, 1.0, 3))
        rows = [
            (p, s["token_ids"]) for p, g in zip([[2, 5, 6], [2, 11]], out, strict=True) for s in g
        ]
        assert all(t < vocab for _, ids in rows for t in ids)
        assert max_diff([s["logprobs"] for g in out for s in g], policy.logprobs(rows)) < 1e-5
        assert max_diff(generation.logprobs(BATCH), policy.logprobs(BATCH)) < 1e-6
    finally:
        with torch.no_grad():
            head[vocab:] = 0.0


def test_failed_refit_blocks_serving_until_a_good_one(
    policy: MegatronPolicyWorker, generation: MegatronGenerationWorker, tmp_path: Path
) -> None:
    spec = ChannelSpec("disk", "workers-test-bad", 2, root=str(tmp_path), timeout_s=30)
    buckets = plan_buckets(policy.weight_specs(), 100_000)
    assert len(buckets) > 2
    version = generation.weight_version()
    policy.send_weights(spec, 4, buckets)
    last = tmp_path / spec.key / "step-000004" / f"bucket-{len(buckets) - 1:05d}.safetensors"
    last.write_bytes(b"\0" * last.stat().st_size)  # same size (still "complete"), garbage
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error type
        generation.receive_weights(spec, 4, buckets)
    with pytest.raises(NotServingError, match="refit step 4 over disk did not complete"):
        generation.generate([[2, 5]], SamplingParams(1, 2, 1.0, 0))
    assert generation.weight_version() == version  # a failed refit's step is never reported
    refit(policy, generation, tmp_path, 5)
    assert max_diff(generation.logprobs(BATCH), policy.logprobs(BATCH)) < 1e-6
    assert generation.weight_version() == 5


def test_stream_with_unknown_or_missing_names_is_refused(
    policy: MegatronPolicyWorker, generation: MegatronGenerationWorker
) -> None:
    stream = list(policy.export_stream())
    with pytest.raises(convert.ConversionError, match="ended before"):
        convert.load_hf_stream(generation.model, iter(stream[:-3]), generation.spec)
    with pytest.raises(convert.ConversionError, match="does not have"):
        convert.load_hf_stream(
            generation.model, iter([*stream, ("extra.weight", torch.zeros(1))]), generation.spec
        )


def test_tied_embeddings_send_and_accept_the_alias(
    policy: MegatronPolicyWorker, qwen2_dir: Path
) -> None:
    """Qwen2 with tied embeddings: lm_head.weight travels (as in the HF state_dict)."""
    other = MegatronPolicyWorker(0, 1)  # shares the process group; no teardown
    other.load(str(qwen2_dir), "float32", OPTIONS)
    ref = hf_model(qwen2_dir)
    specs = other.weight_specs()
    assert specs[-1].name == "lm_head.weight"
    stream = dict(other.export_stream())
    assert sorted(stream) == sorted(ref.state_dict())
    assert all(torch.equal(t, ref.state_dict()[n]) for n, t in stream.items())
    assert max_diff(other.logprobs(BATCH), reference_logprobs(ref, BATCH)) < 1e-5
    gen = MegatronGenerationWorker(0, 1)
    gen.start(str(qwen2_dir), "float32", MegatronOptions(max_batch_size=4))
    assert gen.weight_specs() == specs
    convert.load_hf_stream(gen.model, iter(stream.items()), gen.spec)
    gen.serving = True
    assert max_diff(gen.logprobs(BATCH), other.logprobs(BATCH)) < 1e-6


def test_bfloat16_export_matches_its_specs(policy: MegatronPolicyWorker, llama_dir: Path) -> None:
    """megatron-core keeps norm weights in float32: the export casts them to the run's
    dtype, or the refit's byte plan (from the specs) would not match what is sent."""
    other = MegatronPolicyWorker(0, 1)  # shares the process group; no teardown
    other.load(str(llama_dir), "bfloat16", OPTIONS)
    assert any(p.dtype == torch.float32 for p in other.model.parameters())  # the norms
    stream = list(other.export_stream())
    assert other.weight_specs() == [spec_of(n, t) for n, t in stream]
    want = hf_model(llama_dir).to(torch.bfloat16).state_dict()
    assert all(torch.equal(t, want[n]) for n, t in stream)

"""The dynamic engine's fast decode path on one CUDA device: FlexAttention over the paged KV
cache and CUDA graphs of the decoder (issue 43) against the old path (torch paged attention,
every step eager) on the same model and requests.

GPU only (``-m gpu``). Requests cross a KV block (prompts of up to 300 tokens and 300-token
completions, end-of-sequence ignored), more of them than the engine runs at once (steps that
prefill beside decoding requests), grouped-query heads. In float32 every path gives the old
path's greedy tokens and logprobs within 1e-4; in bfloat16 (where a near-tie parts two greedy
samples sooner or later) the logprobs of every token before a parting within 0.1. Graphs
are replayed, dropped and captured again around a sleep, and a capture that fails leaves the
engine eager with the same output.

    PYTHONPATH=.:plugins/megatron python -m pytest plugins/megatron/tests/test_megatron_decode_gpu.py -m gpu
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _megatron_helpers import llama_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VOCAB = 1000
LONGEST = 640


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 300, (count,), generator=g)
    return [[1, *torch.randint(3, VOCAB, (int(n),), generator=g).tolist()] for n in lengths]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def gen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from rlcore.runtime.addresses import free_port
    from rlcore_megatron.options import MegatronOptions
    from rlcore_megatron.worker import MegatronGenerationWorker

    root = tmp_path_factory.mktemp("llama")
    (root / "config.json").write_text(
        json.dumps(llama_config(VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8))
    )
    worker = MegatronGenerationWorker(0, 1)
    worker.init_process_group("127.0.0.1", free_port(), "nccl", 120.0)
    try:
        worker.start(str(root), request.param, MegatronOptions(max_batch_size=16, max_sequence_length=LONGEST), "cuda")
        with torch.no_grad():  # livelier logits than the default init: fewer near-ties
            for name, p in worker.model.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.08)
        worker.serving, worker.loaded_version = True, 1
        yield worker
    finally:
        worker.teardown()


def engine(gen: Any, attention: str, graphs: int) -> Any:
    from rlcore_megatron import inference

    gen.engine = None
    gc.collect()
    torch.cuda.empty_cache()
    gen.engine = inference.build_dynamic_engine(
        gen.model, inference.TokenIdAdapter(eod=-1, vocab_size=VOCAB), gen.spec, attention=attention,
        cuda_graphs=graphs, tp=1, make_vocab_size_divisible_by=gen.divisible, max_batch_size=16,
        max_sequence_length=LONGEST, seed=5,
    )
    return gen.engine


def greedy(engine: Any, batch: list[list[int]], tokens: int = 300) -> list[Any]:
    from rlcore_megatron.inference import generate_dynamic

    return [group[0] for group in generate_dynamic(engine, batch, 1, tokens, 0.0)]


def compare(got: list[Any], want: list[Any]) -> tuple[int, float]:
    """Samples equal to ``want``, and the largest logprob difference before each parting."""
    same, diff = 0, 0.0
    for a, b in zip(got, want, strict=True):
        upto = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None)
        same += upto is None
        n = len(a.token_ids) if upto is None else upto
        diff = max([diff, *(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True))])
    return same, diff


@pytest.fixture(scope="module")
def old_path(gen: Any) -> list[Any]:
    return greedy(engine(gen, "torch", 0), prompts(24))


def assert_close(gen: Any, got: list[Any], want: list[Any]) -> None:
    same, diff = compare(got, want)
    if gen.dtype == "float32":
        assert same == len(want) and diff < 1e-4, (same, diff)
    else:  # bf16: near-ties go either way over 300 tokens; every token before a parting agrees
        assert diff < 0.1, (same, diff)


@pytest.mark.parametrize(("attention", "graphs"), [("flex", 16), ("flex", 0), ("torch", 16)])
def test_the_new_paths_sample_what_the_old_path_samples(gen: Any, old_path: list[Any], attention: str, graphs: int) -> None:
    from rlcore_megatron import decode_graphs

    got = greedy(engine(gen, attention, graphs), prompts(24))
    assert_close(gen, got, old_path)
    stats = decode_graphs.of(gen.model).stats
    if graphs:
        assert stats.replays > 0 and 0 < stats.captures <= graphs and stats.disabled is None


def test_graphs_are_captured_again_after_a_sleep_and_sample_the_same(gen: Any) -> None:
    from rlcore_megatron import decode_graphs

    eng = engine(gen, "flex", 16)
    before = greedy(eng, prompts(8, seed=1), 40)
    stats = decode_graphs.of(gen.model).stats
    captures, resets = stats.captures, stats.resets
    gen.asleep = False
    gen.sleep()
    assert stats.resets == resets + 1
    gen.wake()
    after = greedy(eng, prompts(8, seed=1), 40)
    assert compare(after, before) == (len(before), 0.0)
    assert stats.captures > captures


def test_a_capture_that_fails_leaves_the_engine_eager_and_right(gen: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlcore_megatron import decode_graphs

    want = greedy(engine(gen, "flex", 0), prompts(8, seed=2), 40)
    eng = engine(gen, "flex", 16)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("capture refused by the test")

    monkeypatch.setattr(torch.cuda, "graph", refuse)
    got = greedy(eng, prompts(8, seed=2), 40)
    stats = decode_graphs.of(gen.model).stats
    assert stats.disabled is not None and "refused by the test" in stats.disabled
    assert_close(gen, got, want)  # (padded to other batch sizes than the eager engine's)

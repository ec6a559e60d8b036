"""Megatron policy and generation colocated on one GPU, refit over the real cuda_ipc transport.

GPU only (``-m gpu``; skipped without CUDA, never in CI). Two processes on
``cuda:0`` (:mod:`_colocated`: a float32 TP=1 policy and a refit-fed generation
with megatron-core's dynamic engine), as the backend's Ray actors would be,
joined by a cuda_ipc channel (:mod:`rlcore.refit.transports.cuda_ipc`). Every check runs on
both refit paths: ``native`` (the two workers hold the same layout and agree on it
when the channel opens: the Megatron tensors are copied as they are) and ``hf``
(the native layout not offered: the Hugging Face plan, converted on both sides);
the policy's answer must name the path the pair expects. Checks: the refit is
bit-exact and the engine's sampled logprobs equal the policy's
(``token_mult_prob_error`` 1.0000), after a train step too; a refit whose export
fails half-way leaves the engine's old weights intact and serving; 50 refits
leave ``torch.cuda.memory_allocated`` flat on both sides; sleep/wake release and
restore the engine's KV cache and the policy's optimizer state (bit for bit);
closing the channel frees every byte it had shared.

    PYTHONPATH=.:plugins/megatron python -m pytest plugins/megatron/tests/test_megatron_colocated_gpu.py -m gpu
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.handles import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))

from _colocated import ProcActor, RemoteError, both  # noqa: E402
from _megatron_helpers import llama_config  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

PROMPTS = [[1, 5, 6, 7], [1, 11], [1, 30, 31, 32, 33, 34, 35], [1, 900]]
VOCAB = 1000  # padded to 1024 in both models
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Pair:
    """The two processes and their cuda_ipc channel."""

    def __init__(self, model_dir: str, path: str) -> None:
        from rlcore.refit.channels import ChannelSpec
        from rlcore.refit.specs import plan_buckets
        from rlcore.runtime.addresses import free_port

        self.path = path
        self.policy = ProcActor("policy", ENV)
        self.gen = ProcActor("generation", ENV)
        self.policy.call("start_policy", model_dir, "float32", 3, std=0.08)
        self.gen.call("start_generation", model_dir, "float32", 3, 8, 96, 0.05)
        if path == "hf":
            self.gen.call("set_native_refit", False)
        self.spec = ChannelSpec("cuda_ipc", f"colocated-gpu-{path}", 2, addr="127.0.0.1", port=free_port(), timeout_s=60)
        both(self.policy, self.gen, "call", ("open_refit_channel", self.spec), ("open_refit_channel", self.spec, 1))
        paths = both(self.policy, self.gen, "call", ("refit_path", self.spec), ("refit_path", self.spec))
        assert [p[0] for p in paths] == [path, path], paths
        self.buckets = plan_buckets(self.policy.call("call", "weight_specs"), 1 << 20)
        self.step = 0

    def refit(self, *, check: bool = True) -> list[Any]:
        self.step += 1
        out = both(
            self.policy, self.gen, "call",
            ("send_weights", self.spec, self.step, self.buckets),
            ("receive_weights", self.spec, self.step, self.buckets),
            check=check,
        )
        if check:  # the path the pair expects ran (the core's report reads this answer)
            from rlcore.refit.sync import _path

            assert _path([out[0]]) == self.path
        return out

    def train(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        rows = [([1, *torch.randint(3, 1000, (6,), generator=g).tolist()], torch.randint(3, 1000, (8,), generator=g).tolist()) for _ in range(4)]
        self.policy.call("call", "train_step", rows, [1.0, -1.0, 0.5, -0.5], None, 0.2, 1e-3)

    def token_mult_prob_error(self) -> float:
        out = self.gen.call("call", "generate", PROMPTS, SamplingParams(2, 16, 1.0, 7))
        rows = [(p, s["token_ids"]) for p, group in zip(PROMPTS, out, strict=True) for s in group]
        gen_lp = [s["logprobs"] for group in out for s in group]
        pol_lp = self.policy.call("call", "logprobs", rows)
        diffs = [abs(a - b) for ga, gb in zip(gen_lp, pol_lp, strict=True) for a, b in zip(ga, gb, strict=True)]
        assert diffs
        return math.exp(sum(diffs) / len(diffs))

    def same_weights(self) -> bool:
        """Every parameter equal bit for bit (the padded vocabulary rows aside: refit moves
        the Hugging Face tensors, 1000 rows; both models pad to 1024)."""
        pol, gen = self.policy.call("params"), self.gen.call("params")
        assert pol.keys() == gen.keys()
        return all(torch.equal(pol[n][:VOCAB], gen[n][:VOCAB]) for n in pol)

    def close(self) -> None:
        for actor in (self.gen, self.policy):
            actor.close()


@pytest.fixture(scope="module", params=["native", "hf"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model_dir = tmp_path_factory.mktemp("llama")
    (model_dir / "config.json").write_text(json.dumps(llama_config()))
    p = Pair(str(model_dir), request.param)
    try:
        yield p
    finally:
        p.close()


def test_refit_is_bit_exact_and_logprobs_match(pair: Pair) -> None:
    """The first refit feeds the refit-fed engine; a train step and a refit later the
    engine again holds the policy's weights bit for bit and samples with its logprobs."""
    pair.refit()
    assert pair.same_weights()
    assert pair.token_mult_prob_error() < 1.00005
    before = pair.gen.call("params")
    pair.train(1)
    pair.refit()
    assert pair.same_weights()
    assert not all(torch.equal(before[n], t) for n, t in pair.gen.call("params").items())
    assert pair.token_mult_prob_error() < 1.00005


@pytest.mark.parametrize("how", ["raise", "shape"])
def test_a_refit_failing_half_way_keeps_the_old_weights(pair: Pair, how: str) -> None:
    """The policy's export breaks after 5 tensors: both sides fail, the engine's weights
    are the old ones bit for bit and it keeps serving them; the next refit works."""
    pair.refit()
    old = pair.gen.call("params")
    pair.train(2)  # the refit would change the weights
    pair.policy.call("poison_export", 5, how)
    sent, received = pair.refit(check=False)
    assert isinstance(sent, RemoteError) and isinstance(received, RemoteError)
    assert "export failed" in str(sent) if how == "raise" else "the plan says" in str(sent)
    assert "before any byte was written" in str(received)
    now = pair.gen.call("params")
    assert all(torch.equal(old[n], now[n]) for n in old)
    assert pair.gen.call("call", "generate", PROMPTS, SamplingParams(1, 4, 0.0, 0))  # still serving
    pair.refit()
    assert pair.same_weights()


def test_no_memory_leak_over_50_refits(pair: Pair) -> None:
    """``memory_allocated`` is the same on both sides after the 1st and the 50th refit."""
    pair.refit()
    first = pair.policy.call("memory")["allocated"], pair.gen.call("memory")["allocated"]
    for _ in range(49):
        pair.refit()
    last = pair.policy.call("memory")["allocated"], pair.gen.call("memory")["allocated"]
    assert last == first
    assert pair.same_weights()


def test_sleep_and_wake(pair: Pair) -> None:
    """The engine's sleep releases its KV cache (memory given back to the device) and
    wake restores a working engine; the policy's sleep moves exactly its optimizer state
    off the GPU, and wake brings it back bit for bit."""
    pair.refit()
    before = pair.gen.call("memory")
    slept = pair.gen.call("call", "sleep")
    asleep = pair.gen.call("memory")
    assert slept["bytes"] > 0 and asleep["allocated"] == before["allocated"] - slept["bytes"]
    assert asleep["reserved"] < before["reserved"]
    pair.refit()  # refit writes the weights of a sleeping engine
    woke = pair.gen.call("call", "wake")
    assert slept["bytes"] <= woke["bytes"] <= slept["bytes"] + (1 << 20)  # resume adds a few small buffers
    assert pair.token_mult_prob_error() < 1.00005

    pair.train(3)  # AdamW state exists
    state = pair.policy.call("optimizer_state")
    mem = pair.policy.call("memory")["allocated"]
    slept = pair.policy.call("call", "sleep")
    assert slept["bytes"] == sum(t.numel() * t.element_size() for t in state if t.dim())  # not the CPU steps
    assert pair.policy.call("memory")["allocated"] <= mem - slept["bytes"]
    pair.refit()  # a sleeping policy still sends its weights
    assert pair.same_weights()
    pair.policy.call("call", "wake")
    after = pair.policy.call("optimizer_state")
    assert all(torch.equal(a, b) for a, b in zip(state, after, strict=True))


def test_closing_frees_everything_shared(pair: Pair) -> None:
    """Once both ends closed the channel (receiver first), the sender's allocations drop by
    exactly its staging buffer (nothing left in IPC limbo) and neither end keeps a handle.
    The native path shares the parameters' one buffer and stages nothing; the Hugging
    Face path stages q/k/v (split out of the fused weight) too."""
    pair.refit()
    key = pair.spec.key
    sender, receiver = pair.policy.call("channel_state", key), pair.gen.call("channel_state", key)
    if pair.path == "native":
        assert sender["shared"] == 1 and sender["staging"] == 0  # float32: one parameter buffer
    else:
        assert sender["shared"] == 2 and sender["staging"] > 0  # the buffer and the staging one
    assert receiver["opened"] == sender["shared"]
    before = pair.policy.call("memory")["allocated"]
    pair.gen.call("call", "close_refit_channels")
    pair.policy.call("call", "close_refit_channels")
    assert pair.policy.call("memory")["allocated"] == before - sender["staging"]
    assert pair.policy.call("channel_state", key) == pair.gen.call("channel_state", key) == {
        "shared": 0, "opened": 0, "staging": 0,
    }

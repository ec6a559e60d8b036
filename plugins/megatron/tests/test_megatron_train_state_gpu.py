"""Training checkpoints of the Megatron policy on one CUDA device (NCCL), the optimizer asleep.

GPU only (``-m gpu``; skipped without CUDA, never in CI). Colocated, the policy's AdamW state
sits in pinned host memory while the generation samples, which is when an overlapped save
runs: the save must write it from there and move nothing; a load brings the CUDA RNG state
back with the rest.

    PYTHONPATH=.:plugins/megatron python -m pytest plugins/megatron/tests/test_megatron_train_state_gpu.py -m gpu
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _megatron_helpers import ADVANTAGES, BATCH, CLIP_EPS, LR, max_diff, perturbed_old

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def policy(llama_dir: Path) -> Iterator[object]:
    from rlcore.runtime.addresses import free_port
    from rlcore_megatron.options import MegatronOptions
    from rlcore_megatron.worker import MegatronPolicyWorker

    w = MegatronPolicyWorker(0, 1)
    w.init_process_group("127.0.0.1", free_port(), "nccl", 60.0)
    try:
        w.load(str(llama_dir), "float32", MegatronOptions(micro_batch_size=2), "cuda")
        yield w
    finally:
        w.teardown()


def step(w: object) -> dict[str, float]:
    return w.train_step(BATCH, ADVANTAGES, perturbed_old(w.logprobs(BATCH)), CLIP_EPS, LR)


def _moments_pinned(w: object) -> bool:
    return all(
        v.is_pinned() for s in w.optimizer.state.values() for k, v in s.items() if k != "step"
    )


def test_round_trip_on_cuda_with_the_optimizer_asleep(policy: object, tmp_path: Path) -> None:
    step(policy)
    policy.sleep()
    assert policy.asleep and _moments_pinned(policy)
    at_save, cuda_rng = policy.logprobs(BATCH), torch.cuda.get_rng_state()
    policy.save_train_state(str(tmp_path))
    assert policy.asleep and _moments_pinned(policy)  # the save moved nothing
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    metrics = step(policy)  # wakes the optimizer first
    after = policy.logprobs(BATCH)
    torch.cuda.manual_seed(1234)
    policy.load_train_state(str(tmp_path))
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    assert max_diff(policy.logprobs(BATCH), at_save) == 0.0
    again = step(policy)
    assert again == pytest.approx(metrics, rel=1e-6)  # CUDA kernels may reorder sums
    assert max_diff(policy.logprobs(BATCH), after) < 1e-6

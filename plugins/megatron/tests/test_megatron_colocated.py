"""Colocated placement on CPU: what the Megatron backend declares and does without a GPU.

The GPU side (cuda_ipc refit between two processes, sleep/wake releasing real
memory) is ``test_megatron_colocated_gpu.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rlcore.declarations import Transport
from rlcore.errors import DeadlineExceeded
from rlcore.refit.channels import ChannelSpec
from rlcore.refit.specs import plan_buckets
from rlcore.runtime.addresses import free_port

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's own


@pytest.mark.parametrize("accelerator", ["cuda", "cpu"])
def test_cuda_ipc_is_declared_only_where_cuda_is(monkeypatch: pytest.MonkeyPatch, accelerator: str) -> None:
    """Both roles send and receive over cuda_ipc on a host with NVIDIA devices (as the
    planner detects them), never elsewhere: a declared transport must be one the backend
    can run where it is installed."""
    import rlcore.setup.planner
    from rlcore_megatron import plugin

    monkeypatch.setattr(rlcore.setup.planner, "detect_accelerator", lambda: accelerator)
    decl = plugin.rlcore_declare_backend()
    base = {Transport.COLLECTIVE, Transport.DISK, Transport.SHARED_MEMORY}
    want = base | {Transport.CUDA_IPC} if accelerator == "cuda" else base
    assert decl.send_transports == want and decl.receive_transports == want


@pytest.fixture(scope="module")
def workers(llama_dir: Path) -> Iterator[tuple]:
    from rlcore_megatron.options import MegatronOptions
    from rlcore_megatron.worker import MegatronGenerationWorker, MegatronPolicyWorker

    policy = MegatronPolicyWorker(0, 1)
    policy.init_process_group("127.0.0.1", free_port(), "gloo", 60.0)
    try:
        policy.load(str(llama_dir), "float32", MegatronOptions())
        gen = MegatronGenerationWorker(0, 1)  # shares the policy's process group and parallel state
        gen.start(str(llama_dir), "float32", MegatronOptions(max_batch_size=4))
        yield policy, gen
    finally:
        policy.teardown()


def test_sleep_and_wake_are_no_ops_off_cuda(workers: tuple) -> None:
    """On CPU there is no device memory to hand over: sleep and wake move nothing and
    leave both workers working (the loop may call them whatever the device)."""
    policy, gen = workers
    for w in (policy, gen):
        assert w.sleep()["bytes"] == 0.0 and not w.asleep
        assert w.wake()["bytes"] == 0.0 and not w.asleep


def test_a_channel_failing_before_its_first_tensor_keeps_the_engine_serving(
    workers: tuple, tmp_path: Path
) -> None:
    """A refit whose channel fails before yielding any tensor (cuda_ipc: a sender that
    failed mid-way sends nothing) wrote nothing: the engine keeps serving its weights.
    One that failed after writing some refuses to serve (unchanged behaviour)."""
    import torch

    policy, gen = workers
    buckets = plan_buckets(policy.weight_specs(), 100_000)
    good = ChannelSpec("disk", "colocated-cpu", 2, root=str(tmp_path), timeout_s=30)
    policy.send_weights(good, 1, buckets)
    gen.receive_weights(good, 1, buckets)
    before = {n: p.detach().clone() for n, p in gen.model.named_parameters()}
    rows = [([1, 5, 6], [7, 8])]
    expected = gen.logprobs(rows)

    silent = ChannelSpec("disk", "colocated-cpu", 2, root=str(tmp_path), timeout_s=0.5)
    with pytest.raises(DeadlineExceeded):
        gen.receive_weights(silent, 2, buckets)  # nothing was ever published for step 2
    assert gen.stale is None and gen.serving
    assert all(torch.equal(before[n], p) for n, p in gen.model.named_parameters())
    assert gen.logprobs(rows) == expected

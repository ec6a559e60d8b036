"""Tests of the fsdp policy backend.

1. One rank in this process (world size 1, gloo): logprobs, export, specs, training.
2. Two ranks in Ray actors, started through the real init hook: sharded logprobs and
   training against a single-process reference, refit over disk and collective,
   shutdown and init failure without leaks.
3. The declaration and the entry point's import hygiene.

The reference model is plain transformers, one unpadded row at a time.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.config import resolve_options
from rlcore.declarations import Role, validate_declaration
from rlcore.errors import RlcoreError
from rlcore.refit.specs import plan_buckets, spec_of
from rlcore.runtime.batches import shard_range
from rlcore.testing import fixtures
from rlcore.testing.policy_checks import (
    CLIP_EPS,
    LR,
    actor_pids,
    check_group_train_step,
    check_logprobs,
    check_on_policy_step,
    check_train_step,
    write_hf_model,
)
from rlcore.testing.reference import (
    GRPO_ADVANTAGES,
    GRPO_BATCH,
    hf_model,
    max_diff,
    reference_logprobs,
)
from rlcore.testing.waits import wait_for
from rlcore_fsdp.options import FSDPOptions
from rlcore_fsdp.plugin import rlcore_declare_backend, rlcore_init_policy
from rlcore_fsdp.worker import FSDPWorker, micro_batch_count

BATCH = GRPO_BATCH
ADVANTAGES = GRPO_ADVANTAGES


def assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 with tied input/output embeddings (one tensor under two names)."""
    d = tmp_path_factory.mktemp("tiny-qwen2-tied")
    return write_hf_model(d, "qwen2", vocab_size=64, tie_word_embeddings=True)


def test_sharding_helpers() -> None:
    for n in range(0, 9):
        for world in (1, 2, 3):
            ranges = [shard_range(n, world, r) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1
            assert micro_batch_count(n, world, 2) >= math.ceil(max(e - s for s, e in ranges) / 2)
            assert micro_batch_count(n, world, 2) >= 1


# ------------------------------------------------------- 1. in-process rank


def test_logprobs_match_transformers(worker: FSDPWorker, model_dir: Path) -> None:
    check_logprobs(worker, model_dir)


def test_export_equals_hf_state_dict_and_specs(worker: FSDPWorker, model_dir: Path) -> None:
    want = hf_model(model_dir).state_dict()
    stream = list(worker.export_stream())
    assert_same_tensors(dict(stream), want)
    assert len(stream) == len(want)  # no duplicates
    # weight_specs (computed without gathering) is exactly the stream's sequence.
    assert worker.weight_specs() == [spec_of(n, t) for n, t in stream]


@pytest.mark.parametrize("bucket_bytes", [1, 40_000, 150_000, 1 << 30])
def test_export_buckets_are_bounded(worker: FSDPWorker, bucket_bytes: int) -> None:
    specs = worker.weight_specs()
    buckets = list(worker.export_buckets(bucket_bytes))
    assert [[n for n, _ in b] for b in buckets] == [
        [s.name for s in b] for b in plan_buckets(specs, bucket_bytes)
    ]
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= bucket_bytes or len(b) == 1
    assert [n for b in buckets for n, _ in b] == [s.name for s in specs]


def test_train_step_matches_reference(worker: FSDPWorker, model_dir: Path) -> None:
    check_train_step(worker, model_dir, weight_atol=1e-5)
    # The next logprobs see the update.
    assert max_diff(worker.logprobs(BATCH), reference_logprobs(hf_model(model_dir), BATCH)) > 1e-4


def test_on_policy_step_without_old_logprobs(worker: FSDPWorker) -> None:
    check_on_policy_step(worker)


def test_tied_embeddings_in_process(worker: FSDPWorker, tied_model_dir: Path) -> None:
    """Qwen2 with tied embeddings: decoder layer class found, both names exported."""
    other = FSDPWorker(0, 1)  # shares the process group of ``worker``; no teardown
    other.load(str(tied_model_dir), "float32", FSDPOptions())
    ref = hf_model(tied_model_dir)
    stream = list(other.export_stream())
    assert_same_tensors(dict(stream), ref.state_dict())
    assert other.weight_specs() == [spec_of(n, t) for n, t in stream]
    assert max_diff(other.logprobs(BATCH), reference_logprobs(ref, BATCH)) < 1e-5
    other.train_step(BATCH, ADVANTAGES, None, CLIP_EPS, LR)
    after = other.export_state_dict()
    assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])
    assert not torch.equal(after["lm_head.weight"], ref.state_dict()["lm_head.weight"])


# ------------------------------------------------------- 2. two Ray ranks


def fsdp_actor_pids() -> set[int]:
    """FSDPWorker actor processes started from this process."""
    return actor_pids("FSDPWorker")


@pytest.fixture(scope="module")
def policy_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp-ray")


@pytest.fixture(scope="module")
def policy(ray_cluster: None, policy_tmp: Path, policy_context: Any) -> Iterator[Any]:
    # micro_batch_size 2 on 2 ranks: 5 rows -> 3 + 2 rows, 2 passes each (one padding).
    handle = rlcore_init_policy(
        policy_context(policy_tmp, "policy.options.micro_batch_size=2")
    )
    try:
        yield handle
    finally:
        handle.shutdown()


@pytest.fixture(scope="module")
def policy_model_dir(policy: Any, policy_tmp: Path, policy_context: Any) -> Path:
    from rlcore.models.tiny import ensure_model

    return ensure_model(policy_context(policy_tmp).config.model, policy_tmp)


def test_ray_init_two_ranks(policy: Any) -> None:
    from rlcore.handles import RefitSender

    assert isinstance(policy, RefitSender) and policy.device_type == "cpu"
    assert policy.world_size == 2 and policy.info["units"] == 3
    assert policy.info["local_numel"] == policy.info["params"] // 2
    assert len(set(policy.pids())) == 2


def test_ray_logprobs_sharded(policy: Any, policy_model_dir: Path) -> None:
    ref = hf_model(policy_model_dir)
    assert max_diff(policy.logprobs(BATCH), reference_logprobs(ref, BATCH)) < 1e-5
    # fewer rows than ranks: rank 1 runs a padding pass
    assert max_diff(policy.logprobs(BATCH[:1]), reference_logprobs(ref, BATCH[:1])) < 1e-5


def test_ray_train_step_matches_reference(policy: Any, policy_model_dir: Path) -> None:
    exported, empty = check_group_train_step(policy, policy_model_dir, weight_atol=1e-5)
    assert empty == {}  # only rank 0 yields
    # Both ranks gather the same full parameters, and the stream equals that gather.
    gathered = policy.group.call("reference_state_dict")
    assert_same_tensors(gathered[1], gathered[0])
    assert_same_tensors(exported, gathered[0])
    # A batch smaller than the group: rank 1 trains on a zero-weight padding row.
    got = policy.train_step(BATCH[:1], [1.0], None, clip_eps=CLIP_EPS, lr=LR)
    assert got["tokens"] == 4 and math.isfinite(got["grad_norm"])
    assert_same_tensors(*policy.group.call("reference_state_dict"))


def test_ray_refit_disk_roundtrip(policy: Any, policy_tmp: Path) -> None:
    from rlcore.refit.channels import ChannelSpec, receive_weights
    from rlcore.runtime.waits import ray_get

    spec = ChannelSpec("disk", "fsdp-test", 2, root=str(policy_tmp / "refit"), timeout_s=30)
    specs = policy.weight_specs()
    buckets = plan_buckets(specs, 50_000)
    assert len(buckets) > 3
    ray_get(policy.open_refit_channel(spec), what="open")
    sent = ray_get(policy.send_weights(spec, 7, buckets), what="send")
    assert sent[0] == sum(s.nbytes for s in specs) and sent[1] == 0
    received = dict(receive_weights(spec, 1, 7, buckets))
    assert_same_tensors(received, policy.group.call("export_state_dict")[0])


def test_ray_refit_collective_roundtrip(policy: Any) -> None:
    """This process joins the gloo refit channel as the receiving rank 1."""
    from rlcore.refit.channels import ChannelSpec, close_channel, open_channel, receive_weights
    from rlcore.runtime.waits import ray_get

    host, port = policy.refit_address()
    spec = ChannelSpec("collective", "fsdp-test-coll", 2, addr=host, port=port, timeout_s=30)
    buckets = plan_buckets(policy.weight_specs(), 100_000)
    opened = policy.open_refit_channel(spec)
    open_channel(spec, 1)
    try:
        ray_get(opened, what="open")
        sending = policy.send_weights(spec, 1, buckets)
        received = {n: t.clone() for n, t in receive_weights(spec, 1, 1, buckets)}
        ray_get(sending, what="send")
    finally:
        close_channel(spec)
    assert_same_tensors(received, policy.group.call("export_state_dict")[0])


def test_ray_shutdown_leaves_nothing(policy: Any) -> None:
    """Runs after the other tests of the shared policy (file order), which it shuts down."""
    import ray

    pids = set(policy.pids())
    assert pids <= fsdp_actor_pids()
    actors = list(policy.group.actors)
    policy.shutdown()
    policy.shutdown()  # idempotent
    assert wait_for(lambda: not (pids & fsdp_actor_pids()), 15.0, step_s=0.1), "FSDP actors still alive"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors[0].ping.remote(), timeout=10)
    with pytest.raises(RlcoreError, match="the fsdp policy handle was shut down"):
        policy.logprobs(BATCH)


def test_ray_tied_embeddings_two_ranks(
    ray_cluster: None, policy_tmp: Path, tied_model_dir: Path, policy_context: Any
) -> None:
    """Rank 1 builds the model on the meta device: its tied weights must be re-tied."""
    handle = rlcore_init_policy(policy_context(policy_tmp, f"model.path={tied_model_dir}"))
    try:
        ref = hf_model(tied_model_dir)
        exported = handle.group.call("export_state_dict")[0]
        assert_same_tensors(exported, ref.state_dict())
        assert handle.weight_specs() == [spec_of(n, t) for n, t in exported.items()]
        assert max_diff(handle.logprobs(BATCH), reference_logprobs(ref, BATCH)) < 1e-5
        handle.train_step(BATCH, ADVANTAGES, None, clip_eps=CLIP_EPS, lr=LR)
        gathered = handle.group.call("reference_state_dict")
        assert_same_tensors(gathered[1], gathered[0])
        assert torch.equal(gathered[0]["lm_head.weight"], gathered[0]["model.embed_tokens.weight"])
    finally:
        handle.shutdown()


@pytest.mark.timeout(240)
def test_ray_init_failure_cleans_up(
    ray_cluster: None, policy_tmp: Path, model_dir: Path, policy_context: Any
) -> None:
    """Rank 0 cannot read the weights: every rank fails at once and no actor is left."""
    from rlcore.errors import WorkerError

    broken = policy_tmp / "broken-model"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    before = fsdp_actor_pids()
    # Promptly, not after the 300 s collective timeout: the test's own timeout is 240 s.
    with pytest.raises(WorkerError, match="loading the model"):
        rlcore_init_policy(policy_context(policy_tmp, f"model.path={broken}"))
    assert wait_for(lambda: not (fsdp_actor_pids() - before), 15.0, step_s=0.1), (
        "FSDP actors left after a failed init"
    )


def test_init_needs_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy_context: Any
) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"rlcore\.runtime\.cluster\.Cluster"):
        rlcore_init_policy(policy_context(tmp_path))


# ------------------------------------------------ 3. declaration and import


def test_declaration_is_valid() -> None:
    d = validate_declaration(rlcore_declare_backend(), plugin="fsdp", distribution="rlcore-fsdp")
    assert d.name == "fsdp" and d.roles == {Role.POLICY}
    assert d.overlap.non_colocated and d.overlap.colocated
    assert {t.value for t in d.send_transports} == {"collective", "shared_memory", "disk"}
    assert d.options is FSDPOptions and "micro_batch_size" in d.option_names()


def test_options_are_checked() -> None:
    from rlcore.errors import ConfigError

    opts = resolve_options({"max_grad_norm": 0.5}, FSDPOptions, section="policy", backend="fsdp")
    assert opts.max_grad_norm == 0.5
    with pytest.raises(ConfigError, match="micro_batch_size"):
        resolve_options({"micro_batch": 4}, FSDPOptions, section="policy", backend="fsdp")


def test_entry_point_is_light() -> None:
    script = (
        "import sys, json\n"
        "from rlcore.setup.registry import load_registry\n"
        "reg = load_registry(['fsdp'])\n"
        "import rlcore_fsdp.plugin as p\n"
        "p.rlcore_declare_backend()\n"
        "heavy = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'backends': sorted(reg.declarations())}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [] and "fsdp" in result["backends"]


def test_driver_names_the_worker_class_without_torch() -> None:
    """The init hook imports the worker and handle modules in the driver (to name the actor
    class): torch and transformers load only in the ranks' processes, not in the driver,
    where the import would take seconds of the cores the ranks start on."""
    heavy = fixtures.heavy_imports(
        "rlcore_fsdp.plugin", "rlcore_fsdp.worker", "rlcore_fsdp.handle", heavy=("torch", "transformers")
    )
    assert heavy == []

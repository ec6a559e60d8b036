"""Training checkpoints of the fsdp policy (:mod:`rlcore_fsdp.checkpoint`).

Two real FSDP ranks in Ray actors (gloo, CPU) save and load through the handle; one rank
in this process (world size 1) is the other world size both ways and holds the RNG check.
Equal means bitwise: CPU FSDP on gloo is deterministic.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from rlcore.errors import CheckpointError
from rlcore.testing.policy_checks import CLIP_EPS, LR
from rlcore.testing.reference import GRPO_ADVANTAGES, GRPO_BATCH
from rlcore_fsdp import checkpoint
from rlcore_fsdp.plugin import rlcore_declare_backend, rlcore_init_policy
from rlcore_fsdp.worker import FSDPWorker

BATCH_A = GRPO_BATCH
ADV_A = GRPO_ADVANTAGES
BATCH_B = GRPO_BATCH[::-1]
ADV_B = [-a for a in GRPO_ADVANTAGES[::-1]]


def step(policy: Any, batch: list, adv: list) -> tuple[dict, list]:
    """One train step off-policy (old logprobs from before it), then the new logprobs."""
    old = policy.logprobs(batch)
    metrics = policy.train_step(batch, adv, old, clip_eps=CLIP_EPS, lr=LR)
    return metrics, policy.logprobs(batch)


def weights(policy: Any) -> dict[str, torch.Tensor]:
    return policy.group.call("export_state_dict")[0]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


# ------------------------------------------------------- two ranks in Ray


@pytest.fixture(scope="module")
def policy(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, policy_context: Any) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("fsdp-ckpt")
    handle = rlcore_init_policy(policy_context(tmp, "policy.options.micro_batch_size=2"))
    try:
        yield handle
    finally:
        handle.shutdown()


@pytest.fixture(scope="module")
def saved(policy: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """c0: fresh (no optimizer state); c1: after a step on A. Records what followed each."""
    root = tmp_path_factory.mktemp("ckpts")
    c0, c1 = root / "c0", root / "c1"
    c0.mkdir(), c1.mkdir()
    policy.save_checkpoint(str(c0))
    after_c0 = step(policy, BATCH_A, ADV_A)
    policy.save_checkpoint(str(c1))
    at_c1 = weights(policy)
    after_c1 = step(policy, BATCH_B, ADV_B)
    return {"c0": c0, "c1": c1, "after_c0": after_c0, "after_c1": after_c1, "at_c1": at_c1}


pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]
slow = pytest.mark.slow


def test_declares_checkpoints() -> None:
    from rlcore.declarations import validate_declaration
    from rlcore.handles import Checkpointable
    from rlcore_fsdp.handle import FSDPPolicy

    d = validate_declaration(rlcore_declare_backend(), plugin="fsdp", distribution="rlcore-fsdp")
    assert d.contract_version == "2.6" and d.trains_adapters
    assert d.checkpoint is not None and d.checkpoint.overlap
    assert (d.checkpoint.format, d.checkpoint.version) == (checkpoint.FORMAT, checkpoint.VERSION)
    assert issubclass(FSDPPolicy, Checkpointable)


@slow
def test_files_are_written_by_every_rank(saved: dict[str, Any]) -> None:
    names = {f.name for f in saved["c1"].iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng-0.pt", "rng-1.pt"} <= names
    meta = json.loads((saved["c1"] / checkpoint.META_FILE).read_text())
    assert meta["world_size"] == 2 and meta["optimizer"] is True
    assert json.loads((saved["c0"] / checkpoint.META_FILE).read_text())["optimizer"] is False
    # Each rank wrote its own half of the weights and moments: neither file holds it all.
    sizes = [(saved["c1"] / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.3 * sum(sizes)


@slow
def test_load_gives_back_the_same_step(policy: Any, saved: dict[str, Any]) -> None:
    policy.load_checkpoint(str(saved["c1"]))
    assert_same(weights(policy), saved["at_c1"])
    assert step(policy, BATCH_B, ADV_B) == saved["after_c1"]  # moments and step counts too
    for _ in range(2):
        step(policy, BATCH_A, ADV_A)
    # An older checkpoint, with no optimizer state yet, after more steps.
    policy.load_checkpoint(str(saved["c0"]))
    assert step(policy, BATCH_A, ADV_A) == saved["after_c0"]
    policy.load_checkpoint(str(saved["c1"]))
    assert step(policy, BATCH_B, ADV_B) == saved["after_c1"]


@slow
def test_save_leaves_the_state_unchanged(policy: Any, saved: dict[str, Any], tmp_path: Path) -> None:
    policy.load_checkpoint(str(saved["c1"]))
    policy.save_checkpoint(str(tmp_path))
    assert step(policy, BATCH_B, ADV_B) == saved["after_c1"]
    # What it wrote is the state it was given: the same shards as c1's.
    for r in (0, 1):
        assert (tmp_path / f"__{r}_0.distcp").read_bytes() == (
            saved["c1"] / f"__{r}_0.distcp"
        ).read_bytes()


@slow
def test_write_failure_is_an_oserror_naming_the_path(policy: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError, match="a-file"):
        policy.save_checkpoint(str(blocker / "ckpt"))
    policy.logprobs(BATCH_A[:1])  # the ranks are still in lockstep


@slow
def test_broken_checkpoints_are_refused_naming_the_file(
    policy: Any, saved: dict[str, Any], tmp_path: Path
) -> None:
    def broken(name: str, change: Any) -> str:
        d = tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(saved["c1"], d)
        change(d / name)
        return str(d)

    cases = [
        (checkpoint.META_FILE, lambda f: f.unlink(), checkpoint.META_FILE),
        (checkpoint.META_FILE, lambda f: f.write_text("{garbled"), checkpoint.META_FILE),
        ("__1_0.distcp", lambda f: f.unlink(), r"__1_0\.distcp is missing"),
        ("__0_0.distcp", lambda f: f.write_bytes(f.read_bytes()[:100]), r"__0_0\.distcp is truncated"),
        (".metadata", lambda f: f.write_bytes(b"garbled"), r"\.metadata"),
        ("rng-1.pt", lambda f: f.write_bytes(b"garbled"), r"rng-1\.pt"),
        ("__1_0.distcp", lambda f: f.write_bytes(bytes(f.stat().st_size)), r"__1_0\.distcp"),
    ]
    for name, change, match in cases:
        with pytest.raises(CheckpointError, match=match):
            policy.load_checkpoint(broken(name, change))
    # Another model: the difference is named.
    d = broken(checkpoint.META_FILE, lambda f: None)
    meta = json.loads((Path(d) / checkpoint.META_FILE).read_text())
    meta["weights"][0][1] = [7, 7]
    (Path(d) / checkpoint.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"another model.*{meta['weights'][0][0]}"):
        policy.load_checkpoint(d)
    # A failed load leaves the policy able to load a good one.
    policy.load_checkpoint(str(saved["c1"]))
    assert step(policy, BATCH_B, ADV_B) == saved["after_c1"]


# ---------------------------------------------- one rank in this process


@pytest.fixture(scope="module")
def single(worker: FSDPWorker) -> FSDPWorker:
    """The in-process rank (world size 1) of this module."""
    return worker


def save_single(worker: FSDPWorker, directory: Path) -> None:
    directory.mkdir()
    checkpoint.save(worker, str(directory))


def load_single(worker: FSDPWorker, directory: Path) -> None:
    meta = checkpoint.read_meta(str(directory))
    checkpoint.check_compatible(str(directory), meta, worker.weight_specs())
    checkpoint.load(worker, str(directory), meta)


def test_rng_states_come_back(single: FSDPWorker, tmp_path: Path) -> None:
    torch.manual_seed(123)
    random.seed(5)
    numpy.random.seed(9)
    save_single(single, tmp_path / "c")
    drawn = (torch.rand(4), random.random(), numpy.random.rand())
    old = single.train_step(BATCH_A, ADV_A, None, CLIP_EPS, LR)
    torch.manual_seed(0), random.seed(0), numpy.random.seed(0)
    load_single(single, tmp_path / "c")
    again = (torch.rand(4), random.random(), numpy.random.rand())
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]
    assert single.train_step(BATCH_A, ADV_A, None, CLIP_EPS, LR) == old


@slow
def test_reshards_between_world_sizes(
    policy: Any, single: FSDPWorker, saved: dict[str, Any], tmp_path: Path
) -> None:
    # 2 ranks -> 1: the same weights; the same moments (one step agrees to rounding, as the
    # batch is split otherwise).
    load_single(single, saved["c1"])
    assert_same(single.export_state_dict(), saved["at_c1"])
    got = single.train_step(BATCH_B, ADV_B, None, CLIP_EPS, LR)
    policy.load_checkpoint(str(saved["c1"]))
    want = policy.train_step(BATCH_B, ADV_B, None, clip_eps=CLIP_EPS, lr=LR)
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-5 for k in got), (got, want)
    single_after = single.export_state_dict()
    two_after = weights(policy)
    assert max((single_after[n] - two_after[n]).abs().max().item() for n in two_after) < 1e-5
    # 1 rank -> 2: exactly the single rank's weights.
    save_single(single, tmp_path / "from-one")
    policy.load_checkpoint(str(tmp_path / "from-one"))
    assert_same(weights(policy), single_after)


@slow
def test_a_staged_save_writes_the_state_it_copied_while_the_policy_trains_on(policy: Any, tmp_path: Path) -> None:
    """Contract 2.3: stage_checkpoint returns once the shards are in host memory; a train step
    right after changes the weights, and what the background write left loads back as the
    state at staging, with the same files a blocking save writes."""
    import time

    from rlcore.handles import StagedCheckpointable
    from rlcore_fsdp.handle import FSDPPolicy

    assert issubclass(FSDPPolicy, StagedCheckpointable)
    step(policy, BATCH_A, ADV_A)  # the optimizer has state: the moments are staged too
    at_stage = weights(policy)
    figures = policy.stage_checkpoint(str(tmp_path))
    step(policy, BATCH_B, ADV_B)
    deadline = time.monotonic() + 60
    while not policy.checkpoint_written():
        assert time.monotonic() < deadline, "the staged save was never written"
        time.sleep(0.05)
    assert policy.checkpoint_written()  # asked again: still written, nothing raised
    moments = sum(t.numel() * t.element_size() for t in at_stage.values())
    assert figures["host_bytes"] >= moments  # the weights' shards and AdamW's two moments
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", "rng-0.pt", "rng-1.pt", checkpoint.META_FILE])
    assert not torch.equal(next(iter(weights(policy).values())), next(iter(at_stage.values())))
    policy.load_checkpoint(str(tmp_path))
    assert_same(weights(policy), at_stage)


@slow
def test_a_staged_write_that_fails_is_raised_by_checkpoint_written_naming_the_path(policy: Any, tmp_path: Path) -> None:
    target = tmp_path / "blocked"
    target.mkdir()
    # Each rank's shard file is taken by a directory of its name: the background write fails
    # whenever it runs (removing the directory after staging raced a fast write).
    for rank in (0, 1):
        (target / f"__{rank}_0.distcp").mkdir()
    policy.stage_checkpoint(str(target))
    import time

    deadline = time.monotonic() + 60
    with pytest.raises((OSError, CheckpointError), match="blocked"):
        while not policy.checkpoint_written():
            assert time.monotonic() < deadline
            time.sleep(0.05)

"""Training checkpoints of the Megatron policy (rlcore_megatron.train_state), one rank in this
process (TP=1, gloo): save, train, load, train again gives bit for bit the same; a save
changes nothing; broken or foreign checkpoints are refused by name. Ray, TP=2 and
resharding: ``test_megatron_ray.py``."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _megatron_helpers import ADVANTAGES, BATCH, CLIP_EPS, LR, in_process_policy, perturbed_old

from rlcore.errors import CheckpointError
from rlcore_megatron import train_state
from rlcore_megatron.options import MegatronOptions
from rlcore_megatron.worker import MegatronPolicyWorker

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's own

OPTIONS = MegatronOptions(micro_batch_size=2)


@pytest.fixture(scope="module")
def policy(llama_dir: Path) -> Iterator[MegatronPolicyWorker]:
    with in_process_policy(llama_dir, OPTIONS) as w:
        yield w


def step(w: MegatronPolicyWorker, advantages: list[float] = ADVANTAGES) -> dict[str, float]:
    """An off-policy GRPO step (old logprobs perturbed, so the clip takes part)."""
    return w.train_step(BATCH, advantages, perturbed_old(w.logprobs(BATCH)), CLIP_EPS, LR)


def snapshot(w: MegatronPolicyWorker) -> dict[str, Any]:
    """Copies of everything a checkpoint must keep: weights, AdamW state, RNG states."""
    assert w.optimizer is not None
    return {
        "params": {n: p.detach().clone() for n, p in w.model.named_parameters()},
        "optimizer": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in w.optimizer.state_dict()["state"].items()
        },
        "groups": [{k: v for k, v in g.items()} for g in w.optimizer.state_dict()["param_groups"]],
        "rng": train_state.capture_rng(w),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for i in a["optimizer"]:
        assert a["optimizer"][i].keys() == b["optimizer"][i].keys(), i
        for k, v in a["optimizer"][i].items():
            assert torch.equal(v, b["optimizer"][i][k]), (i, k)
    assert a["groups"] == b["groups"]
    ra, rb = a["rng"], b["rng"]
    assert torch.equal(ra["torch"], rb["torch"]) and ra["python"] == rb["python"]
    (kind_a, keys_a, *rest_a), (kind_b, keys_b, *rest_b) = ra["numpy"], rb["numpy"]
    assert kind_a == kind_b and torch.equal(keys_a, keys_b) and rest_a == rest_b
    assert ra["tracker"].keys() == rb["tracker"].keys() and ra["tracker"]
    assert all(torch.equal(ra["tracker"][k], rb["tracker"][k]) for k in ra["tracker"])


def disturb(w: MegatronPolicyWorker) -> None:
    """Move every piece of state a checkpoint restores: weights and moments (a step with
    other advantages), torch, python, numpy and tracker RNG states."""
    import numpy as np
    from megatron.core import tensor_parallel

    step(w, [-a for a in ADVANTAGES])
    torch.rand(3)
    random.random()
    np.random.rand()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        torch.rand(3)


@pytest.fixture(scope="module")
def saved(policy: MegatronPolicyWorker, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A checkpoint taken after one step (the optimizer has state), with what the policy
    held before and after the save, and what the next step gave."""
    step(policy)
    directory = tmp_path_factory.mktemp("ckpt") / "step-1"
    directory.mkdir()
    at_save = policy.logprobs(BATCH)
    before = snapshot(policy)
    report = policy.save_train_state(str(directory))
    after = snapshot(policy)
    metrics = step(policy)
    logprobs = policy.logprobs(BATCH)
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    return {
        "dir": directory,
        "before": before,
        "after": after,
        "metrics": metrics,
        "logprobs": logprobs,
        "logprobs_at_save": at_save,
        "report": report,
        "files": files,
        "bytes": sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()),
    }


def test_save_writes_the_layout_and_changes_nothing(saved: dict[str, Any]) -> None:
    assert_same(saved["before"], saved["after"])
    files = saved["files"]
    assert train_state.META_NAME in files and "rng/rank00000.pt" in files
    assert "dist/metadata.json" in files and any(f.endswith(".distcp") for f in files), files
    meta = train_state.read_meta(saved["dir"])
    assert meta["layout"] == {"tp": 1, "dp": 1, "world_size": 1}
    assert meta["optimizer_state"] is True and meta["optimizer"] == "AdamW"
    assert meta["padded_vocab_size"] == 128 and meta["dtype"] == "float32"
    # Weights + two AdamW moments, float32: the checkpoint is at least three copies of the model.
    params = sum(t.numel() for t in saved["before"]["params"].values())
    assert saved["bytes"] >= 3 * 4 * params


def test_load_then_step_is_bitwise_the_step_after_save(
    policy: MegatronPolicyWorker, saved: dict[str, Any]
) -> None:
    disturb(policy)
    assert policy.logprobs(BATCH) != saved["logprobs"]
    report = policy.load_train_state(str(saved["dir"]))
    assert report["resharded"] is False
    assert_same(saved["before"], snapshot(policy))  # weights, moments, steps, lr, RNG
    assert step(policy) == saved["metrics"]  # loss, grad norm, clip fraction: bit for bit
    assert policy.logprobs(BATCH) == saved["logprobs"]


def test_checkpoint_before_the_first_step_restores_an_empty_optimizer(
    llama_dir: Path, tmp_path: Path
) -> None:
    fresh = MegatronPolicyWorker(0, 1)  # shares the process group and parallel state
    fresh.load(str(llama_dir), "float32", OPTIONS)
    assert fresh.optimizer is not None and not fresh.optimizer.state
    fresh.save_train_state(str(tmp_path))
    assert train_state.read_meta(tmp_path)["optimizer_state"] is False
    first, lp = step(fresh), fresh.logprobs(BATCH)
    step(fresh)
    fresh.load_train_state(str(tmp_path))
    assert not fresh.optimizer.state  # AdamW starts again from zero moments and step 0
    assert step(fresh) == first and fresh.logprobs(BATCH) == lp


def _copy(saved: dict[str, Any], tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(saved["dir"], dst)
    return dst


def _edit_meta(directory: Path, **changes: Any) -> None:
    file = directory / train_state.META_NAME
    meta = json.loads(file.read_text())
    meta.update(changes)
    file.write_text(json.dumps(meta))


def test_missing_record_or_rng_file_is_refused_by_name(
    policy: MegatronPolicyWorker, saved: dict[str, Any], tmp_path: Path
) -> None:
    d = _copy(saved, tmp_path)
    (d / "rng" / "rank00000.pt").unlink()
    with pytest.raises(CheckpointError, match="rank 0's RNG states are missing"):
        policy.load_train_state(str(d))
    (d / train_state.META_NAME).unlink()
    with pytest.raises(CheckpointError, match=f"{train_state.META_NAME} is missing"):
        policy.load_train_state(str(d))
    with pytest.raises(CheckpointError, match="is missing"):
        policy.load_train_state(str(tmp_path / "nowhere"))


def test_garbled_files_are_refused(
    policy: MegatronPolicyWorker, saved: dict[str, Any], tmp_path: Path
) -> None:
    d = _copy(saved, tmp_path)
    (d / train_state.META_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        policy.load_train_state(str(d))
    shutil.rmtree(d)
    d = _copy(saved, tmp_path)
    (d / "rng" / "rank00000.pt").write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match="rank00000.pt cannot be read"):
        policy.load_train_state(str(d))
    shutil.rmtree(d)
    d = _copy(saved, tmp_path)
    for f in (d / "dist").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])  # torn shards
    with pytest.raises(CheckpointError, match="loading the Megatron checkpoint .* failed on rank 0"):
        policy.load_train_state(str(d))
    policy.load_train_state(str(saved["dir"]))  # the good one still loads afterwards
    assert policy.logprobs(BATCH) == saved["logprobs_at_save"]


def test_other_model_dtype_or_padding_is_refused_naming_both(
    policy: MegatronPolicyWorker, saved: dict[str, Any], tmp_path: Path
) -> None:
    d = _copy(saved, tmp_path)
    meta = train_state.read_meta(d)
    hidden = meta["model"]["hidden_size"]
    _edit_meta(d, model={**meta["model"], "hidden_size": hidden + 32})
    with pytest.raises(
        CheckpointError, match=f"another model .*hidden_size: checkpoint {hidden + 32}, policy {hidden}"
    ):
        policy.load_train_state(str(d))
    _edit_meta(d, model=meta["model"], dtype="bfloat16")
    with pytest.raises(CheckpointError, match="trained in bfloat16, this megatron policy runs float32"):
        policy.load_train_state(str(d))
    _edit_meta(d, dtype="float32", layout={"tp": 2, "dp": 1, "world_size": 2}, padded_vocab_size=256)
    with pytest.raises(CheckpointError) as err:
        policy.load_train_state(str(d))
    assert "tp=2, dp=1, world size 2, padded vocabulary 256" in str(err.value)
    assert "tp=1, dp=1, world size 1, padded vocabulary 128" in str(err.value)
    assert "make_vocab_size_divisible_by" in str(err.value)
    _edit_meta(d, layout=meta["layout"], padded_vocab_size=128, version="0")
    with pytest.raises(CheckpointError, match="version '0'; this rlcore-megatron reads version 1"):
        policy.load_train_state(str(d))


def test_release_stops_the_writers_results_queue(saved: dict[str, Any]) -> None:
    """megatron-core's writer keeps a multiprocessing manager for its results: a torn-down
    rank stops it (and the next save starts another)."""
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager = filesystem_async._results_queue._manager  # the save of ``saved`` started it
    pid = manager._process.pid
    assert psutil.pid_exists(pid)
    train_state.release()
    assert filesystem_async._results_queue is None
    if psutil.pid_exists(pid):
        psutil.Process(pid).wait(10)  # psutil.TimeoutExpired if it were still serving


def test_a_full_disk_is_an_oserror_naming_the_path(
    policy: MegatronPolicyWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch DCP gathers the ranks' write errors into a CheckpointException (a BaseException):
    the save raises the OSError inside it, naming the directory, as the contract asks."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    def full(*args: Any, **kwargs: Any) -> None:
        raise CheckpointException("write_data", {0: OSError(28, "No space left on device")})

    monkeypatch.setattr(dist_checkpointing, "save", full)
    with pytest.raises(OSError, match="No space left on device") as err:
        policy.save_train_state(str(tmp_path))
    assert err.value.errno == 28 and err.value.filename == str(tmp_path / "dist")

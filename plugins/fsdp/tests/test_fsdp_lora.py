"""LoRA adapters on the fsdp policy (``policy.options.lora``, contract 2.4), one rank in
this process: only the adapters train and hold optimizer state, the base stays frozen,
and every export (refit, ``rlcore export``) is the merged model, which computes what the
policy computes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.config import resolve_options
from rlcore.errors import ConfigError
from rlcore.lora import LoraOptions
from rlcore.testing.policy_checks import CLIP_EPS
from rlcore.testing.reference import (
    GRPO_ADVANTAGES,
    GRPO_BATCH,
    hf_model,
    max_diff,
    reference_logprobs,
)
from rlcore_fsdp.options import FSDPOptions
from rlcore_fsdp.worker import FSDPWorker

LORA = LoraOptions(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def lora_worker(model_dir: Path, one_rank: Any) -> Iterator[FSDPWorker]:
    with one_rank(model_dir, lora=LORA) as w:
        yield w


def named(worker: FSDPWorker) -> dict[str, torch.Tensor]:
    from rlcore_fsdp.worker import hf_name

    return {hf_name(n): p.detach().clone() for n, p in worker.model.named_parameters()}


def by_hand(worker: FSDPWorker) -> dict[str, torch.Tensor]:
    """The merged model from the policy's own parameters: base + (alpha / rank) * B @ A."""
    params = named(worker)
    merged = {}
    for name, p in params.items():
        if "lora_" in name:
            continue
        clean = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".base_layer.weight" in name:
            stem = name.removesuffix("base_layer.weight")
            a, b = params[stem + "lora_A.default.weight"], params[stem + "lora_B.default.weight"]
            p = p + LORA.scale * (b @ a)
        merged[clean] = p
    return merged


def test_only_the_adapters_train_and_hold_optimizer_state(lora_worker: FSDPWorker) -> None:
    from rlcore_fsdp.worker import hf_name

    trained = {hf_name(n) for n, p in lora_worker.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # Three targets in each of the tiny model's 2 layers, two matrices each.
    assert len(trained) == 3 * 2 * 2
    before = named(lora_worker)
    stats = lora_worker.train_step(GRPO_BATCH, GRPO_ADVANTAGES, None, CLIP_EPS, 5e-2)
    after = named(lora_worker)
    assert stats["grad_norm"] > 0
    frozen = [n for n in before if "lora_" not in n]
    # Every base weight is still a parameter after the step (the frozen root unit included).
    assert sorted(after) == sorted(before)
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen)
    # B starts at zero: the first step moves B (A's gradient goes through B).
    assert any(not torch.equal(before[n], after[n]) for n in trained if ".lora_B." in n)
    assert lora_worker.optimizer is not None
    with_state = {id(p) for p, s in lora_worker.optimizer.state.items() if s}
    ids = {id(p): hf_name(n) for n, p in lora_worker.model.named_parameters()}
    assert with_state and {ids[i] for i in with_state} <= trained


def test_the_export_is_the_merged_model_and_computes_what_the_policy_does(
    lora_worker: FSDPWorker, model_dir: Path
) -> None:
    lora_worker.train_step(GRPO_BATCH, GRPO_ADVANTAGES, None, CLIP_EPS, 5e-2)
    exported = lora_worker.export_state_dict()
    base = hf_model(model_dir).state_dict()
    # The base model's names and shapes, nothing of peft's.
    assert sorted(exported) == sorted(base)
    assert [s.name for s in lora_worker.weight_specs()] == list(exported)
    for name, t in exported.items():
        assert t.shape == base[name].shape, name
    want = by_hand(lora_worker)
    assert max(float((exported[n] - want[n]).abs().max()) for n in exported) < 1e-6
    changed = {n for n in exported if not torch.equal(exported[n], base[n])}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for n in changed)
    # A plain transformers model holding the export gives the policy's logprobs (what a refit
    # check compares).
    plain = hf_model(model_dir)
    plain.load_state_dict(exported)
    got = lora_worker.logprobs(GRPO_BATCH)
    assert max_diff(got, reference_logprobs(plain, GRPO_BATCH)) < 1e-4


def test_lora_options_are_checked() -> None:
    resolved = resolve_options({"lora": {"rank": 2}}, FSDPOptions, section="policy", backend="fsdp")
    assert resolved.lora == LoraOptions(rank=2) and resolved.lora.scale == 8.0
    with pytest.raises(ConfigError, match=r"policy\.options\.lora\.rank'\? Valid options of policy\.options\.lora"):
        resolve_options({"lora": {"rnak": 2}}, FSDPOptions, section="policy", backend="fsdp")
    with pytest.raises(ConfigError, match="use_orig_params=true") as info:
        resolve_options({"lora": {}, "use_orig_params": False}, FSDPOptions, section="policy", backend="fsdp")
    assert info.value.key == "policy.options.use_orig_params"


def test_a_target_that_matches_nothing_names_the_model_layers(model_dir: Path) -> None:
    from rlcore_fsdp import adapters

    with pytest.raises(ValueError, match=r"target_modules=\['qkv'\].*q_proj"):
        adapters.attach(hf_model(model_dir), LoraOptions(target_modules=["qkv"]))


def test_dropout_trains_only_inside_a_step(model_dir: Path) -> None:
    from peft.tuners.lora import LoraLayer

    from rlcore_fsdp import adapters

    model: Any = adapters.attach(hf_model(model_dir), LoraOptions(dropout=0.5))
    model.eval()
    drops = [d for m in model.modules() if isinstance(m, LoraLayer) for d in m.lora_dropout.values()]
    with adapters.dropout_on(model, LoraOptions(dropout=0.5)):
        assert drops and all(d.training for d in drops)
        assert not model.training
    assert not any(d.training for d in drops)


# ------------------------------------------------------- two ranks in Ray


@pytest.fixture(scope="module")
def lora_policy(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, policy_context: Any) -> Iterator[Any]:
    from rlcore_fsdp.plugin import rlcore_init_policy

    tmp = tmp_path_factory.mktemp("fsdp-lora")
    handle = rlcore_init_policy(
        policy_context(tmp, "policy.options.micro_batch_size=2", "policy.options.lora.rank=4")
    )
    try:
        yield handle
    finally:
        handle.shutdown()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_two_sharded_ranks_train_adapters_only_and_resume_exactly(lora_policy: Any, tmp_path: Path) -> None:
    def weights() -> dict[str, torch.Tensor]:
        return lora_policy.group.call("export_state_dict")[0]

    def step(batch: list, adv: list) -> tuple[dict, list]:
        old = lora_policy.logprobs(batch)
        return lora_policy.train_step(batch, adv, old, clip_eps=CLIP_EPS, lr=5e-2), lora_policy.logprobs(batch)

    start = weights()
    step(GRPO_BATCH, GRPO_ADVANTAGES)
    moved = weights()
    assert sorted(moved) == sorted(start)
    changed = {n for n in start if not torch.equal(start[n], moved[n])}
    # all-linear: every projection of every layer moves, nothing else (embeddings, norms, head).
    assert changed and all(n.endswith("proj.weight") and ".layers." in n for n in changed)
    lora_policy.save_checkpoint(str(tmp_path))
    from rlcore.errors import CheckpointError
    from rlcore_fsdp import checkpoint

    meta = checkpoint.read_meta(str(tmp_path))
    assert meta["lora"]["rank"] == 4
    # The adapters alone (and their AdamW moments): the base comes from the model at resume.
    assert meta["adapters_only"] and meta["base_model"]["fingerprint"]
    import torch.distributed.checkpoint as dcp

    from rlcore_fsdp import adapters

    saved = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(adapters.is_adapter(k) for k in model_keys), model_keys
    with pytest.raises(CheckpointError, match=r"written with policy\.options\.lora=\{'rank': 4"):
        checkpoint.check_compatible(str(tmp_path), meta, lora_policy.weight_specs(), None)
    after = step(GRPO_BATCH[::-1], [-a for a in GRPO_ADVANTAGES[::-1]])
    step(GRPO_BATCH, GRPO_ADVANTAGES)
    lora_policy.load_checkpoint(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(weights().values(), moved.values(), strict=True))
    assert step(GRPO_BATCH[::-1], [-a for a in GRPO_ADVANTAGES[::-1]]) == after  # adapters' moments too
    # On another base it is refused, naming both.
    import json

    other = {**meta, "base_model": {"path": "/elsewhere", "fingerprint": "0" * 16}}
    (tmp_path / checkpoint.META_FILE).write_text(json.dumps(other))
    with pytest.raises(Exception, match=r"trained on the base model /elsewhere \(fingerprint 0+\); the running"):
        lora_policy.load_checkpoint(str(tmp_path))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_two_sharded_ranks_give_the_whole_adapters_from_their_shards(lora_policy: Any) -> None:
    """adapter_state sends only the adapters' pieces each rank's shards hold (no FSDP
    gather): what rank 0 assembles is every adapter matrix, equal to the whole model's."""
    from rlcore_fsdp import adapters

    old = lora_policy.logprobs(GRPO_BATCH)
    lora_policy.train_step(GRPO_BATCH, GRPO_ADVANTAGES, old, clip_eps=CLIP_EPS, lr=5e-2)  # B no longer zero
    tensors, config = lora_policy.adapter_state()
    whole = lora_policy.group.call("reference_state_dict")[0]
    want = {adapters.saved_name(n): t for n, t in whole.items() if ".lora_" in n}
    assert sorted(tensors) == sorted(want) and config["r"] == 4
    assert all(torch.equal(tensors[n], want[n]) for n in want)
    assert any(torch.count_nonzero(t) for n, t in tensors.items() if ".lora_B." in n)


def test_one_rank_saves_the_adapters_alone_and_resumes_exactly(lora_worker: FSDPWorker, tmp_path: Path) -> None:
    """At world size 1 (FSDP's NO_SHARD) too: the files hold the adapters and their moments,
    the load leaves the base as loaded and the next step gives what it gave after the save."""
    from rlcore_fsdp import adapters, checkpoint

    lora_worker.train_step(GRPO_BATCH, GRPO_ADVANTAGES, None, CLIP_EPS, 5e-2)  # moments exist
    lora_worker.save_checkpoint(str(tmp_path))
    saved = named(lora_worker)
    first = lora_worker.train_step(GRPO_BATCH[::-1], GRPO_ADVANTAGES[::-1], None, CLIP_EPS, 5e-2)
    lora_worker.load_checkpoint(str(tmp_path), checkpoint.read_meta(str(tmp_path)))
    assert all(torch.equal(saved[n], t) for n, t in named(lora_worker).items())
    assert lora_worker.train_step(GRPO_BATCH[::-1], GRPO_ADVANTAGES[::-1], None, CLIP_EPS, 5e-2) == first
    import torch.distributed.checkpoint as dcp

    keys = [k for k in dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(adapters.is_adapter(k) for k in keys)


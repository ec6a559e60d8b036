"""What the tests of the policy backends share beyond :mod:`rlcore.testing.fixtures`.

A policy worker (one rank, driven in the test's process) must compute what
:mod:`rlcore.testing.reference` computes with transformers: :func:`check_logprobs`,
:func:`check_train_step` and :func:`check_on_policy_step` hold it to that (and
:func:`check_group_train_step` a handle over such workers) at the tests'
settings (:data:`CLIP_EPS`, :data:`LR`, :func:`reference_step`). Besides: tiny Hugging
Face checkpoints of a given shape (:func:`write_hf_model`), a Ray cluster for a test
module (:func:`running_cluster`) and the actor processes of a worker class
(:func:`actor_pids`).

Imports torch, transformers and the config stack only when called (the GPU scripts
import it where the config stack does not exist).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlcore.testing.reference import (
    GRPO_ADVANTAGES,
    GRPO_BATCH,
    hf_model,
    max_diff,
    perturbed_old,
    reference_grpo_step,
    reference_logprobs,
)

#: The clip range of the tests' train steps.
CLIP_EPS = 0.2
#: The learning rate of the tests' train steps.
LR = 1e-3

#: What the tiny checkpoints of :func:`write_hf_model` share unless a test says otherwise.
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def reference_step(model: Any, batch: list, adv: list, old: list | None, **kwargs: Any) -> dict:
    """:func:`rlcore.testing.reference.reference_grpo_step` at :data:`LR` and :data:`CLIP_EPS`."""
    return reference_grpo_step(model, batch, adv, old, lr=LR, clip_eps=CLIP_EPS, **kwargs)


def write_hf_model(
    directory: str | Path,
    architecture: str = "llama",
    *,
    seed: int = 0,
    init: Callable[[Any], None] | None = None,
    **config: Any,
) -> Path:
    """A tiny Hugging Face causal LM in ``directory`` (safetensors); returns the directory.

    ``architecture`` is ``llama`` or ``qwen2``; ``config`` goes over :data:`TINY_SHAPE`.
    The weights are transformers' initialisation after ``torch.manual_seed(seed)``, then
    ``init(model)`` under ``torch.no_grad()`` when given.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[architecture]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY_SHAPE, **config}))
    if init is not None:
        with torch.no_grad():
            init(model)
    model.save_pretrained(str(directory), safe_serialization=True)
    return Path(directory)


@contextlib.contextmanager
def running_cluster(num_cpus: int = 2) -> Iterator[None]:
    """rlcore's local Ray cluster of ``num_cpus`` CPUs while the block runs."""
    from rlcore.config import ClusterConfig
    from rlcore.runtime.cluster import Cluster

    cluster = Cluster(ClusterConfig(num_cpus=num_cpus)).start()
    try:
        yield
    finally:
        cluster.shutdown()


def actor_pids(name: str) -> set[int]:
    """Live actor processes of worker class ``name`` started from this process (Ray
    titles them after the class)."""
    import psutil

    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if name in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                pids.add(p.pid)
        except psutil.Error:
            pass
    return pids


def check_logprobs(worker: Any, model_dir: str | Path) -> None:
    """``worker.logprobs`` of :data:`GRPO_BATCH` match transformers' within 1e-5, one list
    per completion token; a row with an empty prompt is refused, naming the row."""
    got = worker.logprobs(GRPO_BATCH)
    lengths = [len(c) for _, c in GRPO_BATCH]
    assert [len(r) for r in got] == lengths, f"{[len(r) for r in got]} logprobs, want {lengths}"
    diff = max_diff(got, reference_logprobs(hf_model(model_dir), GRPO_BATCH))
    assert diff < 1e-5, f"logprobs differ from transformers' by {diff}"
    with pytest.raises(ValueError, match="row 1 has an empty prompt"):
        worker.logprobs([([2], [3]), ([], [3])])


def check_train_step(
    worker: Any, model_dir: str | Path, *, weight_atol: float, loss: Callable[[list], Any] | None = None
) -> dict[str, Any]:
    """One step of ``worker`` (``logprobs``, ``train_step``, ``export_state_dict``, loaded
    from ``model_dir``) with perturbed old logprobs equals :func:`reference_step`: loss,
    gradient norm, clip fraction, a clip fraction strictly between 0 and 1, 10 tokens, the
    step's lr; every weight but the norms moved, each within ``weight_atol`` of the
    reference's. ``loss(current_logprobs)``: the :class:`rlcore.handles.LossOptions` of the
    step (its engine logprobs made from the current ones). Returns the step's metrics."""
    import torch

    before = worker.export_state_dict()
    current = worker.logprobs(GRPO_BATCH)
    old = perturbed_old(current)
    shape = loss(current) if loss is not None else None
    extra = {} if shape is None else {"loss": shape}
    got = worker.train_step(GRPO_BATCH, GRPO_ADVANTAGES, old, CLIP_EPS, LR, **extra)
    ref = reference_step(hf_model(model_dir), GRPO_BATCH, GRPO_ADVANTAGES, old, loss=shape)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), (got, ref["loss"])
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (got, ref["grad_norm"])
    assert got["clip_fraction"] == pytest.approx(ref["clip_fraction"]), (got, ref["clip_fraction"])
    assert 0.0 < got["clip_fraction"] < 1.0 and got["tokens"] == 10 and got["lr"] == LR, got
    after = worker.export_state_dict()
    unmoved = [n for n in before if "norm" not in n and torch.equal(before[n], after[n])]
    assert not unmoved, f"the step left {unmoved} unchanged"
    for name, t in ref["state"].items():
        torch.testing.assert_close(after[name], t, rtol=0, atol=weight_atol, msg=name)
    return got


def check_group_train_step(
    policy: Any, model_dir: str | Path, *, weight_atol: float
) -> list[dict[str, Any]]:
    """:func:`check_train_step` through a policy handle over a worker group whose ranks have
    ``export_state_dict``: loss and gradient norm as the reference's, rank 0's export
    within ``weight_atol`` of its weights. Returns every rank's export."""
    import torch

    old = perturbed_old(policy.logprobs(GRPO_BATCH))
    got = policy.train_step(GRPO_BATCH, GRPO_ADVANTAGES, old, clip_eps=CLIP_EPS, lr=LR)
    ref = reference_step(hf_model(model_dir), GRPO_BATCH, GRPO_ADVANTAGES, old)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), (got, ref["loss"])
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (got, ref["grad_norm"])
    exported = list(policy.group.call("export_state_dict"))
    for name, t in ref["state"].items():
        torch.testing.assert_close(exported[0][name], t, rtol=0, atol=weight_atol, msg=name)
    return exported


def check_on_policy_step(worker: Any) -> None:
    """Without old logprobs the ratio is 1: the loss of a step at lr 0 on two rows (4 tokens
    at advantage +1, 1 at -1) is minus their token-weighted mean advantage, nothing clipped."""
    got = worker.train_step(GRPO_BATCH[:2], [1.0, -1.0], None, CLIP_EPS, 0.0)
    assert got["loss"] == pytest.approx(-(4 - 1) / 5) and got["clip_fraction"] == 0.0, got

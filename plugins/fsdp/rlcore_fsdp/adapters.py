"""LoRA adapters on the FSDP policy, through ``peft`` (``policy.options.lora``).

:func:`attach` wraps the Hugging Face model in peft's LoRA model before FSDP shards it:
the base weights are frozen (``requires_grad=False``, so the optimizer holds none of
them) and each targeted linear layer gets its two adapter matrices. FSDP1 flattens
frozen and trained parameters of one unit together only with ``use_orig_params``.

The model is exported merged (:func:`merged_name`, :func:`export_role`): an adapted
layer's weight leaves as ``base + delta`` under the base model's own name
(``model.layers.0.self_attn.q_proj.weight``), the adapter matrices not at all, so a
refit or ``rlcore export`` carries the weights the policy computes with, in the
layout every generation backend already loads.

peft is imported here only, inside the functions: the worker imports this module
when the options ask for adapters.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torch import nn

    from rlcore.lora import LoraOptions

#: peft's name of the one adapter the policy trains.
ADAPTER = "default"
#: Prefix peft's model puts before the base model's parameter names.
_PEFT_PREFIX = "base_model.model."
#: Module path segment between an adapted layer and its frozen original.
_BASE_LAYER = ".base_layer."


def attach(model: nn.Module, lora: LoraOptions) -> nn.Module:
    """``model`` with trainable LoRA adapters on ``lora.target_modules``, everything else
    frozen. A target that matches no module is a :class:`ValueError` naming the key and
    the model's linear layers."""
    from peft import LoraConfig, get_peft_model

    targets: Any = lora.target_modules
    if list(targets) == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        # Adapters in the model's dtype: peft would make them float32 beside bfloat16 base
        # weights, and FSDP1 flattens one unit's parameters into one tensor of one dtype.
        return get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as err:
        raise ValueError(
            f"policy.options.lora.target_modules={list(lora.target_modules)} matches no layer of "
            f"{type(model).__name__} ({err}); its linear layers are named "
            f"{', '.join(sorted(linear_names(model))) or '(none)'}, or use [all-linear]"
        ) from None


def linear_names(model: nn.Module) -> set[str]:
    """The last name part of every linear layer of ``model`` (what ``target_modules`` matches)."""
    from torch import nn

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def merged_name(name: str) -> str:
    """A parameter name of the peft-wrapped model as the base model names it."""
    return name.removeprefix(_PEFT_PREFIX).replace(_BASE_LAYER, ".")


def adapted_layers(model: nn.Module) -> dict[int, Any]:
    """``id(base layer) -> its peft LoRA layer`` for every adapted layer of ``model``."""
    from peft.tuners.lora import LoraLayer

    return {
        id(m.base_layer): m for m in model.modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A
    }


def adapter_modules(model: nn.Module) -> set[int]:
    """``id`` of every adapter matrix module (``lora_A``/``lora_B``): trained, never exported."""
    from peft.tuners.lora import LoraLayer

    ids: set[int] = set()
    for m in model.modules():
        if isinstance(m, LoraLayer):
            for part in (m.lora_A, m.lora_B, m.lora_embedding_A, m.lora_embedding_B):
                ids.update(id(sub) for sub in part.modules())
    return ids


def is_adapter(name: str) -> bool:
    """Whether a parameter (or state-dict key) of the peft-wrapped model is an adapter matrix."""
    return any(f".{part}." in name for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"))


def saved_name(name: str) -> str:
    """An adapter matrix's name in the model as peft saves it (the adapter's name dropped:
    ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    return name.replace(f".{ADAPTER}.", ".")


def saved_config(model: Any) -> dict[str, Any]:
    """peft's adapter config of the (FSDP-wrapped) model, as ``adapter_config.json`` holds it."""
    peft_model = getattr(model, "module", model)
    config = peft_model.peft_config[ADAPTER].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def delta(layer: Any) -> Any:
    """The adapters' product for ``layer`` (``scale * B @ A``, as peft merges it), in the
    base weight's layout and dtype; needs the adapter matrices unsharded."""
    return layer.get_delta_weight(ADAPTER)


class Part(NamedTuple):
    """The piece of one adapter matrix a rank's FSDP shard holds: ``values`` are its
    flattened elements from ``start`` on, of the matrix ``name`` of ``shape``."""

    name: str
    shape: tuple[int, ...]
    start: int
    values: Any


def assemble(parts: list[Part]) -> dict[str, Any]:
    """Every adapter matrix whole from the ranks' :class:`Part` s; a matrix whose parts do
    not cover it exactly is a :class:`RuntimeError` naming it."""
    import torch

    whole: dict[str, Any] = {}
    covered: dict[str, int] = {}
    for part in sorted(parts, key=lambda p: (p.name, p.start)):
        if part.name not in whole:
            whole[part.name] = torch.empty(math.prod(part.shape), dtype=part.values.dtype)
            covered[part.name] = 0
        whole[part.name][part.start : part.start + part.values.numel()] = part.values
        covered[part.name] += part.values.numel()
    shapes = {p.name: p.shape for p in parts}
    short = [n for n, c in covered.items() if c != math.prod(shapes[n])]
    if short:
        raise RuntimeError(f"the ranks' shards cover adapter matrices {short[:3]} only in part")
    return {n: t.view(shapes[n]) for n, t in whole.items()}


def trainable(model: nn.Module) -> Iterator[Any]:
    """The parameters the optimizer trains (the adapters when attached)."""
    return (p for p in model.parameters() if p.requires_grad)


@contextlib.contextmanager
def dropout_on(model: nn.Module, lora: LoraOptions | None) -> Iterator[None]:
    """The adapters' dropout in training mode for a training step; everything else keeps
    the eval mode the worker holds (no effect without adapters or dropout)."""
    if lora is None or lora.dropout <= 0:
        yield
        return
    from peft.tuners.lora import LoraLayer

    dropouts = [d for m in model.modules() if isinstance(m, LoraLayer) for d in m.lora_dropout.values()]
    for d in dropouts:
        d.train()
    try:
        yield
    finally:
        for d in dropouts:
            d.eval()

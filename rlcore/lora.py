"""Low-rank adapters (LoRA) as the contract states them (contract 2.4).

A policy backend that declares ``trains_adapters`` (:class:`rlcore.declarations.BackendDeclaration`)
takes ``policy.options.lora``, a mapping with the fields of :class:`LoraOptions`, and puts
its options dataclass's ``lora`` field in that type (``lora: LoraOptions | None = None``),
so every such backend reads the same keys. With it set, the backend:

* trains only the adapters: the base weights are frozen and have no optimizer state;
* exports merged weights wherever it exports (refit, ``rlcore export``): each adapted
  weight is the base weight plus the adapters' product, under the base weight's name, so
  every generation backend and every transport take them as any refit;
* gives the adapters alone (:class:`rlcore.handles.AdapterSource`), which the refit carries
  instead to a generation that serves them in place (``takes_adapters``, contract 2.6:
  :mod:`rlcore.refit.adapters`);
* checkpoints and resumes the adapters and their optimizer state like any training state.

The core refuses ``policy.options.lora`` for a policy that does not declare it, before
anything starts (:func:`check_lora_request`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcore.config import bounded
from rlcore.errors import ConfigError

#: ``target_modules`` entry that means every linear layer but the output head (peft's own term).
ALL_LINEAR = "all-linear"
#: How an adapter refit travels (:attr:`rlcore.handles.RefitReport.transport`, refit content
#: ``adapters``): the driver hands the tensors to the engines through Ray's object store.
ADAPTER_TRANSPORT = "object_store"


@dataclass
class LoraOptions:
    """``policy.options.lora``: the adapters a policy trains instead of its weights.

    The adapted weight is ``W + (alpha / rank) * B @ A``, ``A`` of ``rank`` rows
    (random at start) and ``B`` of ``rank`` columns (zero at start, so the first step
    starts from the base model).
    """

    #: Rank of each adapter (the inner dimension of ``B @ A``).
    rank: int = bounded(8, ge=1)
    #: Scale numerator: the product is scaled by ``alpha / rank``.
    alpha: float = bounded(16.0, gt=0)
    #: Dropout on the adapters' input while training (0: none; the logprobs the loss's
    #: ratio compares against are computed without it).
    dropout: float = bounded(0.0, ge=0, le=0.9)
    #: Which layers get adapters: module names as the model names them (``q_proj``,
    #: ``v_proj``), or ``all-linear`` for every linear layer but the output head.
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])

    @property
    def scale(self) -> float:
        """The factor on ``B @ A``."""
        return self.alpha / self.rank


def requested_lora(options: Any) -> bool:
    """Whether a role's options (its mapping from the config, or its resolved dataclass)
    ask for adapters: a ``lora`` entry that is set."""
    raw = options.get("lora") if isinstance(options, Mapping) else getattr(options, "lora", None)
    return raw is not None


def lora_options(options: Any) -> LoraOptions | None:
    """The :class:`LoraOptions` a role's options ask for (its resolved dataclass's ``lora``
    field, or the ``lora`` entry of a plain mapping), or None."""
    raw = options.get("lora") if isinstance(options, Mapping) else getattr(options, "lora", None)
    if raw is None or isinstance(raw, LoraOptions):
        return raw
    return LoraOptions(**dict(raw))


def check_lora_request(options: Any, *, backend: str, trains_adapters: bool) -> None:
    """Refuse ``policy.options.lora`` for a policy backend that does not train adapters:
    one line naming the backend, the key and the way out."""
    if requested_lora(options) and not trains_adapters:
        raise ConfigError(
            f"policy.options.lora is set but policy backend '{backend}' does not train adapters "
            "(its declaration has no trains_adapters); remove policy.options.lora, or choose a "
            "policy backend that declares it (rlcore plugins --json: trains_adapters)",
            key="policy.options.lora",
        )

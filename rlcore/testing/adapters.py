"""A reference source of LoRA adapters for the conformance suite and tests of generation
backends that serve adapters in place (``takes_adapters``, contract 2.6).

:class:`PeftAdapters` is the checkpoint under peft with adapters set from a seed: an
:class:`rlcore.handles.AdapterSource` whose adapters the core's refit hands to the
generation (:mod:`rlcore.refit.adapters`), and the reference logprobs of base + those
adapters the generation must then compute. peft and transformers are imported on use.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from rlcore.lora import LoraOptions

#: The adapters a generation is checked with: every kind of layer the tiny model has
#: (attention, MLP, the output head), rank 4.
CHECKED = LoraOptions(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])


class PeftAdapters:
    """The checkpoint in ``model_dir`` under peft's LoRA (``lora``), float32, eval mode.
    peft starts ``B`` at zero (the base model); :meth:`set_adapters` makes them matter."""

    def __init__(self, model_dir: str | Path, lora: LoraOptions = CHECKED) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        config = LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), task_type="CAUSAL_LM"
        )
        self.model = get_peft_model(base, config).eval()

    def set_adapters(self, seed: int, scale: float = 0.3) -> None:
        """Every ``B`` drawn from ``seed`` (``A`` as peft drew it)."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(scale * torch.randn(p.shape, generator=gen))

    def adapter_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """:class:`rlcore.handles.AdapterSource`: the adapters as peft saves them, and its config."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model)
        config = self.model.peft_config["default"].to_dict()
        tensors = {k: v.detach().clone() for k, v in state.items()}
        return tensors, {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

    def logprobs(self, batch: list[tuple[list[int], list[int]]], *, base: bool = False) -> list[list[float]]:
        """Each completion token's logprob given everything before it, with the adapters
        (``base``: without them)."""
        from rlcore.testing.reference import reference_logprobs

        with self.model.disable_adapter() if base else contextlib.nullcontext():
            return reference_logprobs(self.model, batch)

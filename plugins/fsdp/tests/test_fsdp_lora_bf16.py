"""LoRA on the fsdp policy in bfloat16 (``policy.options.lora``, ``model.dtype=bfloat16``): two
ranks of their own. A module of its own: its policy needs the module's Ray cluster's CPUs,
which test_fsdp_lora.py's shared two-rank policy holds until that module ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.testing.policy_checks import CLIP_EPS
from rlcore.testing.reference import GRPO_ADVANTAGES, GRPO_BATCH


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bfloat16_adapters_are_flattened_with_the_bfloat16_base(
    ray_cluster: None, tmp_path: Path, policy_context: Any
) -> None:
    """peft makes adapters float32 by default; beside bfloat16 base weights FSDP1 refused to
    flatten the unit ("uniform dtype"), as the first GPU run with LoRA found: the adapters
    now take the model's dtype, and the policy trains."""
    from rlcore_fsdp.plugin import rlcore_init_policy

    handle = rlcore_init_policy(
        policy_context(tmp_path, "policy.options.lora.rank=4", "model.dtype=bfloat16")
    )
    try:
        stats = handle.train_step(GRPO_BATCH, GRPO_ADVANTAGES, None, clip_eps=CLIP_EPS, lr=5e-2)
        assert stats["grad_norm"] > 0
        tensors, _ = handle.adapter_state()
        assert tensors and {t.dtype for t in tensors.values()} == {torch.bfloat16}
    finally:
        handle.shutdown()

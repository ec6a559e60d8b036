"""The ``megatron`` declaration: valid, light to import, options checked by the core."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlcore.config import resolve_options
from rlcore.declarations import CheckpointSupport, Role, Transport, validate_declaration
from rlcore.errors import ConfigError
from rlcore_megatron.options import MegatronOptions
from rlcore_megatron.plugin import rlcore_declare_backend


def test_declaration_is_valid_and_says_what_the_brief_says() -> None:
    decl = validate_declaration(
        rlcore_declare_backend(), plugin="megatron", distribution="rlcore-megatron"
    )
    assert decl.roles == {Role.POLICY, Role.GENERATION}
    # Neither role sizes itself from free device memory, so starting them together on shared
    # GPUs reaches the same peak as starting them in turn (docs/decisions.md).
    assert decl.overlap.non_colocated and decl.overlap.colocated
    assert [(a.name, a.atomic, a.role) for a in decl.produces] == [
        ("megatron.checkpoint", True, Role.POLICY)
    ]
    assert decl.needed(Role.GENERATION, {"refit_fed": False})[0].name == "megatron.checkpoint"
    assert decl.needed(Role.GENERATION, {"refit_fed": True}) == []
    assert decl.needed(Role.POLICY, {"refit_fed": False}) == []
    both = {Transport.COLLECTIVE, Transport.DISK, Transport.SHARED_MEMORY}
    assert decl.send_transports == both and decl.receive_transports == both
    assert decl.refit_fed and decl.options is MegatronOptions
    # rlcore.serve.openai_endpoint in front of either engine (generation.options.serve_openai).
    assert decl.openai_endpoint and "serve_openai" in (decl.option_names() or [])
    # Training checkpoints (contract 2.2): the save only reads state, so it may overlap sampling.
    assert decl.checkpoint == CheckpointSupport("megatron-dist-ckpt", "1", overlap=True)
    assert decl.contract_version == "2.6"


def test_options_are_checked_against_the_dataclass() -> None:
    opts = resolve_options(
        {"tensor_model_parallel_size": 2}, MegatronOptions, section="policy", backend="megatron"
    )
    assert opts == MegatronOptions(tensor_model_parallel_size=2)
    assert {"micro_batch_size", "max_grad_norm", "max_batch_size", "device"} <= set(
        MegatronOptions.__dataclass_fields__
    )
    with pytest.raises(ConfigError, match="tensor_model_parallel_size"):
        resolve_options(
            {"tensor_parallel_size": 2}, MegatronOptions, section="policy", backend="megatron"
        )


def test_plugin_and_checkpoint_key_import_no_heavy_module() -> None:
    """Nor the worker module, which the driver imports to name the actor classes."""
    code = (
        "import sys, rlcore_megatron.plugin, rlcore_megatron.checkpoint, rlcore_megatron.convert, "
        "rlcore_megatron.handle, rlcore_megatron.worker, rlcore_megatron.train_state; "
        "print(sorted(m for m in ('torch', 'megatron', 'ray', 'transformers', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"

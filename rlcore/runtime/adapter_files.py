"""An engine's private directories of LoRA adapters, as peft saves them.

The engines of this field load adapters from a peft directory (``adapter_config.json`` and
``adapter_model.safetensors``: vLLM's ``LoRARequest``, SGLang's ``load_lora_adapter``), so an
engine that takes an adapter refit writes the tensors it was handed into one first. Each
refit writes a new directory, renamed into place when whole (an engine never reads half an
adapter); older ones are removed once the new one is loaded, and all of them at teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: peft's file names.
CONFIG_FILE = "adapter_config.json"
TENSORS_FILE = "adapter_model.safetensors"


class AdapterDirs:
    """Adapter directories under one private root (made at the first write)."""

    def __init__(self, prefix: str = "rlcore-adapter-") -> None:
        self.prefix = prefix
        self.root: Path | None = None

    def write(self, step: int, tensors: dict[str, Any], config: dict[str, Any]) -> Path:
        """The peft directory of the adapter of ``step`` (``tensors`` by peft's names)."""
        from safetensors.torch import save_file

        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix=self.prefix))
        final = self.root / f"step-{step}"
        staging = Path(tempfile.mkdtemp(prefix=f".step-{step}-", dir=self.root))
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / TENSORS_FILE))
            (staging / CONFIG_FILE).write_text(json.dumps(config, default=_jsonable))
            if final.exists():  # the same step again (a replaced engine, a retried refit)
                shutil.rmtree(final)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final

    def keep_only(self, current: Path) -> None:
        """Remove every adapter directory but ``current`` (it is loaded: the rest are not used)."""
        if self.root is None:
            return
        for entry in self.root.iterdir():
            if entry != current:
                shutil.rmtree(entry, ignore_errors=True)

    def remove(self) -> None:
        """Remove the root and everything in it. Idempotent."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def _jsonable(value: Any) -> Any:
    """peft's config holds sets and enums: as ``save_pretrained`` writes them."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    return getattr(value, "value", str(value))

"""The run's tokenizer: transformers' ``AutoTokenizer`` of the checkpoint, chat template included.

One function so the driver, the envs and the OpenAI-compatible endpoints load it the same
way. transformers is imported under :data:`TRANSFORMERS_LOCK`: its lazy module imports are
not safe from two threads at once (the tokenizer prefetch runs beside the model's creation).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

#: Held around every import of transformers by rlcore.
TRANSFORMERS_LOCK = threading.Lock()


def load(path: Path | str) -> Any:
    """transformers' ``AutoTokenizer`` of the checkpoint at ``path``."""
    with TRANSFORMERS_LOCK:
        from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

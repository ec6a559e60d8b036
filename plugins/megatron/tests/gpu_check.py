"""Conversion logits and round trip on CUDA (NCCL, TP=1 and TP=2): ``python tests/gpu_check.py OUT``.

Not a pytest test (the CPU suite covers the same checks over gloo); run on a GPU
machine with megatron-core installed. Writes the tiny Llama/Qwen2 models with
transformers only (no rlcore config dependencies) and prints one JSON report.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _megatron_helpers import (  # noqa: E402
    spawn_ranks,
    tp_worker,
    write_hf_model,
    write_tiny_qwen2,
)


def write_tiny_llama(directory: Path) -> None:
    def init(model: Any) -> None:
        for p in model.parameters():
            p.normal_(0, 0.05)

    write_hf_model(
        directory,
        "llama",
        init=init,
        vocab_size=52,
        hidden_size=128,
        intermediate_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "llama").mkdir(exist_ok=True)
    (out / "qwen2").mkdir(exist_ok=True)
    write_tiny_llama(out / "llama")
    write_tiny_qwen2(out / "qwen2")
    models = [("llama", str(out / "llama")), ("qwen2", str(out / "qwen2"))]
    reports = {}
    for tp in (1, 2):
        t0 = time.monotonic()
        spawn_ranks(
            tp_worker, tp, ((out / f"rv{tp}").as_uri(), models, [], str(out / f"tp{tp}.json")), 300
        )
        reports[f"tp{tp}"] = json.loads((out / f"tp{tp}.json").read_text()) | {
            "wall_s": time.monotonic() - t0
        }
    print(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()

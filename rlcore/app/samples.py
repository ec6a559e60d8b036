"""``samples.jsonl``: what the model said, step by step, beside ``metrics.jsonl``.

Every ``logging.samples_every`` steps the loop writes ``logging.samples_per_step`` of the
step's samples (the first sample of each of the first groups: one per prompt, so the lines
show different prompts), one JSON line each: ``step``, ``prompt``, ``completion`` (both
decoded, special tokens removed), ``reward``, ``weight_version`` (the oldest weights any of
its tokens came from) and ``time``. The size stays bounded: at the defaults (4 every step)
a 1,000-step run writes 4,000 lines. Lines are appended as ``metrics.jsonl``'s are
(:class:`rlcore.app.records.MetricsWriter`: whole lines, a cut one dropped).

``rlcore samples DIR`` prints the newest of them (:func:`newest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.app.records import MetricsWriter, read_metrics
from rlcore.handles import Rollout

FILE = "samples.jsonl"


def due(step: int, every: int) -> bool:
    """Whether ``step``'s samples are written (``every`` 0: never)."""
    return every > 0 and step % every == 0


def sample_lines(
    step: int, groups: Sequence[Sequence[Rollout]], tokenizer: Any, version: int, per_step: int
) -> list[dict[str, Any]]:
    """The lines of ``step``: the first sample of each of the first ``per_step`` groups
    (then second samples, when there are fewer groups), decoded."""
    picked = [g[i] for i in range(max((len(g) for g in groups), default=0)) for g in groups if i < len(g)]
    lines = []
    for r in picked[:per_step]:
        versions = r.get("versions") or [version]
        lines.append({
            "step": step,
            "prompt": tokenizer.decode(list(r["prompt_ids"]), skip_special_tokens=True),
            "completion": tokenizer.decode(list(r["token_ids"]), skip_special_tokens=True),
            "reward": r.get("reward"),
            "weight_version": min(versions),
        })
    return lines


def write_samples(run_dir: Path, lines: Sequence[dict[str, Any]]) -> None:
    """Append ``lines`` to the run's ``samples.jsonl`` (whole lines, as ``metrics.jsonl``)."""
    with MetricsWriter(run_dir / FILE) as writer:
        for line in lines:
            writer.write(line)


def newest(run_dir: Path, count: int, step: int | None = None) -> list[dict[str, Any]]:
    """The last ``count`` lines of the run's ``samples.jsonl`` (of ``step`` only, when given)."""
    path = run_dir / FILE
    if not path.exists():
        return []
    lines = [r for r in read_metrics(path) if step is None or r.get("step") == step]
    return lines[-count:] if count > 0 else lines

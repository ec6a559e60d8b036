"""rlcore's conformance suite against the dataset env backend, on the repository's example
(its math word problems and reward file), sampling through rlcore's reference generation."""

from __future__ import annotations

from pathlib import Path

from rlcore.testing import BackendConformance

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


class TestDatasetConformance(BackendConformance):
    plugin = "rlcore_dataset.plugin"
    config_overrides = [
        f"env.options.data={EXAMPLES / 'math_word_problems.jsonl'}",
        f"env.options.reward={EXAMPLES / 'math_reward.py'}:final_answer",
    ]

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    """Ten rows: prompt, answer and an id."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "id": i}) + "\n" for i in range(10)))
    return path

"""End to end: ``rlcore export`` of a real run's checkpoints (FSDP policy, CPU).

The session's shared quickstart run (tests/e2e/conftest.py) saves the checkpoints of steps 8
and 12. Exported,
transformers loads the result and gives the restored policy's per-token logprobs (taken in
the export before its teardown) within 1e-5; ``--step`` takes an older one; a corrupt newest
one is skipped by name; an existing HF_DIR is refused before anything starts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quickstart_run import STEPS  # noqa: E402  (the shared run's)
from safetensors.torch import load_file  # noqa: E402

from rlcore.app.checkpoints import POLICY_DIR, step_dir  # noqa: E402
from rlcore.app.export import Exported, export_checkpoint  # noqa: E402
from rlcore.config import load_config  # noqa: E402
from rlcore.models.tiny import ensure_model  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RLCORE = Path(sys.executable).with_name("rlcore")


@dataclass
class Checkpointed:
    run: Path
    cache: Path


@pytest.fixture(scope="module")
def checkpointed(quickstart: Any) -> Checkpointed:
    """The session's shared quickstart run (tests/e2e/conftest.py): checkpoints of steps 8 and 12."""
    run = quickstart.dir
    assert step_dir(run / "checkpoints", STEPS - 4).is_dir() and step_dir(run / "checkpoints", STEPS).is_dir()
    return Checkpointed(run, quickstart.cache)


def export_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RLCORE), "export", *args], capture_output=True, text=True, cwd=REPO, timeout=600)


def hf_logprobs(model_dir: Path, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """Per-token logprobs of each completion under the model transformers loads from ``model_dir``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    rows = []
    with torch.no_grad():
        for prompt, completion in pairs:
            ids = torch.tensor([prompt + completion])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])
            rows.append(picked[:, 0].tolist())
    return rows


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@dataclass
class Newest:
    exported: Exported
    pairs: list[tuple[list[int], list[int]]]


@pytest.fixture(scope="module")
def newest(checkpointed: Checkpointed, tmp_path_factory: pytest.TempPathFactory) -> Newest:
    """The default export (the newest checkpoint), with the restored policy's logprobs of a few pairs."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base_model(checkpointed)))
    pairs = [
        (tokenizer.encode(p, add_special_tokens=False), tokenizer.encode(c, add_special_tokens=False))
        for p, c in (("3+4=", "7"), ("12+30=", "42"), ("9+9=", "17 or 18"))
    ]
    return Newest(export_checkpoint(checkpointed.run, tmp_path_factory.mktemp("newest") / "hf", probe=pairs), pairs)


def base_model(checkpointed: Checkpointed) -> Path:
    """The model the run started from (the tiny model rlcore made, in the run's cache)."""
    return ensure_model(load_config(checkpointed.run / "config.yaml").model, checkpointed.cache)


def test_the_export_loads_in_transformers_and_gives_the_restored_policys_logprobs(
    checkpointed: Checkpointed, newest: Newest
) -> None:
    out, pairs = newest.exported, newest.pairs
    assert out.selected.step == STEPS and out.selected.skipped == []
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(out.files)
    got = hf_logprobs(out.path, pairs)
    assert [len(r) for r in got] == [len(c) for _, c in pairs]
    worst = max(abs(a - b) for r, s in zip(got, out.logprobs, strict=True) for a, b in zip(r, s, strict=True))
    assert worst < 1e-5, f"transformers' logprobs differ from the restored policy's by {worst}"
    # Trained weights, not the model the run started from.
    base = load_file(str(base_model(checkpointed) / "model.safetensors"))
    exported = weights(out.path)
    assert set(base) <= set(exported)
    assert any(not torch.equal(exported[n], base[n]) for n in base)


def test_a_corrupt_newest_is_skipped_by_name_and_refusals_are_one_line(
    checkpointed: Checkpointed, newest: Newest, tmp_path: Path
) -> None:
    # (--step's choice is unit-tested in tests/app/test_export.py: one export less here, for CI's time.)
    copy = tmp_path / "run"
    shutil.copytree(checkpointed.run / "checkpoints", copy / "checkpoints")
    shard = next(p for p in sorted((step_dir(copy / "checkpoints", STEPS) / POLICY_DIR).rglob("*")) if p.is_file())
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 0xFF]))

    proc = export_cli(str(copy), "--to", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"(step {STEPS - 4}); skipped step-{STEPS:08d} (corrupt: policy/" in proc.stdout
    one, two = weights(tmp_path / "hf"), weights(newest.exported.path)
    assert set(one) == set(two) and any(not torch.equal(two[n], one[n]) for n in one)  # step 8's, not 12's

    proc = export_cli(str(copy), "--step", str(STEPS), "--to", str(tmp_path / "again"))
    assert proc.returncode == 2 and f"step-{STEPS:08d} is unusable: corrupt" in proc.stderr
    proc = export_cli(str(copy), "--to", str(tmp_path / "hf"))
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    assert not (tmp_path / "again").exists()

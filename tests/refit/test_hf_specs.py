"""The weight specs of a Hugging Face checkpoint: worked out on the meta device, kept in the
run's cache and read back without torch by the next run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.refit.hf_specs import CACHE_NAME, hf_weight_specs, specs_key
from rlcore.refit.worker import HFWeightSpecs
from rlcore.testing.fixtures import tiny_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def _state_dict_specs(model: Path, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in loaded.state_dict().items()]


def test_specs_are_the_checkpoints_state_dict(model: Path) -> None:
    specs = hf_weight_specs(model, "bfloat16")
    assert [(s.name, s.shape, s.dtype) for s in specs] == _state_dict_specs(model, "bfloat16")


def test_a_second_call_reads_the_cache_without_torch(model: Path, tmp_path: Path) -> None:
    first = hf_weight_specs(model, "float32", tmp_path)
    stored = tmp_path / CACHE_NAME / f"{specs_key(model, 'float32')}.json"
    assert stored.is_file() and [e["name"] for e in json.loads(stored.read_text())] == [s.name for s in first]
    assert list((tmp_path / CACHE_NAME).iterdir()) == [stored]  # no temporary file left
    code = (
        "import sys\n"
        "from rlcore.refit.hf_specs import hf_weight_specs\n"
        f"specs = hf_weight_specs({str(model)!r}, 'float32', {str(tmp_path)!r})\n"
        "print(len(specs), sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [str(len(first)), "[]"]
    assert hf_weight_specs(model, "float32", tmp_path) == first


def test_the_key_follows_config_and_dtype(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((model / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    assert len({specs_key(model, "float32"), specs_key(model, "bfloat16"), specs_key(other, "float32")}) == 3
    assert specs_key(model, "float32") == specs_key(model, "float32")
    fewer = hf_weight_specs(other, "float32", tmp_path)
    assert len(fewer) < len(hf_weight_specs(model, "float32", tmp_path))
    assert len(list((tmp_path / CACHE_NAME).iterdir())) == 2


def test_an_unreadable_cache_file_is_built_again(model: Path, tmp_path: Path) -> None:
    stored = tmp_path / CACHE_NAME / f"{specs_key(model, 'float32')}.json"
    stored.parent.mkdir()
    stored.write_text('[{"name": "half-writ')
    specs = hf_weight_specs(model, "float32", tmp_path)
    assert specs == hf_weight_specs(model, "float32") and len(json.loads(stored.read_text())) == len(specs)


class Engine(HFWeightSpecs):
    def __init__(self, model_dir: str, dtype: str, specs_cache: str | None = None) -> None:
        self.model_dir, self.dtype, self.specs_cache = model_dir, dtype, specs_cache


def test_an_engine_works_out_its_weight_specs_while_its_server_starts(model: Path) -> None:
    """Specs worked out in a thread (during a server's start) are the ones worked out on
    demand at the same time: every name, shape and dtype. transformers switches torch's
    process-wide default dtype while it builds a model, so the builds must not overlap."""
    ahead = Engine(str(model), "bfloat16")
    ahead._work_out_specs_ahead()
    on_demand = Engine(str(model), "bfloat16").weight_specs()
    assert ahead._specs_ahead is not None and ahead.weight_specs() == on_demand
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= {s.name for s in on_demand}
    assert {s.dtype for s in on_demand} == {"bfloat16"}

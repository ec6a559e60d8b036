"""rlcore.tokenizer: the fast path gives transformers' ids and texts, or is not taken."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore import tinymodel, tokenizer
from rlcore.config import ModelConfig

# Texts of the tiny model's characters, its special tokens written out, and characters it lacks.
TEXT = st.lists(st.sampled_from([*tinymodel.ALPHABET, *tinymodel.SPECIAL_TOKENS, "A", "é", "\t"]), max_size=40).map("".join)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tinymodel.ensure_model(ModelConfig(), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def pair(model_dir: Path):  # (rlcore's, transformers') tokenizers of the tiny model
    from transformers import AutoTokenizer

    return tokenizer.load(model_dir), AutoTokenizer.from_pretrained(str(model_dir))


def _variant(model_dir: Path, dest: Path, **config_changes: object) -> Path:
    """The tiny model's tokenizer files with ``tokenizer_config.json`` changed."""
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_tiny_model_takes_the_fast_path(pair) -> None:
    fast, ref = pair
    assert isinstance(fast, tokenizer.FastTokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token", "bos_token"):
        assert getattr(fast, name) == getattr(ref, name), name
    assert len(fast) == len(ref)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, specials=st.booleans())
def test_encode_matches_transformers(pair, text: str, specials: bool) -> None:
    fast, ref = pair
    assert fast(text, add_special_tokens=specials).input_ids == list(ref(text, add_special_tokens=specials).input_ids)
    assert fast.encode(text, add_special_tokens=specials) == ref.encode(text, add_special_tokens=specials)
    assert fast([text, text + "1"]).input_ids == [list(ids) for ids in ref([text, text + "1"]).input_ids]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=0, max_value=51), max_size=30), skip=st.booleans())
def test_decode_matches_transformers(pair, ids: list[int], skip: bool) -> None:
    fast, ref = pair
    assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert fast.batch_decode([ids, ids[:3]], skip_special_tokens=skip) == ref.batch_decode([ids, ids[:3]], skip_special_tokens=skip)


def test_what_it_does_not_serve_comes_from_transformers(pair) -> None:
    fast, ref = pair
    assert fast.convert_ids_to_tokens([2, 5, 3]) == ref.convert_ids_to_tokens([2, 5, 3])
    padded = fast(["1", "1+2"], padding=True)  # a keyword rlcore does not handle
    assert [list(r) for r in padded["input_ids"]] == [list(r) for r in ref(["1", "1+2"], padding=True)["input_ids"]]


def test_pickles_without_its_transformers_tokenizer(pair) -> None:
    fast, _ = pair
    fast.convert_ids_to_tokens([2])  # loads the full tokenizer
    copy = pickle.loads(pickle.dumps(fast))
    assert copy._full is None and copy("1+2").input_ids == fast("1+2").input_ids


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"add_bos_token": True}, "add_bos_token"),
        ({"add_eos_token": True}, "add_eos_token"),
        ({"clean_up_tokenization_spaces": True}, "clean_up_tokenization_spaces"),
        ({"tokenizer_class": "LlamaTokenizerFast"}, "LlamaTokenizerFast"),
        ({"eos_token": "a"}, "'a' is not a special added token"),
        ({"added_tokens_decoder": {"7": {"content": "</s>", "special": True}}}, "'</s>' differs"),
    ],
)
def test_checkpoints_transformers_would_change_are_refused(model_dir: Path, tmp_path: Path, changes, why: str) -> None:
    path = _variant(model_dir, tmp_path / "tok", **changes)
    refusal = tokenizer.fast_path_refusal(path)
    assert refusal is not None and why in refusal
    assert not isinstance(tokenizer.load(path), tokenizer.FastTokenizer)


def test_loading_the_run_tokenizer_imports_neither_transformers_nor_torch(model_dir: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from rlcore import tokenizer; "
        f"t = tokenizer.load(Path({str(model_dir)!r})); t('1+2').input_ids; t.decode([5]); "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"

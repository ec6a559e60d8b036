"""rlcore.models.tokenizer: the tiny model's tokenizer is transformers' own, chat template included."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest

from rlcore.config import ModelConfig
from rlcore.models import tiny as tinymodel
from rlcore.models import tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tinymodel.ensure_model(ModelConfig(), tmp_path_factory.mktemp("cache"))


def test_the_tiny_models_tokenizer_is_transformers(model_dir: Path) -> None:
    from transformers import PreTrainedTokenizerBase

    tok = tokenizer.load(model_dir)
    assert isinstance(tok, PreTrainedTokenizerBase)
    assert [tok.pad_token, tok.unk_token, tok.bos_token, tok.eos_token] == tinymodel.SPECIAL_TOKENS
    ids = tok("12+3=?", add_special_tokens=False).input_ids
    assert len(ids) == 6 and tok.decode(ids) == "12+3=?"  # one token per character
    text = tok.apply_chat_template([{"role": "user", "content": "1+2"}], tokenize=False, add_generation_prompt=True)
    assert "1+2" in text and text != "1+2"


def test_it_pickles_as_envs_and_workers_get_it(model_dir: Path) -> None:
    tok = tokenizer.load(model_dir)
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode("ab") == tok.encode("ab") and copy.eos_token_id == tok.eos_token_id


def test_threads_load_it_at_once(model_dir: Path) -> None:
    """The driver loads it in a thread beside others that import transformers: the lock
    keeps transformers' lazy imports from racing."""
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(tokenizer.load(model_dir))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 4 and len({len(t) for t in got}) == 1  # type: ignore[arg-type]

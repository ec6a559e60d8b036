"""The locally made model's end-of-sequence shift (``model.tiny.eos_logit_bias``): random
weights end a completion by chance, about one token in fifty with the tiny vocabulary; the
shift makes the end rarer by about its exponent, for any text, and leaves the rest as drawn."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlcore.config import ModelConfig, RunConfig, TinyModelConfig, apply_model_preset
from rlcore.models.tiny import tiny_model_key, write_tiny_model


def eos_probability(directory: Path) -> tuple[float, torch.Tensor]:
    """Mean probability of end-of-sequence over random text, and the logits of token 10."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory)
    eos = AutoTokenizer.from_pretrained(directory).eos_token_id
    ids = torch.randint(4, model.config.vocab_size, (8, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return float(logits.softmax(-1)[..., eos].mean()), logits[..., 10]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[float, tuple[float, torch.Tensor]]:
    out = {}
    for shift in (0.0, -4.0):
        directory = tmp_path_factory.mktemp(f"tiny{shift}")
        write_tiny_model(directory, TinyModelConfig(eos_logit_bias=shift))
        out[shift] = eos_probability(directory)
    return out


def test_the_end_of_sequence_shift_makes_the_end_rarer_by_about_its_exponent(made: dict) -> None:
    plain, shifted = made[0.0][0], made[-4.0][0]
    assert 1 / 80 < plain < 1 / 30  # chance, with ~50 tokens
    assert math.exp(-5.5) < shifted / plain < math.exp(-2.5)


def test_the_shift_leaves_the_other_logits_close_to_as_drawn(made: dict) -> None:
    """Only dimension 0 of the residual stream changes meaning: another token's logits move
    by a fraction of their spread."""
    plain, shifted = made[0.0][1], made[-4.0][1]
    assert (plain - shifted).abs().mean() < 0.25 * plain.std()


def test_models_without_a_shift_keep_the_cache_key_they_had_and_a_preset_keeps_the_shift() -> None:
    assert tiny_model_key(TinyModelConfig(), "float32") == "llama-h128-l2-s0-9cd9890c4f5a"
    assert tiny_model_key(TinyModelConfig(eos_logit_bias=-3), "float32") != tiny_model_key(TinyModelConfig(), "float32")
    cfg = RunConfig(model=ModelConfig(preset="llama-1b", tiny=TinyModelConfig(seed=2, eos_logit_bias=-3)))
    apply_model_preset(cfg)
    assert (cfg.model.tiny.hidden_size, cfg.model.tiny.seed, cfg.model.tiny.eos_logit_bias) == (2048, 2, -3)

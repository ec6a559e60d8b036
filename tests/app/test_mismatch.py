"""The sampler/trainer mismatch of a step's own samples (issue 46 item 4): its figures against
a reference computation, the guard's two actions, and the loop recording them every step and
stopping before a mismatched step trains."""

from __future__ import annotations

import math

import pytest
from test_grpo import loop

from rlcore.app.mismatch import check_mismatch, mismatch_stats
from rlcore.config import GRPOConfig, load_config
from rlcore.errors import ConfigError, MismatchError


def test_the_figures_are_the_k3_kl_estimate_and_the_importance_weights() -> None:
    gen = [[-1.0, -2.0], [-0.5]]
    pol = [[-1.2, -1.5], [-0.5]]
    log_w = [-0.2, 0.5, 0.0]
    w = [math.exp(x) for x in log_w]
    got = mismatch_stats(gen, pol)
    assert got["mismatch/kl"] == pytest.approx(sum((a - 1) - b for a, b in zip(w, log_w, strict=True)) / 3)
    assert got["mismatch/is_weight_mean"] == pytest.approx(sum(w) / 3)
    assert (got["mismatch/is_weight_min"], got["mismatch/is_weight_max"]) == pytest.approx((min(w), max(w)))
    assert got["mismatch/tokens"] == 3
    same = mismatch_stats(gen, gen)
    assert same["mismatch/kl"] == 0.0 and same["mismatch/is_weight_min"] == same["mismatch/is_weight_max"] == 1.0
    with pytest.raises(ValueError):
        mismatch_stats([[]], [[]])


def test_the_guard_warns_or_stops_naming_the_step_the_backends_and_the_figure() -> None:
    stats = mismatch_stats([[-1.0, -1.0]], [[-1.5, -0.2]])
    assert check_mismatch(stats, None, "stop", step=3, policy="fsdp", generation="vllm") is None
    assert check_mismatch(stats, 10.0, "stop", step=3, policy="fsdp", generation="vllm") is None
    line = check_mismatch(stats, 0.01, "warn", step=3, policy="fsdp", generation="vllm")
    assert line is not None and line.startswith("step 3: generation 'vllm' and policy 'fsdp'") and "> grpo.max_mismatch 0.01" in line
    with pytest.raises(MismatchError, match=r"step 3: .*'vllm'.*'fsdp'.*KL estimate .* > grpo.max_mismatch 0.01.*not trained") as err:
        check_mismatch(stats, 0.01, "stop", step=3, policy="fsdp", generation="vllm")
    assert err.value.step == 3 and err.value.kl == pytest.approx(stats["mismatch/kl"])


def test_every_step_records_its_mismatch_and_a_matching_pair_is_at_zero() -> None:
    written, _ = loop(0.5, 0.5, 1.05)
    assert [m["mismatch/kl"] for m in written] == [0.0] * 3
    assert all(m["mismatch/is_weight_mean"] == 1.0 and m["mismatch/tokens"] == 8 for m in written)


def test_a_generation_that_samples_other_probabilities_stops_the_run_before_the_step_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generation reports logprobs 0.3 away from the policy's on every token (a broken
    sampler or refit); the refit check is off (no limit) so only the mismatch guard acts."""
    import test_grpo

    trained: list[int] = []
    real = test_grpo.Model.train_step

    def counting(self, *a, **kw):  # type: ignore[no-untyped-def]
        trained.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(test_grpo.Model, "train_step", counting)
    monkeypatch.setattr(test_grpo, "GRPOConfig", lambda **kw: GRPOConfig(**kw, max_mismatch=0.01, on_mismatch="stop"))
    with pytest.raises(MismatchError, match=r"step 1: generation 'gen' and policy 'pol'"):
        loop(0.5, 0.8, None)
    assert trained == []
    monkeypatch.setattr(test_grpo, "GRPOConfig", lambda **kw: GRPOConfig(**kw, max_mismatch=0.01, on_mismatch="warn"))
    written, _ = loop(0.5, 0.8, None)
    assert len(written) == 3 and len(trained) == 3
    assert all(m["mismatch/kl"] == pytest.approx(math.exp(0.3) - 1 - 0.3) for m in written)


def test_an_unknown_action_is_refused_naming_the_key() -> None:
    from pathlib import Path

    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    with pytest.raises(ConfigError, match="grpo.on_mismatch.*'halt'.*warn.*stop"):
        load_config(quickstart, ["grpo.on_mismatch=halt"])
    assert load_config(quickstart, ["grpo.max_mismatch=0.05"]).grpo.max_mismatch == 0.05

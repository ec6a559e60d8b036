"""Training health: a non-finite step stops the run naming backend, role and step; a
falling reward is flagged; a failure during a run exits 3, bad input 2."""

from __future__ import annotations

import math
from typing import Any

import pytest
from test_grpo import CharTokenizer, Model, Sevens

from rlcore.app import cli
from rlcore.app.grpo import probe_batch, run_grpo
from rlcore.app.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.app.health import TrainingHealthError, reward_trend, trend_line
from rlcore.config import GRPOConfig
from rlcore.errors import ConfigError, RefitError
from rlcore.handles import RefitReport


class Exploding(Model):
    """Trains normally until ``at``-th step, then reports ``metric`` as NaN."""

    def __init__(self, at: int, metric: str) -> None:
        super().__init__(0.5)
        self.at, self.metric, self.steps = at, metric, 0

    def train_step(self, batch: Any, adv: Any, old: Any = None, **kw: Any) -> dict[str, float]:
        self.steps += 1
        out = {"loss": 0.1, "grad_norm": 1.0}
        if self.steps >= self.at:
            out[self.metric] = math.nan if self.metric == "loss" else math.inf
        return out


@pytest.mark.parametrize("metric", ["loss", "grad_norm"])
def test_a_non_finite_step_stops_the_run_before_its_refit(metric: str) -> None:
    refits: list[int] = []
    tok = CharTokenizer()

    def refit(step: int) -> RefitReport:
        refits.append(step)
        return RefitReport(step, "disk", 1, 1, 0.01)

    with pytest.raises(TrainingHealthError) as info:
        run_grpo(
            cfg=GRPOConfig(steps=5, prompts_per_step=2, samples_per_prompt=2),
            tokenizer=tok,
            policy=GuardedPolicy(Exploding(3, metric), "pol"),
            generation=GuardedGeneration(Model(0.5), "gen", eos_ids={3}),
            env=GuardedEnv(Sevens(), "sevens"),
            refit=refit,
            probe=probe_batch(tok, 2),
            on_step=lambda m: None,
            max_mult_prob_error=1.05,
        )
    err = info.value
    assert (err.backend, err.step, err.metric) == ("pol", 3, metric)
    assert "policy backend 'pol' (role policy)" in str(err) and "at step 3" in str(err)
    assert refits == [1, 2]  # step 3's weights never reached the engine


def test_reward_trend_flags_a_falling_reward_only() -> None:
    steps = [{"step": i + 1, "reward/mean": r} for i, r in enumerate([0.2, 0.18, 0.1, 0.05, 0.02, 0.01, 0.01, 0.0])]
    fell = reward_trend(steps)
    assert fell is not None and fell["health/reward_fell"] is True
    assert fell["health/reward_first"] == pytest.approx(0.19) and fell["health/reward_last"] == pytest.approx(0.005)
    assert "warning: the reward fell" in trend_line(fell)
    rose = reward_trend([{"reward/mean": r} for r in (0.1, 0.2, 0.4, 0.6)])
    assert rose is not None and rose["health/reward_fell"] is False and "warning" not in trend_line(rose)
    noisy = reward_trend([{"reward/mean": r} for r in (0.5, 0.48, 0.52, 0.47)])
    assert noisy is not None and noisy["health/reward_fell"] is False  # within 0.05
    assert reward_trend([{"reward/mean": 0.5}] * 3) is None  # too short to say


@pytest.mark.parametrize(
    ("error", "code"),
    [(ConfigError("config key 'x' is bad", key="x"), 2), (RefitError("refit step 3 failed"), 3),
     (TrainingHealthError("nan", backend="b", step=1, metric="loss"), 3)],
)
def test_exit_codes_tell_bad_input_from_a_failed_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: Exception, code: int
) -> None:
    import rlcore.app.run as run_module

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(run_module, "run_job", fail)
    assert cli.main(["run", "examples/quickstart.yaml"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and str(error) in err[0]


def test_a_non_finite_logprob_stops_the_run_naming_backend_role_and_step() -> None:
    from rlcore.errors import ProtocolError

    class NanLogprobs(Model):
        def __init__(self) -> None:
            super().__init__(0.5)
            self.calls = 0

        def logprobs(self, batch: Any) -> list[list[float]]:
            self.calls += 1
            rows = super().logprobs(batch)
            return [[math.nan] * len(r) for r in rows] if self.calls >= 2 else rows

    tok = CharTokenizer()
    with pytest.raises(ProtocolError) as info:
        run_grpo(
            cfg=GRPOConfig(steps=4, prompts_per_step=2, samples_per_prompt=2),
            tokenizer=tok,
            policy=GuardedPolicy(NanLogprobs(), "pol"),
            generation=GuardedGeneration(Model(0.5), "gen", eos_ids={3}),
            env=GuardedEnv(Sevens(), "sevens"),
            refit=lambda step: RefitReport(step, "disk", 1, 1, 0.01),
            probe=probe_batch(tok, 2),
            on_step=lambda m: None,
            max_mult_prob_error=1.05,
            refit_check="sampled",
        )
    text = str(info.value)
    assert text.startswith("at step 2: policy backend 'pol'") and "finite float logprobs" in text, text
    assert (info.value.backend, info.value.role) == ("pol", "policy")

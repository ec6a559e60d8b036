"""``generation.on_worker_loss``: detection, the decision to replace, the retry, the records.

Fast: scripted handles (test doubles, here only) in the real GRPO loop and the real
recovery; the real thing with vLLM and Megatron is in ``test_worker_loss_e2e.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_grpo import CharTokenizer, Model, Sevens

from rlcore.app.grpo import probe_batch, run_grpo, token_mult_prob_error
from rlcore.app.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.app.recovery import (
    MAX_LOSSES_PER_PHASE,
    GenerationRecovery,
    retry_on_generation_loss,
)
from rlcore.config import GRPOConfig, load_config
from rlcore.errors import ConfigError, DivergenceError, WorkerError, WorkerLost
from rlcore.handles import RefitReport
from rlcore.refit.sessions import RefitSessions, Session
from rlcore.setup.executor import ExecutionResult, _Teardown
from rlcore.setup.preflight import check_plan, check_worker_loss
from rlcore.setup.registry import load_registry

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUICKSTART = str(EXAMPLES / "quickstart.yaml")


def lost(role: str | None = "generation") -> WorkerLost:
    err = WorkerLost("gen-group: generate: gen-group rank 0 died", worker="gen-group rank 0")
    return err.tag(role) if role else err


# ---------------------------------------------------------------- the decision


def test_a_generation_loss_is_recovered_and_the_phase_runs_again() -> None:
    calls: list[str] = []
    recovered: list[tuple[str, str]] = []

    def fn() -> str:
        calls.append("call")
        if len(calls) == 1:
            raise lost()
        return "done"

    out = retry_on_generation_loss(fn, lambda err, phase: recovered.append((err.worker, phase)), "rollout")
    assert out == "done" and len(calls) == 2
    assert recovered == [("gen-group rank 0", "rollout")]


@pytest.mark.parametrize("role", [None, "policy", "env"])
def test_a_loss_that_is_not_the_generations_aborts(role: str | None) -> None:
    recovered: list[Any] = []

    def fn() -> None:
        raise lost(role)

    with pytest.raises(WorkerLost, match="died"):
        retry_on_generation_loss(fn, lambda err, phase: recovered.append(phase), "refit")
    assert recovered == []


def test_without_replace_a_generation_loss_aborts_naming_the_worker() -> None:
    def fn() -> None:
        raise lost()

    with pytest.raises(WorkerLost, match="gen-group rank 0 died"):
        retry_on_generation_loss(fn, None, "rollout")


def test_an_engine_that_keeps_dying_ends_the_run() -> None:
    recovered: list[str] = []

    def fn() -> None:
        raise lost()

    with pytest.raises(WorkerLost):
        retry_on_generation_loss(fn, lambda err, phase: recovered.append(phase), "probe")
    assert len(recovered) == MAX_LOSSES_PER_PHASE


def test_other_worker_errors_are_not_losses() -> None:
    def fn() -> None:
        raise WorkerError("gen-group: generate: gen-group rank 0 failed: ValueError: bad")

    with pytest.raises(WorkerError, match="failed"):
        retry_on_generation_loss(fn, lambda err, phase: pytest.fail("recovered"), "rollout")


def test_the_first_caller_that_knows_names_the_role() -> None:
    err = WorkerLost("x", worker="w").tag("generation").tag("policy")
    assert err.role == "generation"


@pytest.mark.parametrize("role", ["policy", "generation"])
def test_the_guarded_handles_say_whose_worker_was_lost(role: str) -> None:
    model = DyingModel(0.5, "logprobs", die_on=1)
    guarded = GuardedPolicy(model, "pol") if role == "policy" else GuardedGeneration(model, "gen")
    with pytest.raises(WorkerLost) as info:
        guarded.logprobs([([1], [2])])
    assert info.value.role == role


# ------------------------------------------------------- the loop with a dying engine


class DyingModel(Model):
    """A generation whose worker is lost on its ``die_on``-th call of ``method``."""

    def __init__(self, shift: float, method: str, die_on: int) -> None:
        super().__init__(shift)
        self.method, self.die_on, self.count = method, die_on, 0

    def _maybe_die(self, method: str) -> None:
        if method == self.method:
            self.count += 1
            if self.count == self.die_on:
                raise WorkerLost(f"gen: {method}: gen rank 0 died", worker="gen rank 0")

    def generate(self, prompt_ids: Any, params: Any) -> Any:
        self._maybe_die("generate")
        return super().generate(prompt_ids, params)

    def logprobs(self, batch: Any) -> list[list[float]]:
        self._maybe_die("logprobs")
        return super().logprobs(batch)


class FakeSetup:
    """What GenerationRecovery uses of SetupResult: restart and refit."""

    def __init__(self, replacement: Any, refit_error: BaseException | None = None) -> None:
        self.replacement, self.refit_error = replacement, refit_error
        self.events: list[tuple[str, int]] = []

    def engine_replaceable(self, rank: int | None) -> bool:
        return False  # the scripted handles are whole generations (one engine alone: e2e tests)

    def restart_generation(self, cancel: Any) -> tuple[Any, float]:
        self.events.append(("restart", 0))
        return self.replacement, 0.5

    def refit(self, step: int, cancel: Any) -> RefitReport:
        self.events.append(("refit", step))
        if self.refit_error is not None:
            raise self.refit_error
        return RefitReport(step, "disk", 1, 1, 0.01)


def run_with_loss(method: str, die_on: int, replacement_shift: float = 0.5) -> tuple[list[dict[str, Any]], list[dict[str, Any]], FakeSetup, GuardedGeneration]:
    tok = CharTokenizer()
    policy = GuardedPolicy(Model(0.5), "pol")
    generation = GuardedGeneration(DyingModel(0.5, method, die_on), "gen", eos_ids={3})
    setup = FakeSetup(Model(replacement_shift))
    probe = probe_batch(tok, 2)
    losses: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []

    def check(err: float, step: int) -> None:
        if err > 1.05:
            raise DivergenceError(f"step {step}: {err}")

    recovery = GenerationRecovery(
        setup, generation, None,  # type: ignore[arg-type]
        probe_error=lambda: token_mult_prob_error(generation.logprobs(probe), policy.logprobs(probe)),
        check=check,
        record=lambda m, step: losses.append({**m, "step": step}),
        init_time_s=2.0,
    )
    run_grpo(
        cfg=GRPOConfig(steps=3, prompts_per_step=2, samples_per_prompt=2),
        tokenizer=tok,
        policy=policy,
        generation=generation,
        env=GuardedEnv(Sevens(), "sevens"),
        refit=lambda step: RefitReport(step, "disk", 1, 1, 0.01),
        probe=probe,
        on_step=steps.append,
        on_generation_loss=recovery,
    )
    return steps, losses, setup, generation


def test_a_loss_during_rollout_is_replaced_and_the_step_loses_no_sample() -> None:
    steps, losses, setup, generation = run_with_loss("generate", die_on=2)  # step 2's rollout
    assert [m["step"] for m in steps] == [1, 2, 3]
    # Step 2 was sampled again in full by the new engine: every sample scored (reward 1).
    assert all(m["reward/mean"] == 1.0 for m in steps)
    assert generation.handle is setup.replacement
    assert setup.events == [("restart", 0), ("refit", 2)]
    (loss,) = losses
    assert loss["generation/lost_worker"] == "gen rank 0"
    assert loss["generation/lost_step"] == 2 and loss["generation/lost_during"] == "rollout"
    assert loss["generation/replace_mult_prob_error"] == pytest.approx(1.0)
    assert loss["generation/replace_vs_setup_init"] == pytest.approx(loss["generation/replace_time_s"] / 2.0)
    assert loss["generation/serving_again_at"] >= loss["generation/lost_detected_at"]


def test_a_loss_during_the_probe_is_replaced_and_the_probe_runs_again() -> None:
    steps, losses, setup, _ = run_with_loss("logprobs", die_on=1)  # step 1's probe
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [(x["generation/lost_step"], x["generation/lost_during"]) for x in losses] == [(1, "probe")]
    assert steps[0]["refit/token_mult_prob_error"] == pytest.approx(1.0)


def test_a_replacement_that_disagrees_with_the_policy_stops_the_run() -> None:
    with pytest.raises(DivergenceError, match="step 2"):
        run_with_loss("generate", die_on=2, replacement_shift=0.9)


# ------------------------------------------------------- channels, teardown, config


def test_forget_generation_drops_only_that_generations_channels() -> None:
    sessions = RefitSessions()
    pol, gen, other = object(), object(), object()
    for g, t in ((gen, "collective"), (gen, "disk"), (other, "collective")):
        sessions._sessions[(id(pol), id(g), t)] = Session(spec=f"{t}-{id(g)}", init_time_s=0.0)  # type: ignore[arg-type]
    dropped = sessions.forget_generation(gen)
    assert sorted(dropped) == sorted([f"collective-{id(gen)}", f"disk-{id(gen)}"])
    assert len(sessions) == 1 and sessions.spec_for(pol, other, "collective") is not None


def test_the_replacement_takes_the_lost_handles_turn_in_teardown() -> None:
    order: list[str] = []
    ex = ExecutionResult(records={}, results={}, start=0.0, end=0.0, start_wall=0.0)
    ex._teardown = [
        _Teardown("init:policy", {}, lambda r: order.append(r), "policy"),
        _Teardown("init:generation", {}, lambda r: order.append(r), "old generation"),
        _Teardown("init:env", {}, lambda r: order.append(r), "env"),
    ]
    assert ex.replace_started("init:generation", "new generation") == "old generation"
    assert ex.results["init:generation"] == "new generation"
    ex.shutdown(5.0)
    assert order == ["env", "new generation", "policy"]
    with pytest.raises(KeyError):
        ex.replace_started("init:generation", "again")  # shut down: nothing held


def test_on_worker_loss_accepts_abort_and_replace_only() -> None:
    assert load_config(QUICKSTART, []).generation.on_worker_loss == "abort"
    assert load_config(QUICKSTART, ["generation.on_worker_loss=replace"]).generation.on_worker_loss == "replace"
    with pytest.raises(ConfigError, match="generation.on_worker_loss") as info:
        load_config(QUICKSTART, ["generation.on_worker_loss=restart"])
    assert info.value.key == "generation.on_worker_loss" and "\n" not in str(info.value)


def test_replace_is_refused_when_the_env_holds_the_generation_endpoint() -> None:
    pytest.importorskip("rlcore_nemo_gym")
    pytest.importorskip("rlcore_vllm")
    gym = str(EXAMPLES / "nemo_gym.yaml")
    config = load_config(gym, ["generation.on_worker_loss=replace"])
    plan = check_plan(config, load_registry(config.plugins.allow))
    with pytest.raises(ConfigError, match="endpoint") as info:
        check_worker_loss(config, plan)
    assert info.value.key == "generation.on_worker_loss"
    check_worker_loss(load_config(gym, []), plan)  # abort: fine


def test_a_colocated_handoff_turns_to_the_replacement() -> None:
    from rlcore.app.grpo import Handoff

    old, new = Model(0.5), Model(0.5)
    generation = GuardedGeneration(old, "gen")
    handoff = Handoff(policy=None, generation=old)  # type: ignore[arg-type]
    recovery = GenerationRecovery(
        FakeSetup(new), generation, None,  # type: ignore[arg-type]
        probe_error=lambda: 1.0, check=lambda err, step: None, record=lambda m, step: None,
        handoff=handoff,
    )
    recovery(lost(), 4, "rollout")
    assert generation.handle is new and handoff.generation is new
    # A run without the handoff (no backend declares memory_handoff) keeps none.
    bare = Handoff()
    GenerationRecovery(
        FakeSetup(Model(0.5)), GuardedGeneration(old, "gen"), None,  # type: ignore[arg-type]
        probe_error=lambda: 1.0, check=lambda err, step: None, record=lambda m, step: None,
        handoff=bare,
    )(lost(), 4, "rollout")
    assert bare.generation is None

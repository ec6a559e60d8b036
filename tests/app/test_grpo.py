from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest

from rlcore.app.grpo import (
    PHASES,
    Handoff,
    group_advantages,
    probe_batch,
    run_grpo,
    token_mult_prob_error,
)
from rlcore.app.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.app.recovery import GenerationRecovery
from rlcore.config import GRPOConfig, RefitConfig, load_config
from rlcore.errors import DivergenceError, ProtocolError, WorkerLost
from rlcore.handles import PromptAndScoreEnv, RefitReport

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")


def test_group_advantages_normalise_within_each_group() -> None:
    adv = group_advantages([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5]])
    assert adv[0] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-4)
    assert adv[1] == [0.0, 0.0]  # no signal in a group of equal rewards
    assert sum(adv[0]) == pytest.approx(0.0, abs=1e-9)


def test_failed_samples_are_left_out_of_their_groups_advantage() -> None:
    # The failed sample's reward (99) would dominate the group; it is neither counted nor moved.
    adv = group_advantages([[1.0, 0.0, 99.0], [0.5, 2.0]], failed=[[False, False, True], [True, True]])
    assert adv[0][:2] == pytest.approx([1.0, -1.0], abs=1e-4) and adv[0][2] == 0.0
    assert adv[1] == [0.0, 0.0]


def test_token_mult_prob_error() -> None:
    assert token_mult_prob_error([[-1.0, -2.0]], [[-1.0, -2.0]]) == 1.0
    assert token_mult_prob_error([[-1.0, -2.0]], [[-1.1, -1.9]]) == pytest.approx(math.exp(0.1))
    with pytest.raises(ValueError):
        token_mult_prob_error([[]], [[]])


# ---------------------------------------------------------------- the loop, scripted handles

class CharTokenizer:
    """Token id = ord(char); EOS 3, BOS 1."""

    eos_token_id = 3

    class _Enc:
        def __init__(self, ids: list[int]) -> None:
            self.input_ids = ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        return self._Enc(([1] if add_special_tokens else []) + [ord(c) for c in text])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i > 3)


class Model:
    """Logprob of every token is ``-shift``; generation answers '7' then EOS."""

    def __init__(self, shift: float) -> None:
        self.shift = shift
        self.calls: list[str] = []

    def logprobs(self, batch: Any) -> list[list[float]]:
        return [[-self.shift] * len(c) for _, c in batch]

    def generate(self, prompt_ids: Any, params: Any) -> Any:
        self.calls.append("generate")
        return [[{"token_ids": [ord("7"), 3], "logprobs": [-self.shift] * 2}] * params.n for _ in prompt_ids]

    def train_step(self, batch: Any, adv: Any, old: Any = None, **kw: Any) -> dict[str, float]:
        return {"loss": 0.0, "grad_norm": 0.0}

    def shutdown(self) -> None:
        pass


class Sevens(PromptAndScoreEnv):
    def sample_prompts(self, n: int, step: int) -> list[Any]:
        class P:
            text = "3+4="

        return [P()] * n

    def score(self, prompts: Any, completions: Any) -> list[list[float]]:
        return [[1.0 if c == "7" else 0.0 for c in g] for g in completions]


def loop(policy_shift: float, gen_shift: float, limit: float | None, **gen_over: Any) -> tuple[list[dict[str, Any]], Model]:
    written: list[dict[str, Any]] = []
    gen_model = Model(gen_shift)
    for k, v in gen_over.items():
        setattr(gen_model, k, v)
    tok = CharTokenizer()
    history = run_grpo(
        cfg=GRPOConfig(steps=3, prompts_per_step=2, samples_per_prompt=2),
        tokenizer=tok,
        policy=GuardedPolicy(Model(policy_shift), "pol"),
        generation=GuardedGeneration(gen_model, "gen", eos_ids={3}),
        env=GuardedEnv(Sevens(), "sevens"),
        refit=lambda step: RefitReport(step, "disk", 1, 1, 0.01),
        probe=probe_batch(tok, 2),
        on_step=written.append,
        max_mult_prob_error=limit,
    )
    assert history == written
    return written, gen_model


def test_prompt_and_score_env_samples_through_the_generation_and_scores() -> None:
    written, gen = loop(0.5, 0.5, 1.05)
    assert len(written) == 3 and gen.calls == ["generate"] * 3
    assert all(m["reward/mean"] == 1.0 and m["refit/token_mult_prob_error"] == 1.0 for m in written)


def test_divergence_stops_the_run_after_writing_the_step() -> None:
    with pytest.raises(DivergenceError, match=r"step 1.*'gen'.*'pol'.*1\.2214 > refit.max_mult_prob_error 1.05") as info:
        loop(0.5, 0.7, 1.05)
    assert "metrics were written" in str(info.value)
    # Disabled: the same divergence runs every step, visible only in the metrics.
    written, _ = loop(0.5, 0.7, None)
    assert len(written) == 3 and written[-1]["refit/token_mult_prob_error"] == pytest.approx(math.exp(0.2))


def test_a_generation_breaking_the_format_is_named() -> None:
    def short(self: Any, batch: Any) -> list[list[float]]:
        return [[-0.5] * (len(c) - 1) for _, c in batch]

    with pytest.raises(ProtocolError, match="generation backend 'gen' broke the contract of logprobs"):
        loop(0.5, 0.5, 1.05, logprobs=short.__get__(object()))


def test_probe_batch_is_fixed_and_ends_in_eos() -> None:
    tok = CharTokenizer()
    a, b = probe_batch(tok, 5), probe_batch(tok, 5)
    assert a == b and len(a) == 5
    assert all(p[0] == 1 and c[-1] == tok.eos_token_id and len(c) >= 2 for p, c in a)


class Sleeper:
    """Records sleep/wake calls of one role into a shared journal."""

    def __init__(self, name: str, journal: list[str]) -> None:
        self.name, self.journal = name, journal

    def sleep(self) -> None:
        self.journal.append(f"{self.name}.sleep")

    def wake(self) -> None:
        self.journal.append(f"{self.name}.wake")


def test_colocated_roles_take_turns_on_the_devices() -> None:
    journal: list[str] = []

    class Recording(Model):
        def generate(self, *a: Any, **kw: Any) -> Any:
            journal.append("generate")
            return super().generate(*a, **kw)

        def train_step(self, *a: Any, **kw: Any) -> dict[str, float]:
            journal.append("train")
            return super().train_step(*a, **kw)

    tok = CharTokenizer()
    run_grpo(
        cfg=GRPOConfig(steps=2, prompts_per_step=1, samples_per_prompt=2),
        tokenizer=tok,
        policy=GuardedPolicy(Recording(0.5), "pol"),
        generation=GuardedGeneration(Recording(0.5), "gen", eos_ids={3}),
        env=GuardedEnv(Sevens(), "sevens"),
        refit=lambda step: journal.append("refit") or RefitReport(step, "cuda_ipc", 1, 1, 0.01),
        probe=probe_batch(tok, 1),
        on_step=lambda m: journal.append("metrics"),
        handoff=Handoff(Sleeper("policy", journal), Sleeper("generation", journal)),
        refit_check="probe",
    )
    step = [
        "policy.sleep", "generation.wake", "generate",  # the generation samples
        "generation.sleep", "policy.wake", "train",  # the policy trains
        "refit", "policy.sleep", "generation.wake", "metrics",  # the probe, generation awake
    ]
    assert journal == step * 2


# ---------------------------------------------------------------- the refit check (refit.check)


class Clock:
    """A fake ``time.monotonic`` for the loop: scripted calls move it by fixed amounts, so
    phase times are exact sums of what ran in each phase (no wall clock)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()  # the probe's two calls run on two threads

    def monotonic(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def probes_in_order(journal: list[str]) -> list[str]:
    """The journal with each probe's two calls (made at once, on two threads) in one order."""
    out = list(journal)
    for i in range(len(out) - 1):
        if out[i : i + 2] == ["policy.probe", "generation.probe"]:
            out[i : i + 2] = ["generation.probe", "policy.probe"]
    return out


#: What each scripted call costs on the fake clock (powers of two: every sum is unique).
COST = {
    "to_generation": 1.0, "to_policy": 2.0, "generate": 16.0, "policy.logprobs": 32.0,
    "train_step": 64.0, "refit": 128.0, "generation.probe": 256.0, "policy.probe": 512.0,
}


class Scripted(Model):
    """A role that journals its calls (``gen.generate``, ``pol.probe``...) and moves the clock.

    ``logprobs`` of the probe batch is told apart from the logprobs of a step's samples."""

    def __init__(self, role: str, shift: float, journal: list[str], clock: Clock, probe: Any) -> None:
        super().__init__(shift)
        self.role, self.journal, self.clock, self.probe = role, journal, clock, probe
        self.probe_calls = 0

    def logprobs(self, batch: Any) -> list[list[float]]:
        is_probe = [(list(p), list(c)) for p, c in batch] == [(list(p), list(c)) for p, c in self.probe]
        self.probe_calls += is_probe
        what = "probe" if is_probe else "logprobs"
        self.journal.append(f"{self.role}.{what}")
        self.clock.tick(COST[f"{self.role if is_probe else 'policy'}.{what}"])
        return super().logprobs(batch)

    def generate(self, *a: Any, **kw: Any) -> Any:
        self.journal.append(f"{self.role}.generate")
        self.clock.tick(COST["generate"])
        return super().generate(*a, **kw)

    def train_step(self, *a: Any, **kw: Any) -> dict[str, float]:
        self.journal.append(f"{self.role}.train")
        self.clock.tick(COST["train_step"])
        return super().train_step(*a, **kw)


class TimedHandoff(Handoff):
    """A colocated handoff that journals each turn and moves the clock."""

    def __init__(self, journal: list[str], clock: Clock) -> None:
        super().__init__()
        self.journal, self.clock = journal, clock

    def to_generation(self) -> None:
        self.journal.append("to_generation")
        self.clock.tick(COST["to_generation"])

    def to_policy(self) -> None:
        self.journal.append("to_policy")
        self.clock.tick(COST["to_policy"])


class Run:
    """One scripted run of the loop on the fake clock; every call, record and span kept."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        check: str,
        *,
        steps: int = 3,
        gen_shift: float = 0.5,
        break_refit: dict[int, float] | None = None,
        limit: float | None = 1.05,
        generation_model: Any = None,
        recovery: Any = None,
    ) -> None:
        self.clock = Clock()
        monkeypatch.setattr("rlcore.app.grpo.time", self.clock)
        self.journal: list[str] = []
        self.steps: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self.spans: list[tuple[str, int]] = []
        tok = CharTokenizer()
        self.probe = probe_batch(tok, 2)
        self.pol = Scripted("policy", 0.5, self.journal, self.clock, self.probe)
        self.gen = generation_model or Scripted("generation", gen_shift, self.journal, self.clock, self.probe)
        self.generation = GuardedGeneration(self.gen, "gen", eos_ids={3})
        self.policy = GuardedPolicy(self.pol, "pol")
        self.check, self.tok, self.limit, self.recovery = check, tok, limit, recovery
        self.n_steps, self.break_refit = steps, break_refit or {}

    def refit(self, step: int) -> RefitReport:
        self.journal.append("refit")
        self.clock.tick(COST["refit"])
        if step in self.break_refit:  # this refit leaves the engine with other weights
            self.generation.handle.shift = self.break_refit[step]
        return RefitReport(step, "disk", 1, 1, 0.01)

    def __call__(self) -> Run:
        def on_step(m: dict[str, Any]) -> None:
            self.journal.append(f"metrics {m['step']}")
            self.steps.append(m)

        def on_check(m: dict[str, Any]) -> None:
            self.journal.append(f"check of refit {m['refit/checked_step']}")
            self.checks.append(m)

        run_grpo(
            cfg=GRPOConfig(steps=self.n_steps, prompts_per_step=2, samples_per_prompt=2),
            tokenizer=self.tok,
            policy=self.policy,
            generation=self.generation,
            env=GuardedEnv(Sevens(), "sevens"),
            refit=self.refit,
            probe=self.probe,
            on_step=on_step,
            max_mult_prob_error=self.limit,
            handoff=TimedHandoff(self.journal, self.clock),
            trace=lambda name, t0, t1, step: self.spans.append((name, step)),
            refit_check=self.check,
            on_check=on_check,
            on_generation_loss=self.recovery,
        )
        return self


def test_refit_check_defaults_to_sampled_and_probe_is_a_choice() -> None:
    assert RefitConfig().check == "sampled"
    assert load_config(QUICKSTART, []).refit.check == "sampled"
    assert load_config(QUICKSTART, ["refit.check=probe"]).refit.check == "probe"
    with pytest.raises(ValueError, match="refit_check is 'prob'"):
        Run(pytest.MonkeyPatch(), "prob")()


def test_sampled_checks_each_refit_with_the_next_steps_samples_and_probes_only_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = Run(monkeypatch, "sampled")()
    step = ["to_generation", "generation.generate", "to_policy", "policy.logprobs", "policy.train", "refit"]
    last = ["to_generation", "generation.probe", "policy.probe", "check of refit 3"]
    assert probes_in_order(run.journal) == [*step, "metrics 1", *step, "metrics 2", *step, "metrics 3", *last]
    assert run.gen.probe_calls == run.pol.probe_calls == 1  # once per run, not per step
    # Each step line carries the check of the refit before it (step 1: refit:initial)...
    assert [(m["refit/checked_step"], m["refit/check"]) for m in run.steps] == [(0, "sampled"), (1, "sampled"), (2, "sampled")]
    for m in run.steps:
        assert m["refit/token_mult_prob_error"] == m["train/gen_vs_policy_mult_prob_error"] == 1.0
        assert m["refit/weight_sync_time_s"] == 0.01  # and its own refit's figures
    # ...and the last refit's check is its own record.
    (final,) = run.checks
    assert final["step"] == 3 and final["refit/checked_step"] == 3 and final["refit/check"] == "probe"
    assert final["refit/token_mult_prob_error"] == 1.0
    assert final["timing/handoff_time_s"] == COST["to_generation"]
    assert final["timing/refit_check_time_s"] == COST["generation.probe"] + COST["policy.probe"]
    assert "timing/step_time_s" not in final and "reward/mean" not in final


@pytest.mark.parametrize("broken", [1, 2])
def test_sampled_a_refit_that_leaves_other_weights_stops_the_next_step_naming_it(
    monkeypatch: pytest.MonkeyPatch, broken: int
) -> None:
    run = Run(monkeypatch, "sampled", break_refit={broken: 0.7})
    with pytest.raises(
        DivergenceError,
        match=rf"after the refit of step {broken}, .*'gen'.*'pol'.*tokens step {broken + 1} sampled.*"
        r"1\.2214 > refit.max_mult_prob_error 1.05",
    ) as info:
        run()
    assert "metrics were written" in str(info.value)
    assert [m["step"] for m in run.steps] == list(range(1, broken + 1))
    # Step broken+1 stopped before its train step; its check was recorded first.
    assert run.journal.count("policy.train") == broken
    (check,) = run.checks
    assert (check["step"], check["refit/checked_step"], check["refit/check"]) == (broken + 1, broken, "sampled")
    assert check["refit/token_mult_prob_error"] == pytest.approx(math.exp(0.2))
    assert run.gen.probe_calls == run.pol.probe_calls == 0


def test_sampled_checks_the_initial_refit_with_step_1_and_the_last_with_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # refit:initial (before the loop) left other weights: step 1's samples show it.
    with pytest.raises(DivergenceError, match=r"refit of step 0, .*tokens step 1 sampled"):
        Run(monkeypatch, "sampled", gen_shift=0.7)()
    # The last step's refit: the probe after the loop, after every step line.
    run = Run(monkeypatch, "sampled", break_refit={3: 0.7})
    with pytest.raises(DivergenceError, match=r"refit of step 3, .*on the probe batch: .*1\.2214"):
        run()
    assert [m["step"] for m in run.steps] == [1, 2, 3]
    assert [c["refit/checked_step"] for c in run.checks] == [3]
    # Disabled: no stop, every check still in the records.
    run = Run(monkeypatch, "sampled", break_refit={1: 0.7}, limit=None)()
    errors = [m["refit/token_mult_prob_error"] for m in run.steps] + [run.checks[0]["refit/token_mult_prob_error"]]
    assert errors == pytest.approx([1.0, math.exp(0.2), math.exp(0.2), math.exp(0.2)])


def test_probe_checks_every_refit_with_the_probe_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run(monkeypatch, "probe")()
    step = [
        "to_generation", "generation.generate", "to_policy", "policy.logprobs", "policy.train", "refit",
        "to_generation", "generation.probe", "policy.probe",
    ]
    assert probes_in_order(run.journal) == [*step, "metrics 1", *step, "metrics 2", *step, "metrics 3"]
    assert run.gen.probe_calls == run.pol.probe_calls == 3 and run.checks == []
    assert [(m["refit/checked_step"], m["refit/check"]) for m in run.steps] == [(1, "probe"), (2, "probe"), (3, "probe")]
    run = Run(monkeypatch, "probe", break_refit={2: 0.7})
    with pytest.raises(DivergenceError, match=r"refit of step 2, .*on the probe batch"):
        run()
    assert [m["step"] for m in run.steps] == [1, 2]  # step 2's line written first


@pytest.mark.parametrize("check", ["sampled", "probe"])
def test_every_step_times_its_phases_and_the_handoff_sums_every_turn(
    monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    run = Run(monkeypatch, check)()
    keys = {f"timing/{p}_time_s" for p in PHASES}
    assert keys == {
        "timing/generate_time_s", "timing/reward_time_s", "timing/train_time_s",
        "timing/refit_time_s", "timing/handoff_time_s", "timing/refit_check_time_s",
        "timing/checkpoint_time_s",
    }
    probe = check == "probe"
    for m in run.steps:
        assert keys | {"timing/step_time_s", "timing/refit_check_share"} <= m.keys()
        t = {k.removeprefix("timing/").removesuffix("_time_s"): m[k] for k in keys}
        assert t["generate"] == COST["generate"]
        assert t["reward"] == 0.0
        assert t["train"] == COST["policy.logprobs"] + COST["train_step"]  # no handoff in it
        assert t["refit"] == COST["refit"]
        # Both turns of the step (before sampling, before training), and the probe's own.
        assert t["handoff"] == COST["to_generation"] + COST["to_policy"] + probe * COST["to_generation"]
        # Sampled: the comparison only, no engine call (every call moves the clock).
        assert t["refit_check"] == probe * (COST["generation.probe"] + COST["policy.probe"])
        assert m["timing/step_time_s"] == sum(t.values())
        assert m["timing/refit_check_share"] == t["refit_check"] / m["timing/step_time_s"]
    # The trace gets each phase under the same names, the handoff once per turn (no
    # checkpoint span: this run saves none).
    per_step = {s: sorted(n for n, k in run.spans if k == s) for s in (1, 2)}
    phases = [p for p in PHASES if p != "checkpoint"]
    expected = sorted([*phases, "handoff", *(["handoff"] if probe else ["train"])])
    assert per_step[1] == per_step[2] == expected


def test_sampled_checks_a_replaced_generation_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """generation.on_worker_loss=replace: the replacement (probe-checked by the recovery)
    is then checked by the loop's sampled check like any engine."""

    class Dying(Scripted):
        def __init__(self, *a: Any, die: str) -> None:
            super().__init__(*a)
            self.die = die

        def generate(self, *a: Any, **kw: Any) -> Any:
            if self.die == "generate":
                raise WorkerLost("gen: generate: gen rank 0 died", worker="gen rank 0")
            return super().generate(*a, **kw)

        def logprobs(self, batch: Any) -> list[list[float]]:
            if self.die == "probe":
                raise WorkerLost("gen: logprobs: gen rank 0 died", worker="gen rank 0")
            return super().logprobs(batch)

    def run_with(die: str, break_refit: dict[int, float] | None = None) -> tuple[Run, list[dict[str, Any]], Any]:
        run = Run(monkeypatch, "sampled", break_refit=break_refit)
        dying = Dying("generation", 0.5, run.journal, run.clock, run.probe, die=die)
        replacement = Scripted("generation", 0.5, run.journal, run.clock, run.probe)
        run.generation.handle = dying
        losses: list[dict[str, Any]] = []

        class Setup:
            def engine_replaceable(self, rank: int | None) -> bool:
                return False  # a whole generation here (one engine alone: tests/e2e/test_worker_loss_e2e.py)

            def restart_generation(self, cancel: Any) -> tuple[Any, float]:
                dying.die = ""  # the old engine never answers again
                return replacement, 0.1

            def refit(self, step: int, cancel: Any) -> RefitReport:
                return run.refit(step)

        run.recovery = GenerationRecovery(
            Setup(), run.generation, None,  # type: ignore[arg-type]
            probe_error=lambda: token_mult_prob_error(run.generation.logprobs(run.probe), run.policy.logprobs(run.probe)),
            check=lambda err, step: None,
            record=lambda m, step: losses.append(m),
        )
        return run, losses, replacement

    # Lost while sampling step 1: replaced, probe-checked, step 1 sampled again by the new engine.
    run, losses, replacement = run_with("generate")
    run()
    assert [(x["generation/lost_step"], x["generation/lost_during"]) for x in losses] == [(1, "rollout")]
    assert run.generation.handle is replacement
    assert [m["refit/token_mult_prob_error"] for m in run.steps] == [1.0, 1.0, 1.0]
    # A refit into the replacement that leaves other weights: the next step's samples show it.
    run, losses, _ = run_with("generate", break_refit={2: 0.7})
    with pytest.raises(DivergenceError, match=r"refit of step 2, .*tokens step 3 sampled"):
        run()
    assert len(losses) == 1
    # Lost during the run's only probe (after the last step): replaced, the probe run again.
    run, losses, _ = run_with("probe")
    run()
    assert [(x["generation/lost_step"], x["generation/lost_during"]) for x in losses] == [(3, "probe")]
    assert [c["refit/token_mult_prob_error"] for c in run.checks] == [1.0]


class SevensFailing(Sevens):
    """Marks the second sample of each group failed (an env whose reward function broke)."""

    def collect_rollouts(self, request: Any) -> list[list[Any]]:
        groups = super().collect_rollouts(request)
        for g in groups:
            g[1] = {**g[1], "reward": 0.0, "failed": "reward function 'f' on row 0 raised"}
        return groups


def test_failed_samples_are_counted_and_left_out_of_the_reward_figures() -> None:
    tok = CharTokenizer()
    written: list[dict[str, Any]] = []
    run_grpo(
        cfg=GRPOConfig(steps=2, prompts_per_step=2, samples_per_prompt=2),
        tokenizer=tok,
        policy=GuardedPolicy(Model(0.5), "pol"),
        generation=GuardedGeneration(Model(0.5), "gen", eos_ids={3}),
        env=GuardedEnv(SevensFailing(), "sevens"),
        refit=lambda step: RefitReport(step, "disk", 1, 1, 0.01),
        probe=probe_batch(tok, 2),
        on_step=written.append,
    )
    # Every scored sample is right: the failed ones (reward 0.0) would have halved the mean.
    assert [(m["reward/mean"], m["reward/failed"]) for m in written] == [(1.0, 2), (1.0, 2)]


def test_samples_weight_versions_give_each_steps_staleness() -> None:
    """A step's line carries the lag of its samples behind the policy (version step - 1,
    minus a sample's oldest token's) and the versions seen; a generation that reports no
    versions gets no such metrics."""
    calls: list[int] = []

    def generate(prompt_ids: Any, params: Any) -> Any:
        v = len(calls)  # the synchronous loop: refit of step v before the rollouts of step v + 1
        calls.append(v)
        fresh = {"token_ids": [ord("7"), 3], "logprobs": [-0.5] * 2, "versions": [v, v]}
        # At step 2 one sample started on the weights before the last refit.
        older = {**fresh, "versions": [v - 1, v]} if v == 1 else fresh
        return [[older, fresh]] + [[fresh, fresh] for _ in prompt_ids[1:]]

    written, _ = loop(0.5, 0.5, 1.05, generate=generate)
    lines = [(m["staleness/lag_mean"], m["staleness/lag_max"], m["generate/weight_versions"]) for m in written]
    assert lines == [(0.0, 0, [0]), (0.25, 1, [0, 1]), (0.0, 0, [2])]
    plain, _ = loop(0.5, 0.5, 1.05)
    assert not [k for m in plain for k in m if k.startswith("staleness/") or k == "generate/weight_versions"]


class SevensOnOddSteps(Sevens):
    """Tells the samples apart (rewards 1 and 0 in every group) on odd steps only."""

    def collect_rollouts(self, request: Any) -> list[list[Any]]:
        groups = super().collect_rollouts(request)
        if request.step % 2 == 1:
            for g in groups:
                g[1] = {**g[1], "reward": 0.0}
        return groups


def _steps_of(env: PromptAndScoreEnv, steps: int) -> list[dict[str, Any]]:
    tok = CharTokenizer()
    written: list[dict[str, Any]] = []
    run_grpo(
        cfg=GRPOConfig(steps=steps, prompts_per_step=2, samples_per_prompt=2),
        tokenizer=tok,
        policy=GuardedPolicy(Model(0.5), "pol"),
        generation=GuardedGeneration(Model(0.5), "gen", eos_ids={3}),
        env=GuardedEnv(env, "sevens"),
        refit=lambda step: RefitReport(step, "disk", 1, 1, 0.01),
        probe=probe_batch(tok, 2),
        on_step=written.append,
    )
    return written


def _no_gradient_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "had no gradient" in r.getMessage()]


def test_a_run_whose_steps_mostly_have_no_gradient_warns_once_naming_the_env(caplog) -> None:
    """Every group of equal rewards (Sevens scores every sample 1.0): every advantage is zero.
    After the 4th step (more than half of the steps so far without a gradient) the run warns,
    once, naming the env backend; a run of 3 such steps, or one where half the steps teach,
    does not."""
    with caplog.at_level("WARNING"):
        written = _steps_of(Sevens(), 6)
    assert all(m["reward/zero_variance_groups"] == m["reward/groups"] == 2 for m in written)
    warned = _no_gradient_warnings(caplog)
    assert len(warned) == 1, warned
    assert warned[0].startswith("4 of the first 4 steps had no gradient") and "backend 'sevens'" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        _steps_of(Sevens(), 3)
        written = _steps_of(SevensOnOddSteps(), 6)
    assert [m["reward/zero_variance_groups"] for m in written] == [0, 2, 0, 2, 0, 2]
    assert _no_gradient_warnings(caplog) == []

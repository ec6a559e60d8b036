"""The GRPO loop with ``grpo.max_staleness`` k >= 1: rollouts generated ahead of the train step.

Scripted handles on real threads; ordering is shown with events (a test that would hang
without the overlap fails on a bounded wait instead), never with timings.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_grpo import CharTokenizer, Model

from rlcore.app.grpo import _fresh, probe_batch, run_grpo
from rlcore.app.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.app.stream import RolloutStream, StepRollouts
from rlcore.config import GRPOConfig
from rlcore.errors import Cancelled, RefitError, RlcoreError, WorkerLost
from rlcore.handles import PromptAndScoreEnv, RefitReport

WAIT_S = 30.0  # bound on every wait of these tests: a broken overlap fails, never hangs


class Journal:
    """Calls of every role in the order they happened, from any thread."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def add(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)

    def index(self, line: str) -> int:
        return self.lines.index(line)


class StepEnv(PromptAndScoreEnv):
    """'3+4=' prompts; journals which step's rollouts are being generated, and lets a test
    hold a step's generation until an event (``hold[step]``)."""

    def __init__(self, journal: Journal, hold: dict[int, threading.Event] | None = None) -> None:
        self.journal, self.hold = journal, hold or {}
        self.threads: dict[int, str] = {}

    def sample_prompts(self, n: int, step: int) -> list[Any]:
        class P:
            text = "3+4="

        self.journal.add(f"generate {step}")
        self.threads[step] = threading.current_thread().name
        if step in self.hold:
            assert self.hold[step].wait(WAIT_S), f"step {step}'s generation was held for ever"
        return [P()] * n

    def score(self, prompts: Any, completions: Any) -> list[list[float]]:
        return [[1.0 if c == "7" else 0.0 for c in g] for g in completions]


class Policy(Model):
    def __init__(self, journal: Journal, started: dict[int, threading.Event] | None = None) -> None:
        super().__init__(0.5)
        self.journal, self.started = journal, started or {}
        self.old_logprobs: list[Any] = []
        self.trained = 0

    def logprobs(self, batch: Any) -> list[list[float]]:
        self.journal.add("policy.logprobs")
        return super().logprobs(batch)

    def train_step(self, batch: Any, adv: Any, old: Any = None, **kw: Any) -> dict[str, float]:
        self.trained += 1
        self.journal.add(f"train {self.trained}")
        self.old_logprobs.append(old)
        if self.trained in self.started:
            self.started[self.trained].set()
        return super().train_step(batch, adv, old, **kw)


def run_ahead(k: int, steps: int = 4, **over: Any) -> tuple[list[dict[str, Any]], Journal, Any]:
    journal = over.pop("journal", None) or Journal()
    env = over.pop("env", None) or StepEnv(journal)
    policy = over.pop("policy", None) or Policy(journal)
    tok = CharTokenizer()

    def refit(step: int) -> RefitReport:
        journal.add(f"refit {step}")
        return RefitReport(step, "disk", 1, 1, 0.01)

    history = run_grpo(
        cfg=GRPOConfig(steps=steps, prompts_per_step=2, samples_per_prompt=2, max_staleness=k),
        tokenizer=tok,
        policy=GuardedPolicy(policy, "pol"),
        generation=over.pop("generation", None) or GuardedGeneration(Model(0.5), "gen", eos_ids={3}),
        env=GuardedEnv(env, "steps"),
        refit=refit,
        probe=probe_batch(tok, 2),
        on_step=lambda m: journal.add(f"metrics {m['step']}"),
        max_mult_prob_error=over.pop("max_mult_prob_error", 1.05),
        **over,
    )
    return history, journal, policy


@pytest.mark.parametrize("k", [1, 2])
def test_no_step_generates_before_the_refit_its_bound_needs(k: int) -> None:
    history, journal, _ = run_ahead(k, steps=5)
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5]
    for s in range(1, 6):
        needs = s - 1 - k  # the refit whose release step s waits for (0: the initial weights)
        if needs >= 1:
            assert journal.index(f"metrics {needs}") < journal.index(f"generate {s}"), journal.lines
    # Every sample was at most k versions behind the policy that trained on it, and the
    # first steps ran as far ahead as allowed.
    assert all(m["staleness/lag_max"] <= k for m in history)
    assert max(m["staleness/lag_max"] for m in history) == k
    assert all(m["staleness/max_staleness"] == k and m["staleness/dropped_groups"] == 0 for m in history)
    assert all(m["refit/check"] == "probe" and m["refit/checked_step"] == m["step"] for m in history)


def test_generation_of_the_next_step_runs_while_the_policy_trains() -> None:
    """Step 2's generation is held until step 1's train step has begun: the synchronous
    loop would wait for ever (here: fail on the bounded wait); the loop that runs ahead
    trains step 1 while step 2 generates, on the producer's thread."""
    journal = Journal()
    train_1 = threading.Event()
    env = StepEnv(journal, hold={2: train_1})
    history, _, _ = run_ahead(1, steps=3, journal=journal, env=env, policy=Policy(journal, {1: train_1}))
    assert len(history) == 3
    assert journal.index("train 1") < journal.index("metrics 1")
    assert journal.index("generate 2") < journal.index("train 1")  # began before step 1 trained
    assert all(name.startswith("rlcore-rollouts") for name in env.threads.values())
    assert history[1]["generate/weight_versions"] == [0]  # step 2 sampled with the initial weights


def test_the_ratio_is_taken_against_the_sampling_logprobs() -> None:
    """No policy forward of the samples before the train step: ``old_logprobs`` are the
    generation's (the behaviour policy), the policy's logprobs go to the probe alone."""
    gen = Model(0.25)
    _, journal, policy = run_ahead(1, steps=2, generation=GuardedGeneration(gen, "gen", eos_ids={3}), max_mult_prob_error=None)
    assert policy.old_logprobs and all(row == [-0.25, -0.25] for old in policy.old_logprobs for row in old)
    probes = [line for line in journal.lines if line == "policy.logprobs"]
    assert len(probes) == 2  # one probe check per refit, nothing else


def test_a_generation_lost_by_the_producer_is_replaced_on_the_trainers_thread() -> None:
    journal = Journal()
    model = Model(0.5)
    deaths = {"left": 1}

    def generate(prompt_ids: Any, params: Any) -> Any:
        if deaths["left"] and any(line == "generate 2" for line in journal.lines):
            deaths["left"] -= 1
            raise WorkerLost("gen: generate: gen rank 0 died", worker="gen rank 0")
        return Model.generate(model, prompt_ids, params)

    model.generate = generate  # type: ignore[method-assign]
    recovered: list[tuple[int, str, str]] = []

    def on_loss(err: WorkerLost, step: int, phase: str) -> None:
        recovered.append((step, phase, threading.current_thread().name))

    history, _, _ = run_ahead(
        1, steps=3, journal=journal, generation=GuardedGeneration(model, "gen", eos_ids={3}), on_generation_loss=on_loss
    )
    assert [m["step"] for m in history] == [1, 2, 3]
    assert recovered == [(2, "rollout", threading.current_thread().name)]
    assert journal.lines.count("generate 2") == 2  # generated again after the replacement


def test_a_producer_failure_ends_the_run_naming_the_step_and_leaves_no_thread() -> None:
    journal = Journal()

    class Broken(StepEnv):
        def sample_prompts(self, n: int, step: int) -> list[Any]:
            if step == 2:
                raise RuntimeError("the env's dataset ran out")
            return super().sample_prompts(n, step)

    with pytest.raises(RuntimeError, match="dataset ran out"):
        run_ahead(1, steps=4, journal=journal, env=Broken(journal))
    assert "metrics 1" in journal.lines and "train 2" not in journal.lines
    assert not [t for t in threading.enumerate() if t.name.startswith("rlcore-rollouts")]


# ---------------------------------------------------------------- the stream alone


def stream_over(produce: Any, *, epoch: Any = lambda: 0, cancelled: Any = lambda: False, **kw: Any) -> RolloutStream:
    return RolloutStream(
        produce, version=lambda: 0, epoch=epoch, cancelled=cancelled, max_staleness=kw.pop("k", 1),
        last_step=kw.pop("last_step", 3), **kw,
    )


def test_a_loss_the_run_recovered_from_meanwhile_is_not_recovered_from_twice() -> None:
    epoch = {"now": 0}
    calls: list[int] = []

    def produce(step: int) -> Any:
        calls.append(step)
        if len(calls) == 1:
            epoch["now"] = 1  # the trainer replaced the generation while this call ran
            raise WorkerLost("gen rank 0 died", worker="gen rank 0")
        return [[]]

    recovers: list[int] = []

    def retry(fn: Any, step: int) -> Any:
        try:
            return fn()
        except WorkerLost:
            recovers.append(step)
            raise

    with stream_over(produce, epoch=lambda: epoch["now"], retry=retry) as stream:
        got = stream.next(1)
    assert isinstance(got, StepRollouts) and got.step == 1
    assert calls[:2] == [1, 1] and recovers == []


def test_a_call_on_the_engine_a_recovery_shut_down_is_generated_again_and_a_current_failure_is_raised() -> None:
    """The trainer replaced the generation while the producer's call ran on the old one: the
    call fails on the old handle shut down under it (not a WorkerLost). That failure is the old
    engine's: the step is generated again. A failure with no recovery since is raised."""
    epoch = {"now": 0}
    calls: list[int] = []

    def produce(step: int) -> Any:
        calls.append(step)
        if len(calls) == 1:
            epoch["now"] = 1
            raise RlcoreError("vllm-generation: the vllm generation handle was shut down")
        if step == 2:
            raise RlcoreError("the env's reward file is gone")
        return [[]]

    with stream_over(produce, epoch=lambda: epoch["now"]) as stream:
        assert stream.next(1).step == 1
        with pytest.raises(RlcoreError, match="reward file is gone"):
            stream.next(2)
    assert calls[:3] == [1, 1, 2]


def test_a_cancelled_run_stops_the_wait_and_the_producer() -> None:
    stop = threading.Event()
    release = threading.Event()

    def produce(step: int) -> Any:
        release.wait(WAIT_S)
        return [[]]

    stream = stream_over(produce, cancelled=stop.is_set)
    stop.set()
    with pytest.raises(Cancelled, match="step 1"):
        stream.next(1)
    release.set()
    stream.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("rlcore-rollouts") and t.is_alive()]


def test_stale_groups_are_dropped_whole() -> None:
    def rollout(versions: list[int] | None) -> Any:
        r = {"prompt_ids": [1], "token_ids": [7, 3], "logprobs": [-0.1, -0.1], "reward": 1.0}
        return {**r, "versions": versions} if versions is not None else r

    got = StepRollouts(5, [[rollout([3, 4]), rollout(None)], [rollout([1, 4]), rollout([4, 4])]], 3, 0.0, 1.0)
    kept, lags, dropped = _fresh(got, policy_version=4, k=2)
    assert dropped == 1 and len(kept) == 1 and lags == [1, 1]  # the group with a version-1 token went whole
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        stream_over(lambda s: [[]], k=0)


@pytest.mark.parametrize("k", [0, 1])
def test_an_engine_that_reports_other_weights_after_a_refit_is_named(k: int) -> None:
    """The refit of step 1 'succeeded' but engine 1 still reports version 0: the run stops
    at that refit, naming the engine, whether or not the loop runs ahead."""

    journal = Journal()

    class Versioned(Model):
        def weight_versions(self) -> list[int]:
            refits = [line for line in journal.lines if line.startswith("refit ")]
            return [len(refits), 0]  # engine 0 follows the refits, engine 1 never moves

    gen = Versioned(0.5)
    with pytest.raises(RefitError, match=r"refit of step 1, generation backend 'gen' reports engine 1 holds version 0"):
        run_ahead(k, steps=3, journal=journal, generation=GuardedGeneration(gen, "gen", eos_ids={3}))
    assert "refit 1" in journal.lines and "train 2" not in journal.lines

"""Run-time guards: what backends return is checked, and a break names the backend and method."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rlcore.app.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.errors import ProtocolError
from rlcore.handles import RolloutRequest, SamplingParams

BATCH = [([1, 2], [3, 4, 5]), ([1], [6])]
GOOD_LP = [[-0.1, -0.2, -0.3], [-1.0]]


class Scripted:
    """A handle returning whatever the test scripted, for every method."""

    def __init__(self, **returns: Any) -> None:
        self.returns = returns

    def logprobs(self, batch: Any) -> Any:
        return self.returns["logprobs"]

    def generate(self, prompt_ids: Any, params: Any) -> Any:
        return self.returns["generate"]

    def train_step(self, *a: Any, **kw: Any) -> Any:
        return self.returns["train_step"]

    def collect_rollouts(self, request: Any) -> Any:
        return self.returns["collect_rollouts"]

    def shutdown(self) -> None:
        pass


def sample(ids: list[int], lps: list[float] | None = None) -> dict[str, Any]:
    return {"token_ids": ids, "logprobs": lps if lps is not None else [-0.5] * len(ids)}


EOS = 2

LOGPROB_CASES = {
    "rows short": ([[-0.1, -0.2, -0.3]], "one row per pair"),
    "row too short": ([[-0.1, -0.2], [-1.0]], "row 0: 3 logprobs"),
    "positive (temperature-scaled or probs)": ([[0.5, -0.2, -0.3], [-1.0]], "log-probabilities"),
    "nan": ([[math.nan, -0.2, -0.3], [-1.0]], "finite float"),
    "not a list": (None, "one row per pair"),
}


@pytest.mark.parametrize("case", sorted(LOGPROB_CASES))
def test_bad_logprobs_name_backend_method_expected_and_got(case: str) -> None:
    value, expected = LOGPROB_CASES[case]
    for guarded, role in (
        (GuardedPolicy(Scripted(logprobs=value), "pol"), "policy"),
        (GuardedGeneration(Scripted(logprobs=value), "gen"), "generation"),
    ):
        with pytest.raises(ProtocolError, match=expected) as info:
            guarded.logprobs(BATCH)
        err = info.value
        assert err.role == role and err.method == "logprobs"
        assert f"{role} backend '{guarded.backend}'" in str(err) and "got" in str(err)


def test_good_results_pass_through_unchanged() -> None:
    assert GuardedPolicy(Scripted(logprobs=GOOD_LP), "p").logprobs(BATCH) == GOOD_LP
    groups = [[sample([5, EOS]), sample([6])]]
    gen = GuardedGeneration(Scripted(generate=groups), "g", eos_ids={EOS})
    assert gen.generate([[1]], SamplingParams(2, 4, 1.0, 0)) == groups
    metrics = {"loss": 0.5, "grad_norm": 1.0, "tokens": 3}
    assert GuardedPolicy(Scripted(train_step=metrics), "p").train_step(BATCH, [1.0, -1.0]) == metrics


GENERATE_CASES = {
    "group count": ([[sample([5])]] * 2, "one group of samples per prompt"),
    "sample count": ([[sample([5])]], "n=2 samples"),
    "unequal lengths": ([[sample([5, 6], [-0.1]), sample([5])]], "2 logprobs"),
    "after eos": ([[sample([5, EOS, 7]), sample([5])]], "stop after end-of-sequence"),
    "too long": ([[sample([5] * 5), sample([5])]], "max_tokens=4"),
    "empty": ([[sample([]), sample([5])]], "1 to max_tokens"),
    "no dict": ([[[5], sample([5])]], "a dict with token_ids and logprobs"),
    "temperature-scaled": ([[sample([5], [0.3]), sample([5])]], "log-probabilities"),
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_bad_samples_are_named(case: str) -> None:
    value, expected = GENERATE_CASES[case]
    gen = GuardedGeneration(Scripted(generate=value), "mygen", eos_ids={EOS})
    with pytest.raises(ProtocolError, match=expected) as info:
        gen.generate([[1]], SamplingParams(2, 4, 1.0, 0))
    assert info.value.backend == "mygen" and info.value.method == "generate"


def request(prompts: int = 1, samples: int = 2) -> RolloutRequest:
    return RolloutRequest(1, prompts, samples, 4, 1.0, 0, generation=None, tokenizer=None)  # type: ignore[arg-type]


def rollout(**over: Any) -> dict[str, Any]:
    r = {"prompt_ids": [1], "token_ids": [5, 6], "logprobs": [-0.1, -0.2], "reward": 1.0}
    r.update(over)
    return r


ROLLOUT_CASES = {
    "groups": ([[rollout(), rollout()]] * 2, "1 groups of rollouts"),
    "group size": ([[rollout()]], "2 rollouts"),
    "no reward": ([[rollout(), {k: v for k, v in rollout().items() if k != "reward"}]], "reward"),
    "nan reward": ([[rollout(), rollout(reward=math.nan)]], "finite float reward"),
    "lengths": ([[rollout(), rollout(logprobs=[-0.1])]], "2 logprobs"),
}


@pytest.mark.parametrize("case", sorted(ROLLOUT_CASES))
def test_bad_rollouts_are_named(case: str) -> None:
    value, expected = ROLLOUT_CASES[case]
    env = GuardedEnv(Scripted(collect_rollouts=value), "myenv")
    with pytest.raises(ProtocolError, match=expected) as info:
        env.collect_rollouts(request())
    assert info.value.backend == "myenv" and info.value.role == "env"


def test_train_step_without_loss_is_named() -> None:
    pol = GuardedPolicy(Scripted(train_step={"grad_norm": 1.0}), "pol")
    with pytest.raises(ProtocolError, match=r"metrics\['loss'\]"):
        pol.train_step(BATCH, [1.0, 1.0])


def test_a_generate_of_contract_1_is_refused_with_the_port() -> None:
    """A plugin that never declared its contract version is taken as 2.0; its 1.x-style
    generate is named with what changed, not a TypeError from inside a step."""
    class OldEngine:
        def generate(self, prompt_ids, *, n, max_tokens, temperature, seed):  # noqa: ANN001, ANN201
            raise AssertionError("must not be called")

    with pytest.raises(ProtocolError, match=r"'old'.*generate\(prompt_ids, \*, n.*to port a 1.x plugin"):
        GuardedGeneration(OldEngine(), "old").generate([[1]], SamplingParams(n=1, max_tokens=2, temperature=1.0, seed=0))

    class OldWithDefaults:  # 1.x written positionally: params would bind to n
        def generate(self, prompt_ids, n=1, max_tokens=16, temperature=1.0, seed=0):  # noqa: ANN001, ANN201
            raise AssertionError("must not be called")

    with pytest.raises(ProtocolError, match=r"'olddef'.*max_tokens, n, seed, temperature.*to port a 1.x plugin"):
        GuardedGeneration(OldWithDefaults(), "olddef").generate([[1]], SamplingParams(n=1, max_tokens=2, temperature=1.0, seed=0))


def test_weight_versions_are_checked_and_kept() -> None:
    """A sample's and a rollout's ``versions`` (one per token, ints >= 0, never decreasing)
    pass through the guards; without them nothing is added."""
    groups = [[{**sample([5, 6, EOS]), "versions": [3, 3, 4]}, sample([6])]]
    gen = GuardedGeneration(Scripted(generate=groups), "g", eos_ids={EOS})
    out = gen.generate([[1]], SamplingParams(2, 4, 1.0, 0))
    assert out[0][0]["versions"] == [3, 3, 4] and "versions" not in out[0][1]
    rows = [[rollout(versions=[0, 1], model_turns=2), rollout()]]
    got = GuardedEnv(Scripted(collect_rollouts=rows), "e").collect_rollouts(request())
    assert got[0][0]["versions"] == [0, 1] and got[0][0]["model_turns"] == 2
    assert "versions" not in got[0][1]


def test_a_failed_rollouts_reason_is_kept_and_must_be_a_string() -> None:
    rows = [[rollout(failed="reward function 'f' on row 3 raised"), rollout()]]
    got = GuardedEnv(Scripted(collect_rollouts=rows), "e").collect_rollouts(request())
    assert got[0][0]["failed"] == "reward function 'f' on row 3 raised" and "failed" not in got[0][1]
    with pytest.raises(ProtocolError, match="failed, a non-empty reason"):
        GuardedEnv(Scripted(collect_rollouts=[[rollout(failed=True), rollout()]]), "e").collect_rollouts(request())


VERSION_CASES = {
    "too short": ([7], "2 versions"),
    "negative": ([0, -1], "ints >= 0"),
    "float": ([0, 1.0], "ints >= 0"),
    "bool": ([True, True], "ints >= 0"),
    "decreasing": ([2, 1], "never decrease.*2 then 1 at token 1"),
    "not a list": ("01", "a list of 2 ints"),
}


@pytest.mark.parametrize("case", sorted(VERSION_CASES))
def test_bad_weight_versions_are_named(case: str) -> None:
    value, expected = VERSION_CASES[case]
    groups = [[{**sample([5, 6]), "versions": value}, sample([6])]]
    gen = GuardedGeneration(Scripted(generate=groups), "mygen")
    with pytest.raises(ProtocolError, match=expected) as info:
        gen.generate([[1]], SamplingParams(2, 4, 1.0, 0))
    assert info.value.backend == "mygen" and info.value.method == "generate"
    env = GuardedEnv(Scripted(collect_rollouts=[[rollout(versions=value), rollout()]]), "myenv")
    with pytest.raises(ProtocolError, match=expected) as info:
        env.collect_rollouts(request())
    assert info.value.backend == "myenv" and info.value.method == "collect_rollouts"


def test_engine_weight_versions_are_asked_only_of_a_handle_that_has_them() -> None:
    class Versioned(Scripted):
        def weight_versions(self) -> Any:
            return self.returns["weight_versions"]

    assert GuardedGeneration(Scripted(), "plain").weight_versions() is None
    assert GuardedGeneration(Versioned(weight_versions=[2, 2]), "v").weight_versions() == [2, 2]
    for bad in ([], [1, -1], ["step-1"], None):
        with pytest.raises(ProtocolError, match="one weight version") as info:
            GuardedGeneration(Versioned(weight_versions=bad), "v").weight_versions()
        assert info.value.method == "weight_versions"

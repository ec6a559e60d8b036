"""Dynamic sampling (``grpo.dynamic_sampling``, :mod:`rlcore.app.dynamic_sampling`): groups
of equal rewards are dropped and the env asked for more prompts of the step, within a bound;
refused for an env that cannot give them."""

from __future__ import annotations

from typing import Any

import pytest

from rlcore.app.dynamic_sampling import draw_teaching_groups, teaches
from rlcore.config import load_config
from rlcore.declarations import BackendDeclaration, Role
from rlcore.errors import ConfigError
from rlcore.handles import PromptAndScoreEnv
from rlcore.setup.prepared import check_dynamic_sampling


def group(*rewards: float, tag: str = "") -> list[Any]:
    return [{"prompt_ids": [1], "token_ids": [2], "logprobs": [-1.0], "reward": r, "tag": tag} for r in rewards]


def test_a_group_teaches_only_when_its_rewards_differ() -> None:
    assert teaches(group(0.0, 1.0)) and not teaches(group(0.5, 0.5, 0.5))
    # A failed sample's reward does not count: what is left is equal.
    failed = group(0.0, 1.0)
    failed[1]["failed"] = "reward raised"
    assert not teaches(failed)


def test_groups_of_equal_rewards_are_replaced_by_more_draws_until_the_step_is_full() -> None:
    calls: list[int] = []
    draws = {
        0: [group(0, 0, tag="a"), group(0, 1, tag="b"), group(1, 1, tag="c")],
        1: [group(1, 0, tag="d"), group(0, 0, tag="e"), group(0, 1, tag="f")],
    }

    def collect(draw: int) -> list[Any]:
        calls.append(draw)
        return draws[draw]

    got = draw_teaching_groups(collect, want=3, max_draws=4)
    assert calls == [0, 1]
    assert [g[0]["tag"] for g in got.groups] == ["b", "d", "f"]
    assert got.metrics() == {"sampling/dropped_groups": 3.0, "sampling/extra_draws": 1.0, "sampling/short_groups": 0.0}


def test_the_draws_are_bounded_and_a_short_step_trains_on_what_teaches() -> None:
    calls: list[int] = []

    def collect(draw: int) -> list[Any]:
        calls.append(draw)
        return [group(0, 1, tag=f"{draw}")] + [group(0, 0)] * 3

    got = draw_teaching_groups(collect, want=4, max_draws=2)
    assert calls == [0, 1, 2]
    assert [g[0]["tag"] for g in got.groups] == ["0", "1", "2"] and got.short == 1 and got.dropped == 9


def test_when_nothing_teaches_the_first_draw_is_kept() -> None:
    first = [group(0, 0), group(1, 1)]
    got = draw_teaching_groups(lambda draw: first if draw == 0 else [group(2, 2)] * 2, want=2, max_draws=1)
    assert got.groups == first and got.extra_draws == 1 and got.dropped == 4


def test_an_env_that_cannot_draw_more_is_refused_before_start() -> None:
    cfg = load_config(None, ["policy.backend=p", "generation.backend=g", "env.backend=e", "grpo.dynamic_sampling=true"])
    plain = BackendDeclaration(name="plainenv", roles={Role.ENV})
    with pytest.raises(ConfigError, match="env backend 'plainenv' does not declare extra_draws") as info:
        check_dynamic_sampling(cfg, plain)
    assert info.value.key == "grpo.dynamic_sampling"
    with pytest.raises(ConfigError, match="set env.backend"):
        check_dynamic_sampling(cfg, None)
    check_dynamic_sampling(cfg, BackendDeclaration(name="drawing", roles={Role.ENV}, extra_draws=True))


def test_a_prompt_and_score_env_without_extra_prompts_says_what_to_implement() -> None:
    with pytest.raises(NotImplementedError, match="implement sample_extra_prompts and declare extra_draws=True"):
        PromptAndScoreEnv().sample_extra_prompts(2, 1, 1)

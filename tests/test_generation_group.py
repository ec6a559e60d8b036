"""The generation-handle mixin: per-prompt seeds, contiguous shards, refit ranks, closed handles."""

from __future__ import annotations

from typing import Any

import pytest

from rlcore.errors import RlcoreError
from rlcore.runtime.generation_group import GroupGeneration, prompt_seed


class Remote:
    """``actor.method.remote(*args)`` returns what the engine computes, at once."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


class Engine:
    def __init__(self, index: int, calls: list[tuple[int, str, Any]]) -> None:
        self.generate = Remote(lambda prompts, n, mt, t, seeds: (calls.append((index, "generate", seeds)) or
                               [[{"token_ids": [index, s], "logprobs": [-0.1, -0.2]}] * n for s in seeds]))
        self.logprobs = Remote(lambda batch: [[-float(index)] * len(c) for _, c in batch])
        self.open_refit_channel = Remote(lambda spec, rank: ("open", rank))


class Group:
    name = "fake-generation"

    def __init__(self, engines: int) -> None:
        self.calls: list[tuple[int, str, Any]] = []
        self.actors = [Engine(i, self.calls) for i in range(engines)]

    def get(self, refs: Any, *, what: str) -> Any:
        return refs


class Handle(GroupGeneration):
    def __init__(self, engines: int) -> None:
        super().__init__(Group(engines), backend="fake", role="generation")
        self.refit_ranks = engines
        self._specs = ["spec"]


def test_prompt_seeds_are_distinct_and_stable() -> None:
    seeds = [prompt_seed(7, i) for i in range(1000)]
    # Engines give sample j of a prompt seed + j: no two prompts' sample streams may meet.
    assert len({s + j for s in seeds for j in range(16)}) == 16 * len(seeds)
    assert prompt_seed(7, 3) == prompt_seed(7, 3) != prompt_seed(8, 3)


def test_prompts_are_sharded_contiguously_and_keep_their_seeds() -> None:
    h = Handle(engines=2)
    out = h.generate([[1]] * 5, n=2, max_tokens=4, temperature=1.0, seed=7)
    assert [g[0]["token_ids"][0] for g in out] == [0, 0, 0, 1, 1]  # engine of each prompt, in order
    assert [g[0]["token_ids"][1] for g in out] == [prompt_seed(7, i) for i in range(5)]
    assert all(len(g) == 2 for g in out)
    # Seeds do not depend on the number of engines.
    one = Handle(engines=1).generate([[1]] * 5, n=2, max_tokens=4, temperature=1.0, seed=7)
    assert [g[0]["token_ids"][1] for g in one] == [g[0]["token_ids"][1] for g in out]
    # An engine with no prompt gets no call.
    h3 = Handle(engines=3)
    h3.generate([[1]], n=1, max_tokens=4, temperature=1.0, seed=0)
    assert [c[0] for c in h3.group.calls] == [0]
    assert h.logprobs([([1], [2, 3])] * 3) == [[-0.0, -0.0]] * 2 + [[-1.0, -1.0]]


def test_engine_i_is_refit_rank_1_plus_i_and_a_closed_handle_refuses() -> None:
    h = Handle(engines=3)
    assert h.open_refit_channel("spec") == [("open", 1), ("open", 2), ("open", 3)]
    assert h.weight_specs() == ["spec"]
    h._closed = True
    with pytest.raises(RlcoreError, match="fake-generation: the fake generation handle was shut down"):
        h.generate([[1]], n=1, max_tokens=1, temperature=1.0, seed=0)

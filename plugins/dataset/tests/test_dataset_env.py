"""The env end to end over a scripted generation: prompts per epoch, chat template,
rewards in their processes, failed samples marked under ``on_reward_error=skip``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlcore.errors import ConfigError
from rlcore.handles import RolloutRequest
from rlcore_dataset.data import load_rows
from rlcore_dataset.env import DatasetEnv
from rlcore_dataset.options import DatasetOptions
from rlcore_dataset.pool import RewardPool
from rlcore_dataset.rewards import RewardSpec

REWARDS = str(Path(__file__).resolve().parent / "fixture_rewards.py")


class CharTokenizer:
    """Token id = ord(char), BOS 1, EOS 3; a chat template of ``<role>content`` lines."""

    chat_template = "toy"

    class _Enc:
        def __init__(self, ids: list[int]) -> None:
            self.input_ids = ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        return self._Enc(([1] if add_special_tokens else []) + [ord(c) for c in text])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i > 3)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        assert not tokenize and add_generation_prompt
        return "\x01" + "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class Answers:
    """A generation that answers each prompt with the texts it is given, in turn."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.prompts = texts, []

    def generate(self, prompt_ids: Any, params: Any) -> Any:
        self.prompts.extend(prompt_ids)
        sample = lambda t: {"token_ids": [ord(c) for c in t] + [3], "logprobs": [-0.1] * (len(t) + 1)}  # noqa: E731
        return [[sample(self.texts[j % len(self.texts)]) for j in range(params.n)] for _ in prompt_ids]


def env_of(data: Path, *fns: str, **options: Any) -> DatasetEnv:
    o = DatasetOptions(data=str(data), reward=[f"{REWARDS}:{f}" for f in fns], **options)
    specs = [RewardSpec(f"{REWARDS}:{f}") for f in fns]
    pool = RewardPool([s.spec for s in specs], workers=2, timeout_s=30)
    pool.start()
    return DatasetEnv(o, load_rows(o.data), specs, pool)


def request(gen: Answers, step: int = 1, prompts: int = 3, n: int = 2) -> RolloutRequest:
    return RolloutRequest(step, prompts, n, 4, 1.0, 0, gen, CharTokenizer())


def test_rollouts_carry_the_rows_prompts_and_their_rewards(data_file: Path) -> None:
    env = env_of(data_file, "matches")
    try:
        gen = Answers(["1", "2"])
        groups = env.collect_rollouts(request(gen, prompts=10))
        rows = env.sampler.take(10, 1)  # the same step: the same rows
        assert sorted(rows) == list(range(10))
        for row, group in zip(rows, groups, strict=True):
            assert group[0]["prompt_ids"] == [1, *map(ord, f"{row}+1=")]
            # "1" is the answer of row 0, "2" of row 1 (answer = row + 1)
            assert [r["reward"] for r in group] == [float(row == 0), float(row == 1)]
            assert "failed" not in group[0]
    finally:
        env.shutdown()
    env.shutdown()  # idempotent


def test_chat_prompts_go_through_the_template(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "answer": "a"}) + "\n")
    env = env_of(path, "matches", chat_template=True)
    try:
        gen = Answers(["a"])
        groups = env.collect_rollouts(request(gen, prompts=1, n=1))
        assert gen.prompts == [[1, *map(ord, "<system>S<user>Q<assistant>")]]  # one BOS: the template's
        assert groups[0][0]["reward"] == 1.0

        class Plain(CharTokenizer):
            chat_template = None

        with pytest.raises(ConfigError, match="tokenizer has no chat template") as info:
            env.collect_rollouts(RolloutRequest(2, 1, 1, 4, 1.0, 0, gen, Plain()))
        assert info.value.key == "env.options.chat_template"
    finally:
        env.shutdown()


def test_skip_marks_failed_samples_and_scores_the_rest(data_file: Path) -> None:
    env = env_of(data_file, "nan_for_b", on_reward_error="skip")
    try:
        groups = env.collect_rollouts(request(Answers(["a", "b"])))
        for g in groups:
            assert g[0]["reward"] == 1.0 and "failed" not in g[0]
            assert g[1]["reward"] == 0.0 and "nan_for_b" in g[1]["failed"] and "row" in g[1]["failed"]
    finally:
        env.shutdown()


def test_state_continues_the_stream(data_file: Path) -> None:
    env = env_of(data_file, "length")
    try:
        seen = [p.row for step in range(1, 4) for p in env.sample_prompts(4, step)]
        state = env.state()
        nxt = [p.row for p in env.sample_prompts(4, 4)]
        again = env_of(data_file, "length")
        try:
            again.load_state(state)
            assert [p.row for p in again.sample_prompts(4, 4)] == nxt
        finally:
            again.shutdown()
        assert sorted(seen[:10]) == list(range(10))
    finally:
        env.shutdown()

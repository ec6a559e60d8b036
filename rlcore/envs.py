"""A base for envs that make prompts and score completions (the simplest kind of env).

Subclass :class:`PromptAndScoreEnv`, implement :meth:`~PromptAndScoreEnv.sample_prompts`
and :meth:`~PromptAndScoreEnv.score`, and the handle satisfies
:class:`rlcore.handles.EnvHandle`: its ``collect_rollouts`` samples through the
run's generation handle and scores the decoded texts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rlcore.handles import Rollout, RolloutRequest


class Prompt(Protocol):
    """What :meth:`PromptAndScoreEnv.sample_prompts` returns: at least the prompt's text."""

    text: str


class PromptAndScoreEnv:
    """An env that makes prompts and scores completion texts; the core samples."""

    def sample_prompts(self, n: int, step: int) -> Sequence[Prompt]:
        """``n`` prompts for ``step`` (the same step gives the same prompts)."""
        raise NotImplementedError

    def score(self, prompts: Sequence[Any], completions: Sequence[Sequence[str]]) -> list[list[float]]:
        """One reward per completion text (special tokens removed), per prompt."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Nothing to release by default."""

    def collect_rollouts(self, request: RolloutRequest) -> list[list[Rollout]]:
        """Sample ``request.samples_per_prompt`` completions of each prompt through
        ``request.generation``, then score their texts."""
        tok = request.tokenizer
        prompts = list(self.sample_prompts(request.prompts, request.step))
        prompt_ids = [list(tok(p.text).input_ids) for p in prompts]
        groups = request.generation.generate(
            prompt_ids,
            n=request.samples_per_prompt,
            max_tokens=request.max_new_tokens,
            temperature=request.temperature,
            seed=request.seed,
        )
        texts = [[tok.decode(s["token_ids"], skip_special_tokens=True) for s in g] for g in groups]
        rewards = self.score(prompts, texts)
        return [
            [
                Rollout(
                    prompt_ids=pid,
                    token_ids=list(s["token_ids"]),
                    logprobs=list(s["logprobs"]),
                    reward=float(r),
                )
                for s, r in zip(group, group_rewards, strict=True)
            ]
            for pid, group, group_rewards in zip(prompt_ids, groups, rewards, strict=True)
        ]

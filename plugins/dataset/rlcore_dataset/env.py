"""The ``dataset`` env: prompts from the data's rows, rewards from the user's functions.

It lives in the driver (sampling goes through the run's generation, as for every
prompt-and-score env); its reward functions run in a :class:`~rlcore_dataset.pool.RewardPool`
of ``env.workers`` processes, so a reward that hangs or crashes never takes the driver
with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError
from rlcore.handles import PromptAndScoreEnv, Rollout, RolloutRequest, rollout_of
from rlcore_dataset.checks import check_prompt, is_messages, reward_columns
from rlcore_dataset.options import DatasetOptions
from rlcore_dataset.pool import RewardPool
from rlcore_dataset.rewards import RewardSpec
from rlcore_dataset.sampler import EpochSampler
from rlcore_dataset.scoring import GroupInput, GroupScores, RewardError, score_groups


@dataclass(frozen=True)
class DataPrompt:
    """One row's prompt. ``text`` is the prompt string (for chat messages, their contents
    joined: informative only, the chat template renders them); ``prompt`` the value as the
    data holds it (what reward functions get as ``prompts``)."""

    text: str
    row: int
    prompt: Any
    columns: dict[str, Any] = field(default_factory=dict)


class DatasetEnv(PromptAndScoreEnv):
    """Samples rows per epoch from a seeded order and scores completions with the rewards."""

    def __init__(
        self, options: DatasetOptions, rows: list[dict[str, Any]], specs: list[RewardSpec], pool: RewardPool,
        origins: list[str] | None = None,
    ) -> None:
        self.options, self.rows, self.specs, self.pool = options, rows, specs, pool
        #: The reward tracebacks a warning has shown (under ``skip``: each once per run).
        self.traces_shown: set[str] = set()
        #: Where each row is in env.options.data, for messages (``prompts.jsonl line 22``).
        self.origins = origins or [f"row {i} (counted from 0)" for i in range(len(rows))]
        self.sampler = EpochSampler(len(rows), seed=options.seed, shuffle=options.shuffle)
        self._columns = reward_columns(rows[0], options.prompt_column)
        self.closed = False

    def sample_prompts(self, n: int, step: int) -> list[DataPrompt]:
        return [self._prompt(i) for i in self.sampler.take(n, step)]

    def sample_extra_prompts(self, n: int, step: int, draw: int) -> list[DataPrompt]:
        """Dynamic sampling's extra prompts: the next rows of the stream, as a step's."""
        return [self._prompt(i) for i in self.sampler.take(n, step, draw)]

    def _prompt(self, i: int) -> DataPrompt:
        row = self.rows[i]
        check_prompt(row, self.options, where=self.origins[i])
        prompt = row[self.options.prompt_column]
        text = prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in prompt)
        return DataPrompt(text, i, prompt, {c: row.get(c) for c in self._columns})

    def encode(self, tokenizer: Any, prompt: DataPrompt) -> list[int]:
        """The prompt's ids: the text as the tokenizer encodes it, or with ``chat_template``
        the messages rendered by the tokenizer's template with the generation prompt."""
        if not self.options.chat_template:
            return list(tokenizer(prompt.text).input_ids)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "env.options.chat_template is true but the model's tokenizer has no chat template; "
                "use a chat model (model.path) or set env.options.chat_template=false",
                key="env.options.chat_template",
            )
        messages = prompt.prompt if is_messages(prompt.prompt) else [{"role": "user", "content": prompt.text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes the special tokens (BOS) itself.
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)

    def score_detailed(self, prompts: Sequence[DataPrompt], completions: Sequence[Sequence[str]]) -> list[GroupScores]:
        """Each group's rewards and failed samples (``on_reward_error`` applied)."""
        groups = [
            GroupInput(p.row, p.prompt, p.columns, list(c), self.origins[p.row])
            for p, c in zip(prompts, completions, strict=True)
        ]
        return score_groups(
            self.pool, self.specs, groups, on_error=self.options.on_reward_error, shown=self.traces_shown
        )

    def score(self, prompts: Sequence[DataPrompt], completions: Sequence[Sequence[str]]) -> list[list[float]]:
        """One reward per completion; a failed one raises :class:`RewardError` whatever
        ``on_reward_error`` says (a plain score has no way to mark a sample failed)."""
        out = self.score_detailed(prompts, completions)
        for g in out:
            if error := g.error():
                raise RewardError(error)
        return [g.rewards for g in out]

    def collect_rollouts(self, request: RolloutRequest) -> list[list[Rollout]]:
        """The step's prompts sampled through the generation, scored; with
        ``on_reward_error=skip`` a failed sample carries ``failed`` (its reason)."""
        tok = request.tokenizer
        prompts = (
            self.sample_extra_prompts(request.prompts, request.step, request.draw)
            if request.draw
            else self.sample_prompts(request.prompts, request.step)
        )
        prompt_ids = [self.encode(tok, p) for p in prompts]
        groups = request.generation.generate(prompt_ids, request.sampling())
        texts = [[tok.decode(s["token_ids"], skip_special_tokens=True) for s in g] for g in groups]
        scored = self.score_detailed(prompts, texts)
        out = []
        for pid, group, got in zip(prompt_ids, groups, scored, strict=True):
            rollouts = []
            for s, r, failed in zip(group, got.rewards, got.failed, strict=True):
                rollout = rollout_of(pid, s, 0.0 if failed else r)
                if failed:
                    rollout["failed"] = failed
                rollouts.append(rollout)
            out.append(rollouts)
        return out

    def state(self, after_step: int | None = None) -> dict[str, Any]:
        """The position in the stream of rows a run resumed after ``after_step`` continues
        from (:class:`rlcore.handles.ResumableEnv`); ``None``: the current position."""
        return {"sampler": self.sampler.state(after_step)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`state` returned."""
        self.sampler.load_state(state["sampler"])

    def pids(self) -> list[int]:
        """The reward processes' ids."""
        return self.pool.pids()

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.close()

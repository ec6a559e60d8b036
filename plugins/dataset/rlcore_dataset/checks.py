"""The preflight's checks of ``env.options`` (called when the options are resolved, before
any process starts): the data exists and parses, the prompt column is there, the reward
functions import and can take the data's columns. Each failure is one
:class:`~rlcore.errors.ConfigError` naming the key and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcore.errors import ConfigError

if TYPE_CHECKING:
    from rlcore_dataset.options import DatasetOptions


def check_options(o: DatasetOptions) -> None:
    """Every check of ``o`` that needs no model: see the module's docstring."""
    from rlcore_dataset import data, rewards
    from rlcore_dataset.options import ON_REWARD_ERROR

    if o.on_reward_error not in ON_REWARD_ERROR:
        raise ConfigError(
            f"env.options.on_reward_error is {o.on_reward_error!r}; use one of {', '.join(ON_REWARD_ERROR)}",
            key="env.options.on_reward_error",
        )
    specs = rewards.parse_specs(o.reward, o.reward_weights)
    row = data.first_row(o.data, split=o.split)
    check_prompt(row, o, where="the first row")
    columns = reward_columns(row, o.prompt_column)
    for s in specs:
        rewards.check_signature(s.spec, rewards.load(s.spec), columns)


def reward_columns(row: dict[str, Any], prompt_column: str) -> list[str]:
    """The columns passed to the reward functions: every column but the prompt's (it is
    passed as ``prompts``) and those named like a call argument."""
    from rlcore_dataset.rewards import CALL_ARGUMENTS

    return [c for c in row if c != prompt_column and c not in CALL_ARGUMENTS]


def check_prompt(row: dict[str, Any], o: DatasetOptions, *, where: str) -> None:
    """``row`` has a prompt the options can render: a string, or chat messages with
    ``chat_template`` on."""
    if o.prompt_column not in row:
        raise ConfigError(
            f"env.options.prompt_column is {o.prompt_column!r}, a column {where} of env.options.data "
            f"lacks (columns: {', '.join(row) or '(none)'}); set env.options.prompt_column to the "
            "column holding the prompts",
            key="env.options.prompt_column",
        )
    prompt = row[o.prompt_column]
    if isinstance(prompt, str):
        return
    if is_messages(prompt):
        if not o.chat_template:
            raise ConfigError(
                f"env.options.data: column {o.prompt_column!r} holds chat messages ({where}); set "
                "env.options.chat_template=true to render them with the tokenizer's chat template",
                key="env.options.chat_template",
            )
        return
    raise ConfigError(
        f"env.options.data: column {o.prompt_column!r} of {where} is a {type(prompt).__name__}; a "
        "prompt is a string or a list of {'role', 'content'} messages",
        key="env.options.prompt_column",
    )


def is_messages(value: Any) -> bool:
    """Whether ``value`` is chat messages: a non-empty list of dicts with role and content."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )

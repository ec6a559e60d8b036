"""``env.options`` of the ``dataset`` backend: plain data, imported by ``rlcore plugins``.

Resolving the options checks them (``__post_init__``), so a run with a missing file, a
column the prompts need that the data lacks, or a reward that cannot be imported or has
the wrong signature is refused by the preflight, before any process starts, in one line
naming the key and the fix (:mod:`rlcore_dataset.checks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.config import bounded

#: Values of ``on_reward_error``.
ON_REWARD_ERROR = ("fail", "skip")


@dataclass
class DatasetOptions:
    #: The prompts: a JSONL, JSON (a list of objects) or Parquet file, a directory of
    #: such files, or a directory a ``datasets`` dataset was saved to (``save_to_disk``).
    #: Relative paths are relative to the directory the run starts in.
    data: str = ""
    #: The split to read from a saved ``DatasetDict``.
    split: str = "train"
    #: The column holding each prompt: a string, or chat messages (a list of
    #: ``{"role", "content"}``) when ``chat_template`` is on. Every other column is
    #: passed to the reward functions.
    prompt_column: str = "prompt"
    #: Render each prompt through the tokenizer's chat template (a string prompt becomes
    #: one user message), with the generation prompt added.
    chat_template: bool = False
    #: The reward function(s): ``module:function`` or ``path/to/file.py:function``, or a
    #: list of them. Each is called as ``fn(completions, prompts=..., **columns)`` once per
    #: group and returns one float per completion (TRL's convention); sync or async.
    reward: Any = None
    #: One weight per reward function (default: 1.0 each); the reward is the weighted sum.
    reward_weights: list[float] | None = None
    #: Bound on one reward call; a call past it is killed with its process (the next call
    #: starts a fresh one).
    reward_timeout_s: float = bounded(60.0, gt=0)
    #: A reward call that raises, hangs, returns the wrong count or a non-finite value:
    #: ``fail`` ends the step naming the function and the row; ``skip`` records its samples
    #: as failed (``reward/failed`` in the step's metrics) and leaves them out of their
    #: group's advantage.
    on_reward_error: str = "fail"
    #: Seed of each epoch's order of the rows.
    seed: int = bounded(0, ge=0)
    #: Shuffle each epoch (false: the file's order, every epoch).
    shuffle: bool = True

    def __post_init__(self) -> None:
        from rlcore_dataset.checks import check_options

        check_options(self)

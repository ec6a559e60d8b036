"""Reward functions for the dataset backend's tests (loaded by path, in reward processes)."""

from __future__ import annotations

import asyncio
import json
import os
import time


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def matches(completions, answer, prompts=None):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


async def async_length(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def rank_in_group(completions, **kwargs):
    """Group-level: 1.0 for the longest completion of the group, 0.0 for the rest."""
    longest = max(len(c) for c in completions)
    return [1.0 if len(c) == longest else 0.0 for c in completions]


def raises(completions, **kwargs):
    raise ValueError("boom")


def hangs(completions, **kwargs):
    with open(os.environ["HANG_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    return [0.0] * len(completions)


def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def nan_for_b(completions, **kwargs):
    return [float("nan") if c == "b" else 1.0 for c in completions]


def needs_missing(completions, difficulty):
    return [0.0] * len(completions)


def no_completions(texts):
    return [0.0] * len(texts)


def dies(completions, **kwargs):
    os._exit(3)


def _parse(text):
    return json.loads(text)  # raises inside the standard library: only this line is the user's


def raises_in_helper(completions, **kwargs):
    return [float(_parse(c)) for c in completions]

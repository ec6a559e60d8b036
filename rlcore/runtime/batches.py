"""Training batches as policy workers receive them: checking and sharding rows.

A row is ``(prompt_ids, completion_ids)``; advantages are one float per row and
old logprobs one float per completion token. Pure Python, shared by every
policy backend so that they reject the same bad input with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: A batch row: (prompt token ids, completion token ids).
Row = tuple[Sequence[int], Sequence[int]]


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of part ``index`` when ``n`` rows are split into ``parts``
    contiguous, near-equal parts (the first ``n % parts`` get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def check_rows(batch: Sequence[Row]) -> list[tuple[list[int], list[int]]]:
    """The rows as int lists; ValueError naming the first malformed row."""
    rows = []
    for i, row in enumerate(batch):
        try:
            prompt, completion = row
        except (TypeError, ValueError):
            raise ValueError(f"batch row {i} is not a (prompt_ids, completion_ids) pair") from None
        prompt, completion = [int(t) for t in prompt], [int(t) for t in completion]
        if not prompt:
            raise ValueError(
                f"batch row {i} has an empty prompt: the first completion token needs context"
            )
        rows.append((prompt, completion))
    return rows


def check_train_inputs(
    batch: Sequence[Row],
    advantages: Sequence[float],
    old_logprobs: Sequence[Sequence[float]] | None,
) -> list[tuple[list[int], list[int]]]:
    """:func:`check_rows` plus one advantage per row and one old logprob per completion token."""
    rows = check_rows(batch)
    if len(advantages) != len(rows):
        raise ValueError(f"{len(advantages)} advantages for a batch of {len(rows)} rows")
    if old_logprobs is not None:
        if len(old_logprobs) != len(rows):
            raise ValueError(
                f"{len(old_logprobs)} old_logprobs rows for a batch of {len(rows)} rows"
            )
        for i, ((_, c), old) in enumerate(zip(rows, old_logprobs, strict=True)):
            if len(old) != len(c):
                raise ValueError(
                    f"batch row {i}: {len(old)} old logprobs for {len(c)} completion tokens"
                )
    return rows


def put_rows(batch: Sequence[Row]) -> Any:
    """The rows in Ray's object store, once for every rank (a top-level ref argument is
    resolved by Ray before the call, so each rank gets the list, not the ref)."""
    import ray

    return ray.put([(list(p), list(c)) for p, c in batch])


def put_train_inputs(
    batch: Sequence[Row],
    advantages: Sequence[float],
    old_logprobs: Sequence[Sequence[float]] | None,
) -> tuple[Any, Any, Any]:
    """Rows, advantages and old logprobs of a train step in Ray's object store (see
    :func:`put_rows`): the leading arguments of every policy worker's ``train_step``."""
    import ray

    old = None if old_logprobs is None else [[float(x) for x in r] for r in old_logprobs]
    return put_rows(batch), ray.put([float(a) for a in advantages]), ray.put(old)

"""Which rows each step gets: every row once per epoch, in an order seeded per epoch.

The stream of rows is epoch 0's order, then epoch 1's, and so on; a step takes the next
``n`` of it. The position in the stream is the sampler's whole state
(:meth:`EpochSampler.state`), so a run resumed with it continues where it was.
"""

from __future__ import annotations

import random
from typing import Any

#: (step, draw) entries whose start position is remembered, so a step asked again (the same step must give
#: the same prompts: a retried rollout, the conformance suite) gets the same rows.
REMEMBERED_STEPS = 64


class EpochSampler:
    """Row indices without replacement per epoch, from a seeded order."""

    def __init__(self, rows: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if rows < 1:
            raise ValueError(f"an EpochSampler needs at least one row, got {rows}")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.position = 0  # rows taken so far, over every epoch
        self._starts: dict[tuple[int, int], int] = {}  # (step, draw) -> its first position
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of the row indices (the same for a given seed)."""
        if epoch not in self._orders:
            idx = list(range(self.rows))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
            self._orders = {epoch: idx}  # an epoch is read through before the next begins
        return self._orders[epoch]

    def take(self, n: int, step: int, draw: int = 0) -> list[int]:
        """The rows of ``step`` (and of its extra ``draw`` of dynamic sampling): the next ``n``
        of the stream, or the same rows as the first time when they were taken already."""
        key = (step, draw)
        start = self._starts.get(key)
        if start is None:
            start = self._starts[key] = self.position
            self.position += n
            for old in sorted(self._starts)[:-REMEMBERED_STEPS]:
                del self._starts[old]
        return [self.order(p // self.rows)[p % self.rows] for p in range(start, start + n)]

    @property
    def epoch(self) -> int:
        """The epoch the next row comes from."""
        return self.position // self.rows

    def state(self, after_step: int | None = None) -> dict[str, Any]:
        """What a run resumed after ``after_step`` needs to continue the stream (plain JSON):
        the position where step ``after_step + 1`` starts, which may be behind the current one
        when later steps were taken already (a loop that samples ahead); ``None``: the
        current position."""
        position = self.position
        if after_step is not None:
            position = self._starts.get((after_step + 1, 0), position)
        return {"position": position, "rows": self.rows, "seed": self.seed, "shuffle": self.shuffle}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (what :meth:`state` returned). The rows, seed and shuffle
        must be those of the state: another order would repeat or skip rows."""
        mine = self.state()
        for k in ("rows", "seed", "shuffle"):
            if k in state and state[k] != mine[k]:
                raise ValueError(
                    f"the sampler state was saved with {k}={state[k]!r}, this run has {mine[k]!r}: "
                    "resume with the same env.options.data, seed and shuffle"
                )
        self.position = int(state["position"])
        self._starts.clear()

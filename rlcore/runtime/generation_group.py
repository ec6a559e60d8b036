"""Driver-side methods a generation handle over a :class:`rlcore.runtime.workers.WorkerGroup` of
independent engines shares (the generation counterpart of :mod:`rlcore.runtime.policy_group`).

:class:`GroupGeneration` implements :class:`rlcore.handles.RefitReceiver` (engine ``i``
is rank ``1 + i`` of every refit channel) and the generation calls of
:class:`rlcore.handles.GenerationHandle`, fanned out over the engines in contiguous
shards. Its workers provide ``open_refit_channel(spec, rank)``,
``receive_weights(spec, step, buckets)``, ``refit_ceiling(spec, rank, step, nbytes)``,
``generate(prompt_ids, n, max_tokens, temperature, seeds)`` and ``logprobs(batch)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from rlcore.handles import Pair, Sample
from rlcore.runtime.batches import shard_range
from rlcore.runtime.group_handle import GroupHandle


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt ``index`` of a call made with ``seed``.

    Engines seed the ``j``-th sample of a request ``seed + j``, so consecutive
    per-prompt seeds (``seed + index``) would make prompt 0's second sample and
    prompt 1's first share a random stream. A 48-bit hash keeps every
    (call, prompt, sample) stream distinct, and does not depend on how the
    prompts are split across engines.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


class GroupGeneration(GroupHandle):
    """A base for generation handles (see the module doc). The handle sets
    ``refit_ranks`` (the number of engines) and ``_specs`` (the ``TensorSpec`` list the
    engines expect); its lifecycle is :class:`rlcore.runtime.group_handle.GroupHandle`'s."""

    refit_ranks: int
    _specs: list[Any]

    # ------------------------------------------------------------ refit side

    def weight_specs(self) -> list[Any]:
        """``TensorSpec`` of every weight the engines expect (Hugging Face names)."""
        return list(self._specs)

    def open_refit_channel(self, spec: Any) -> list[Any]:
        """Every engine joins channel ``spec`` (engine ``i`` as rank ``1 + i``); Ray refs."""
        return [a.open_refit_channel.remote(spec, 1 + i) for i, a in enumerate(self._actors())]

    def refit_ceiling(self, spec: Any, step: int, nbytes: int) -> list[Any]:
        """Every engine receives ``nbytes`` raw over the channel (``bench/``); Ray refs."""
        return [a.refit_ceiling.remote(spec, 1 + i, step, nbytes) for i, a in enumerate(self._actors())]

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        """Every engine receives and loads the buckets; Ray refs that resolve when all have loaded."""
        return [a.receive_weights.remote(spec, step, buckets) for a in self._actors()]

    # -------------------------------------------------------- training loop

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        seed: int,
    ) -> list[list[Sample]]:
        """``n`` samples per prompt (:class:`rlcore.handles.GenerationHandle`).

        Prompts are split into contiguous shards over the engines; prompt ``i``
        samples with seed :func:`prompt_seed` ``(seed, i)``, so results do not
        depend on the number of engines.
        """
        seeds = [prompt_seed(seed, i) for i in range(len(prompt_ids))]
        refs = [
            actor.generate.remote([list(p) for p in prompt_ids[a:b]], n, max_tokens, temperature, seeds[a:b])
            for actor, (a, b) in self._shards(len(prompt_ids))
        ]
        return [group for part in self.group.get(refs, what="generate") for group in part]

    def logprobs(self, batch: Sequence[Pair]) -> list[list[float]]:
        """Per-token log-probabilities of each ``(prompt_ids, completion_ids)`` pair's completion."""
        refs = [
            actor.logprobs.remote([(list(p), list(c)) for p, c in batch[a:b]])
            for actor, (a, b) in self._shards(len(batch))
        ]
        return [row for part in self.group.get(refs, what="logprobs") for row in part]

    # ------------------------------------------------------------ helpers

    def _shards(self, count: int) -> list[tuple[Any, tuple[int, int]]]:
        """(engine, [start, end)) of each non-empty contiguous shard of ``count`` items."""
        actors = self._actors()
        bounds = [shard_range(count, len(actors), i) for i in range(len(actors))]
        return [(a, (s, e)) for a, (s, e) in zip(actors, bounds, strict=True) if e > s]

    def _actors(self) -> list[Any]:
        self._check_open()
        return self.group.actors

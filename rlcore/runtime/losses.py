"""The policy-gradient step both policy backends train with (torch, imported lazily).

GRPO's clipped objective per completion token: ``min(ratio * A, clip(ratio, 1 - eps,
1 + eps) * A)`` with ``ratio = exp(logprob - old_logprob)`` and ``A`` the row's
advantage. A row without old logprobs is on-policy (ratio 1: the REINFORCE gradient).
:func:`rlcore.testing.reference.reference_grpo_step` is the single-process reference
the backends' tests compare against.

Around the loss: :func:`right_padded` (the batch of one forward pass) and
:class:`LogprobWorker` / :class:`PolicyGradientWorker`, a rank's ``logprobs`` and
``train_step`` over a backend's own forward pass, gradient reduction and clipping.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from rlcore.runtime.batches import Row, check_rows, check_train_inputs, shard_range


def clipped_pg_loss(
    token_lp: Any,
    mask: Any,
    spans: Sequence[tuple[int, int]],
    advantages: Sequence[float],
    old_rows: Sequence[Sequence[float] | None],
    clip_eps: float,
    *,
    adv_dtype: Any = None,
) -> tuple[Any, Any]:
    """Per-token loss (``-objective``, zero where ``mask`` is false) and the number of
    masked tokens whose ratio left the clip range.

    Args:
        token_lp: ``[rows, T]`` logprobs of the completion tokens under the current weights.
        mask: ``[rows, T]`` bool, true at completion tokens.
        spans: per row, the ``[start, end)`` columns of its completion in ``token_lp``.
        advantages: one per row.
        old_rows: per row, the logprobs before the step (``None``: on-policy).
        clip_eps: the ratio's clip range.
        adv_dtype: dtype of the advantages (default: ``token_lp``'s).
    """
    import torch

    adv = torch.tensor(
        [[float(a)] for a in advantages], dtype=adv_dtype or token_lp.dtype, device=token_lp.device
    )
    old = token_lp.detach().clone()
    for i, row in enumerate(old_rows):
        if row is not None:
            start, end = spans[i]
            old[i, start:end] = torch.tensor(row, dtype=old.dtype, device=old.device)
    ratio = torch.exp(torch.where(mask, token_lp - old, torch.zeros_like(token_lp)))
    objective = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    clipped = (((ratio.detach() - 1).abs() > clip_eps) & mask).sum()
    return -objective * mask, clipped


def model_logprobs(model: Any, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
    """Logprob (temperature 1) of each completion token given everything before it under a
    transformers causal LM, one row at a time, no padding: the plain computation references
    compare against (the conformance suite, a failed refit check's diagnosis)."""
    import torch

    out = []
    with torch.no_grad():
        for p, c in batch:
            ids = torch.tensor([[*p, *c]])
            logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            out.append([logp[len(p) - 1 + j, t].item() for j, t in enumerate(c)])
    return out


class PaddedRows(NamedTuple):
    """Rows ``(prompt, completion)`` as one right-padded batch (see :func:`right_padded`)."""

    #: ``[rows, width]`` long: prompt + completion, then ``pad_id``.
    ids: Any
    #: ``[rows, width - 1 - first]`` bool: the columns that hold a completion token's logprob.
    mask: Any
    #: Per row, the ``[start, end)`` columns of its completion in ``mask``.
    spans: list[tuple[int, int]]
    #: The shortest prompt's last position: column 0 of ``mask`` predicts token ``first + 1``.
    first: int
    #: Per row, its unpadded length.
    lengths: list[int]


def right_padded(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> PaddedRows:
    """``rows`` right-padded to the longest, on the CPU, with the columns of their
    completion tokens' logprobs: from the shortest prompt's last position on (earlier
    positions predict no completion token, so a forward pass need not keep their logits)."""
    import torch

    lengths = [len(p) + len(c) for p, c in rows]
    width = max(lengths)
    first = min(len(p) for p, _ in rows) - 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1 - first), dtype=torch.bool)
    spans = []
    for i, (p, c) in enumerate(rows):
        ids[i, : lengths[i]] = torch.tensor(p + c, dtype=torch.long)
        spans.append((len(p) - 1 - first, len(p) - 1 - first + len(c)))
        mask[i, spans[-1][0] : spans[-1][1]] = True
    return PaddedRows(ids, mask, spans, first, lengths)


class LogprobWorker:
    """A rank's ``logprobs`` over the backend's forward pass (a mixin for
    :class:`rlcore.runtime.worker_group.DistributedWorker` subclasses).

    The batch is split into contiguous near-equal shards, one per data-parallel replica
    (:meth:`_data_parallel`), each run in micro-batches (:meth:`_micro_batches`). An
    empty micro-batch runs a padding pass on one ``pad_id`` row: a backend whose ranks
    gather in every forward (FSDP) keeps them in lockstep so.

    A subclass provides ``pad_id``, :meth:`_require_model`, :meth:`_data_parallel`,
    :meth:`_micro_batches` and :meth:`_forward_logprobs`.
    """

    pad_id: int

    def _require_model(self) -> None:
        """Raise when the model is not loaded yet."""
        raise NotImplementedError

    def _data_parallel(self) -> tuple[int, int]:
        """``(replicas, this rank's replica)``: how batches are split."""
        raise NotImplementedError

    def _micro_batches(self, local: list[Any], n_rows: int) -> Iterator[list[Any]]:
        """This rank's ``local`` rows in micro-batches (``n_rows``: the whole batch's)."""
        raise NotImplementedError

    def _forward_logprobs(
        self, rows: Sequence[tuple[list[int], list[int]]]
    ) -> tuple[Any, Any, list[tuple[int, int]]]:
        """``(token_lp, mask, spans)`` of one forward pass, as :func:`right_padded` lays
        them out: float32 logprobs of each next token, the completion columns, each
        row's completion span."""
        raise NotImplementedError

    def _rows_or_padding(self, chunk: list[Any]) -> list[Any]:
        return chunk or [([self.pad_id], [self.pad_id])]

    def logprobs(self, batch: Sequence[Row]) -> list[list[float]]:
        """Per-token logprobs of each completion under the current weights. Collective.

        Every rank returns its replica's shard, so concatenating one rank's result per
        replica, in replica order, gives the batch.
        """
        import torch

        self._require_model()
        rows = check_rows(batch)
        replicas, replica = self._data_parallel()
        start, end = shard_range(len(rows), replicas, replica)
        out: list[list[float]] = []
        with torch.no_grad():
            for chunk in self._micro_batches(rows[start:end], len(rows)):
                token_lp, _, spans = self._forward_logprobs(self._rows_or_padding(chunk))
                if not chunk:
                    continue
                token_lp = token_lp.cpu()
                out.extend(
                    token_lp[i, a:b].tolist() for i, (a, b) in enumerate(spans[: len(chunk)])
                )
        return out


class PolicyGradientWorker(LogprobWorker):
    """:class:`LogprobWorker` plus the GRPO ``train_step`` (clipped policy gradient, AdamW).

    Besides :class:`LogprobWorker`'s, a subclass provides ``optimizer``, ``options`` (with
    ``max_grad_norm``), ``device``, :meth:`_replica_group` and :meth:`_finish_gradients`,
    and says in :attr:`averages_gradients` how its gradients meet over the replicas.
    """

    optimizer: Any
    options: Any
    device: Any
    #: True when the backend averages the gradients over the replicas (FSDP): each rank
    #: then scales its loss by the replica count as well.
    averages_gradients: bool = False

    def _replica_group(self) -> Any:
        """The process group over the replicas (None: the default group)."""
        return None

    def _before_step(self) -> None:
        """Called before a step touches the batch (a colocated rank wakes here)."""

    def _finish_gradients(self) -> float:
        """Reduce the accumulated gradients where the backend has not, clip them to
        ``options.max_grad_norm`` (``<= 0``: no clipping); the global norm before clipping."""
        raise NotImplementedError

    def train_step(
        self,
        batch: Sequence[Row],
        advantages: Sequence[float],
        old_logprobs: Sequence[Sequence[float]] | None,
        clip_eps: float,
        lr: float,
    ) -> dict[str, float]:
        """One GRPO step (clipped policy gradient, AdamW). Collective.

        ``loss = -mean over all completion tokens of the batch of
        min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)`` with
        ``ratio = exp(logprob - old_logprob)`` and ``A`` the row's advantage;
        ``old_logprobs=None`` means on-policy (ratio 1, the REINFORCE gradient).

        Rows are sharded over the replicas like :meth:`logprobs`; each rank scales its
        token sum by ``1 / total_tokens`` (times the replica count where the backend
        averages gradients), so the reduced gradient is exactly that of the global token
        mean. Padding passes weigh nothing.

        Returns ``loss``, ``grad_norm`` (before clipping), ``clip_fraction`` (tokens whose
        ratio left the clip range), ``tokens`` and ``lr``; identical on every rank.
        """
        self._require_model()
        assert self.optimizer is not None and self.options is not None
        self._before_step()
        rows = check_train_inputs(batch, advantages, old_logprobs)
        n_tokens = sum(len(c) for _, c in rows)
        replicas, replica = self._data_parallel()
        start, end = shard_range(len(rows), replicas, replica)
        local = [
            (rows[i], float(advantages[i]), None if old_logprobs is None else old_logprobs[i])
            for i in range(start, end)
        ]
        scale = (replicas if self.averages_gradients else 1.0) / max(n_tokens, 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        stats = self._accumulate_gradients(local, len(rows), clip_eps, scale)
        grad_norm = self._finish_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if replicas > 1:
            stats = self._summed_over_replicas(stats)
        return {
            "loss": float(stats[0]) / max(n_tokens, 1),
            "grad_norm": grad_norm,
            "clip_fraction": float(stats[1]) / max(n_tokens, 1),
            "tokens": float(n_tokens),
            "lr": float(lr),
        }

    def _accumulate_gradients(
        self, local: list[tuple[Row, float, Sequence[float] | None]], n_rows: int, clip_eps: float, scale: float
    ) -> Any:
        """Forward and backward over this rank's ``local`` rows, micro-batch by micro-batch
        (a rank with no rows runs padding passes that weigh nothing), each token's loss
        scaled by ``scale``; returns this rank's (loss sum, clipped tokens) as a float64 tensor."""
        import torch

        stats = torch.zeros(2, dtype=torch.float64)  # loss sum, clipped tokens
        for chunk in self._micro_batches(local, n_rows):
            token_lp, mask, spans = self._forward_logprobs(
                self._rows_or_padding([r for r, _, _ in chunk])
            )
            if not chunk:
                mask = torch.zeros_like(mask)
            token_loss, n_clipped = clipped_pg_loss(
                token_lp,
                mask,
                spans,
                [a for _, a, _ in chunk] or [0.0],
                [old_row for _, _, old_row in chunk] or [None],
                clip_eps,
                adv_dtype=torch.float32,
            )
            (token_loss.sum() * scale).backward()
            stats[0] += token_loss.detach().sum().double().cpu()
            stats[1] += n_clipped.double().cpu()
        return stats

    def _summed_over_replicas(self, stats: Any) -> Any:
        """``stats`` summed over the data-parallel replicas (collective)."""
        import torch.distributed as dist

        stats = stats.to(self.device)
        dist.all_reduce(stats, group=self._replica_group())
        return stats.cpu()

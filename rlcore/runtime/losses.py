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

from rlcore.handles import LossOptions
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
    clip_eps_high: float | None = None,
    weights: Any = None,
) -> tuple[Any, Any]:
    """Per-token loss (``-weights * objective``, zero where ``mask`` is false) and the
    number of masked tokens whose ratio left the clip range.

    Args:
        token_lp: ``[rows, T]`` logprobs of the completion tokens under the current weights.
        mask: ``[rows, T]`` bool, true at completion tokens.
        spans: per row, the ``[start, end)`` columns of its completion in ``token_lp``.
        advantages: one per row.
        old_rows: per row, the logprobs before the step (``None``: on-policy).
        clip_eps: the ratio's clip range, below (and above, without ``clip_eps_high``).
        adv_dtype: dtype of the advantages (default: ``token_lp``'s).
        clip_eps_high: the range above 1 (DAPO's clip-higher); ``None``: ``clip_eps``.
        weights: ``[rows, T]`` per-token factors (a rollout correction's), or ``None``.
    """
    import torch

    high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = torch.tensor(
        [[float(a)] for a in advantages], dtype=adv_dtype or token_lp.dtype, device=token_lp.device
    )
    old = _rows_into(token_lp.detach().clone(), spans, old_rows)
    ratio = torch.exp(torch.where(mask, token_lp - old, torch.zeros_like(token_lp)))
    objective = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv)
    r = ratio.detach()
    clipped = (((r < 1 - clip_eps) | (r > 1 + high)) & mask).sum()
    if weights is not None:
        objective = objective * weights
    return -objective * mask, clipped


def _rows_into(out: Any, spans: Sequence[tuple[int, int]], rows: Sequence[Sequence[float] | None]) -> Any:
    """``out`` with each given row's values written at its completion's columns."""
    import torch

    for i, row in enumerate(rows):
        if row is not None:
            start, end = spans[i]
            out[i, start:end] = torch.tensor(row, dtype=out.dtype, device=out.device)
    return out


def correction_weights(
    token_lp: Any,
    mask: Any,
    spans: Sequence[tuple[int, int]],
    old_rows: Sequence[Sequence[float] | None],
    engine_rows: Sequence[Sequence[float] | None],
    correction: str,
    cap: float,
) -> Any:
    """Per-token factors of a rollout correction (:class:`rlcore.handles.LossOptions`):
    ``rho = exp(old - engine)``, the trainer's over the sampler's probability of each
    sampled token (``old``: the rows' old logprobs, the current ones where a row has
    none), ``tis``: ``min(rho, cap)``, ``mis``: ``rho`` where ``rho <= cap``, else 0;
    ``None`` for ``none``. Detached: a weight, not a path of the gradient."""
    import torch

    if correction == "none":
        return None
    trainer = _rows_into(token_lp.detach().clone(), spans, old_rows)
    sampler = _rows_into(trainer.clone(), spans, engine_rows)
    rho = torch.exp(torch.where(mask, trainer - sampler, torch.zeros_like(trainer))).to(token_lp.dtype)
    if correction == "tis":
        return torch.clamp(rho, max=cap)
    if correction == "mis":
        return torch.where(rho <= cap, rho, torch.zeros_like(rho))
    raise ValueError(f"unknown rollout correction {correction!r} (none, tis or mis)")


def row_scales(lengths: Sequence[int], aggregation: str, norm_tokens: int | None = None) -> list[float]:
    """Each row's factor on its token losses so that their sum is the step's loss under
    ``aggregation`` (:class:`rlcore.handles.LossOptions`): ``1 / tokens`` (token_mean),
    ``1 / (rows * len_i)`` (seq_mean_token_mean), ``1 / (rows * norm_tokens)``
    (seq_mean_token_sum_norm). Applied to every row of the global batch, so the gradient
    summed over ranks and micro-batches is that of the aggregated loss."""
    rows, tokens = len(lengths), sum(lengths)
    if aggregation == "token_mean":
        return [1.0 / max(tokens, 1)] * rows
    if aggregation == "seq_mean_token_mean":
        return [1.0 / (rows * max(n, 1)) for n in lengths]
    if aggregation == "seq_mean_token_sum_norm":
        if not norm_tokens:
            raise ValueError("seq_mean_token_sum_norm needs norm_tokens >= 1")
        return [1.0 / (rows * norm_tokens)] * rows
    raise ValueError(
        f"unknown loss aggregation {aggregation!r} (token_mean, seq_mean_token_mean or seq_mean_token_sum_norm)"
    )


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


class _Local(NamedTuple):
    """One row of a rank's share of a train step."""

    row: Row
    advantage: float
    old: Sequence[float] | None
    engine: Sequence[float] | None
    scale: float


#: The plain GRPO loss (no ``loss=`` given): symmetric clip, token mean, no correction.
_PLAIN_LOSS = LossOptions()


def _engine_rows(shape: LossOptions, rows: Sequence[Row]) -> list[list[float]] | None:
    """The engine's logprobs a correction needs, checked one per completion token."""
    if shape.correction == "none" or shape.engine_logprobs is None:
        return None
    engine = [[float(x) for x in r] for r in shape.engine_logprobs]
    if len(engine) != len(rows):
        raise ValueError(f"LossOptions.engine_logprobs has {len(engine)} rows for {len(rows)} pairs")
    for i, ((_, completion), lp) in enumerate(zip(rows, engine, strict=True)):
        if len(lp) != len(completion):
            raise ValueError(
                f"LossOptions.engine_logprobs row {i} has {len(lp)} logprobs for {len(completion)} tokens"
            )
    return engine


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
        loss: LossOptions | None = None,
    ) -> dict[str, float]:
        """One GRPO step (clipped policy gradient, AdamW). Collective.

        ``loss = -mean over all completion tokens of the batch of
        min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)`` with
        ``ratio = exp(logprob - old_logprob)`` and ``A`` the row's advantage;
        ``old_logprobs=None`` means on-policy (ratio 1, the REINFORCE gradient).
        ``loss`` (:class:`rlcore.handles.LossOptions`, contract 2.5): the asymmetric clip,
        the aggregation and the rollout correction it names.

        Rows are sharded over the replicas like :meth:`logprobs`; each rank scales each
        row's token losses by its share of the aggregated loss (:func:`row_scales`; times
        the replica count where the backend averages gradients), so the reduced gradient
        is exactly that of the global loss. Padding passes weigh nothing.

        Returns ``loss``, ``grad_norm`` (before clipping), ``clip_fraction`` (tokens whose
        ratio left the clip range), ``tokens`` and ``lr``; identical on every rank.
        """
        self._require_model()
        assert self.optimizer is not None and self.options is not None
        self._before_step()
        rows = check_train_inputs(batch, advantages, old_logprobs)
        shape = loss or _PLAIN_LOSS
        engine = _engine_rows(shape, rows)
        lengths = [len(c) for _, c in rows]
        n_tokens = sum(lengths)
        scales = row_scales(lengths, shape.aggregation, shape.norm_tokens)
        replicas, replica = self._data_parallel()
        start, end = shard_range(len(rows), replicas, replica)
        local = [
            _Local(rows[i], float(advantages[i]), None if old_logprobs is None else old_logprobs[i],
                   None if engine is None else engine[i], scales[i])
            for i in range(start, end)
        ]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        factor = float(replicas) if self.averages_gradients else 1.0
        stats = self._accumulate_gradients(local, len(rows), clip_eps, factor, shape)
        grad_norm = self._finish_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if replicas > 1:
            stats = self._summed_over_replicas(stats)
        return {
            "loss": float(stats[0]),
            "grad_norm": grad_norm,
            "clip_fraction": float(stats[1]) / max(n_tokens, 1),
            "tokens": float(n_tokens),
            "lr": float(lr),
        }

    def _accumulate_gradients(
        self, local: list[_Local], n_rows: int, clip_eps: float, factor: float, shape: LossOptions
    ) -> Any:
        """Forward and backward over this rank's ``local`` rows, micro-batch by micro-batch
        (a rank with no rows runs padding passes that weigh nothing), each row's token
        losses scaled by its share of the loss (times ``factor``); returns this rank's
        (aggregated loss part, clipped tokens) as a float64 tensor."""
        import torch

        stats = torch.zeros(2, dtype=torch.float64)  # loss, clipped tokens
        for chunk in self._micro_batches(local, n_rows):
            token_lp, mask, spans = self._forward_logprobs(self._rows_or_padding([x.row for x in chunk]))
            if not chunk:
                mask = torch.zeros_like(mask)
            olds = [x.old for x in chunk] or [None]
            weights = correction_weights(
                token_lp, mask, spans, olds, [x.engine for x in chunk] or [None], shape.correction, shape.cap
            )
            token_loss, n_clipped = clipped_pg_loss(
                token_lp, mask, spans, [x.advantage for x in chunk] or [0.0], olds, clip_eps,
                adv_dtype=torch.float32, clip_eps_high=shape.clip_eps_high, weights=weights,
            )
            scale = torch.tensor([[x.scale] for x in chunk] or [[0.0]], dtype=torch.float64)
            (token_loss * scale.to(token_loss.device, token_loss.dtype)).sum().mul(factor).backward()
            stats[0] += (token_loss.detach().double().cpu() * scale).sum()
            stats[1] += n_clipped.double().cpu()
        return stats

    def _summed_over_replicas(self, stats: Any) -> Any:
        """``stats`` summed over the data-parallel replicas (collective)."""
        import torch.distributed as dist

        stats = stats.to(self.device)
        dist.all_reduce(stats, group=self._replica_group())
        return stats.cpu()

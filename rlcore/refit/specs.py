"""Tensor specs, bucket plans and channel specs: what both sides of a refit agree on
before any byte moves.

This module imports nothing of rlcore above :mod:`rlcore.errors`: the contract
(:mod:`rlcore.handles`) names its types, and every transport builds on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rlcore.errors import RefitError

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


@dataclass(frozen=True)
class TensorSpec:
    """A weight as both sides name it: Hugging Face name, full (unsharded) shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE[self.dtype]


def spec_of(name: str, tensor: Any) -> TensorSpec:
    """The spec of a torch tensor."""
    return TensorSpec(name, tuple(int(d) for d in tensor.shape), str(tensor.dtype).removeprefix("torch."))


def check_specs(
    sent: Sequence[TensorSpec], expected: Sequence[TensorSpec], *, sender: str, receiver: str, limit: int = 10
) -> None:
    """Raise :class:`RefitError` unless ``sent`` and ``expected`` match name for name.

    The message lists missing and unexpected names and shape/dtype mismatches,
    so a wrong mapping fails before any byte is written.
    """
    have = {s.name: s for s in sent}
    want = {s.name: s for s in expected}
    problems: list[str] = []
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    if missing:
        problems.append(f"{len(missing)} weight(s) {receiver} expects but {sender} does not send: {missing[:limit]}")
    if extra:
        problems.append(f"{len(extra)} weight(s) {sender} sends but {receiver} does not know: {extra[:limit]}")
    wrong = [
        f"{n}: sent {have[n].shape} {have[n].dtype}, expected {want[n].shape} {want[n].dtype}"
        for n in want
        if n in have and (have[n].shape != want[n].shape or have[n].dtype != want[n].dtype)
    ]
    if wrong:
        problems.append(f"{len(wrong)} shape/dtype mismatch(es): {wrong[:limit]}")
    if len(have) != len(sent):
        problems.append(f"{sender} sends duplicate names")
    if problems:
        raise RefitError(
            f"refit {sender} -> {receiver} refused before writing anything:\n  - " + "\n  - ".join(problems)
        )


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Group specs, in order, into buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise RefitError(f"bucket size must be positive, got {bucket_bytes} bytes (refit.bucket_mb)")
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for s in specs:
        if current and size + s.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(s)
        size += s.nbytes
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class ChannelSpec:
    """Everything a worker needs to open its end of a refit channel (built on the driver by
    the transport's :meth:`~rlcore.refit.transports.RefitTransport.channel`)."""

    transport: str  # the registered transport's name: collective | cuda_ipc | disk | shared_memory
    key: str  # unique per policy/generation pair
    world_size: int  # 1 sender + N receivers
    addr: str | None = None  # collective, cuda_ipc: rendezvous host (the sender's node)
    port: int | None = None  # collective, cuda_ipc: rendezvous port
    backend: str = "gloo"  # collective: gloo or nccl
    root: str | None = None  # file transports: parent directory of per-step dirs
    timeout_s: float = 300.0
    # collective: receivers post a bucket's broadcast only once the sender announces it
    # packed (None: on NCCL, where an early post spins on the receiver's GPU)
    announce: bool | None = None


def buckets_in_order(
    named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
) -> Iterator[tuple[int, list[Any]]]:
    """Regroup a (name, tensor) stream into the planned buckets, checking each tensor on the way.

    Names, shapes and dtypes must be the plan's: receivers size their buffers from the
    plan alone, so a tensor of another dtype would shift every byte after it (NCCL does
    not notice; gloo aborts the receiving process).
    """
    it = iter(named)
    for i, bucket in enumerate(buckets):
        tensors = []
        for s in bucket:
            try:
                name, t = next(it)
            except StopIteration:
                raise RefitError(f"sender stream ended before '{s.name}' (bucket {i})") from None
            if name != s.name:
                raise RefitError(f"sender stream out of plan: got '{name}', expected '{s.name}' (bucket {i})")
            got = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            if got != (tuple(s.shape), s.dtype):
                raise RefitError(
                    f"sender stream: '{name}' is {got[0]} {got[1]}, the plan says {tuple(s.shape)} {s.dtype} (bucket {i})"
                )
            tensors.append(t)
        yield i, tensors

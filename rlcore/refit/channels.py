"""Refit channels as a worker sees them: its end of whatever transport the channel runs.

These functions run inside backend workers (Ray actors). The sending policy rank is
rank 0 of a channel; generation workers are ranks 1..N. Each call finds the
channel's transport in the registry (:func:`rlcore.refit.transports.get`) by the
spec's ``transport`` and hands over to it; the transports themselves live in
:mod:`rlcore.refit.transports` (one module each).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rlcore.refit import transports
from rlcore.refit.specs import ChannelSpec, TensorSpec
from rlcore.refit.transports.files import step_dir

__all__ = [
    "ChannelSpec", "ceiling", "close_channel", "open_channel", "receive_weights", "remove_step",
    "send_weights", "step_dir",
]


def open_channel(spec: ChannelSpec, rank: int) -> None:
    """Open this process's end of ``spec`` as channel ``rank`` (collective: joins the group;
    all ranks at once)."""
    transports.get(spec.transport).open(spec, rank)


def close_channel(spec: ChannelSpec) -> None:
    """Close this process's end of ``spec``."""
    transports.get(spec.transport).close(spec)


def send_weights(
    spec: ChannelSpec, step: int, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
) -> int:
    """Send a (name, tensor) stream bucket by bucket; returns bytes sent."""
    return transports.get(spec.transport).send(spec, step, named, buckets)


def receive_weights(
    spec: ChannelSpec, rank: int, step: int, buckets: Sequence[Sequence[TensorSpec]], *, device: Any = None
) -> Iterator[tuple[str, Any]]:
    """Yield (name, tensor) as buckets arrive, in plan order (cuda_ipc: views of the
    sender's memory, valid until the generator ends: :func:`rlcore.refit.transports.cuda_ipc.receive_weights`)."""
    yield from transports.get(spec.transport).receive(spec, rank, step, buckets, device)


def remove_step(spec: ChannelSpec, step: int) -> None:
    """Drop what ``step`` left behind once every receiver has loaded it (a file transport's
    step directory)."""
    transports.get(spec.transport).remove_step(spec, step)


def ceiling(spec: ChannelSpec, rank: int, step: int, nbytes: int) -> float:
    """Move ``nbytes`` of raw bytes over ``spec`` with no model in the way; seconds taken.

    The raw ceiling of a transport between the very processes a refit uses: one
    broadcast of a flat buffer (collective), one file written, published and read back
    (disk, shared memory), one device-to-device copy (cuda_ipc). ``bench/refit.py``
    compares refits with it.
    """
    return transports.get(spec.transport).ceiling(spec, rank, step, nbytes)

"""The one interface every refit transport implements: :class:`RefitTransport`.

A transport is one class with both of its ends behind the same small interface:
the driver builds a channel's :class:`~rlcore.refit.specs.ChannelSpec`
(:meth:`RefitTransport.channel`), and every worker of the channel opens its end,
sends (channel rank 0) or receives (ranks 1..N) a step's buckets, and closes its
end. The core looks a transport up by name in the registry
(:mod:`rlcore.refit.transports`) and never branches on the name.

Both sides walk the same bucket plan, so no extra metadata crosses the wire; the
sender checks its stream against the plan with
:func:`rlcore.refit.specs.buckets_in_order`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from rlcore.declarations import Transport

if TYPE_CHECKING:
    from rlcore.context import RefitContext
    from rlcore.handles import RefitSender
    from rlcore.refit.specs import ChannelSpec, TensorSpec


@dataclass(frozen=True)
class ChannelRequest:
    """What a transport needs to describe one channel between a policy and a generation.

    Attributes:
        key: unique name of the channel (one per policy/generation pair and transport).
        world_size: 1 sender + the generation's ``refit_ranks`` receivers.
        policy: the sending handle (asked for a rendezvous address when needed).
        ctx: the refit's context (timeout, cache directory).
    """

    key: str
    world_size: int
    policy: RefitSender
    ctx: RefitContext


class RefitTransport:
    """A transport the core runs: the driver's side (:meth:`channel`) and both worker ends.

    Subclasses set the class attributes and implement :meth:`channel`, :meth:`send`,
    :meth:`receive` and :meth:`ceiling`; :meth:`open`, :meth:`close` and
    :meth:`remove_step` do nothing unless the transport keeps per-channel state or
    per-step files.

    Attributes:
        transport: which declared transport this implements (its name is the
            :attr:`ChannelSpec.transport <rlcore.refit.specs.ChannelSpec.transport>` of
            its channels).
        describe: one line for people (``rlcore plan``).
        accelerator: ``cuda`` if it needs NVIDIA GPUs on both sides, else ``None``.
        colocated_rank, apart_rank: where ``refit.transport: auto`` puts it among the
            transports both sides declare, when policy and generation are colocated and
            when they are not (lower first; ``None``: only when the config asks for it).
        lockstep: the sender waits for every receiver to take every bucket (a receiver
            that fails mid-refit must still drain the stream, or the sender hangs).
        process_group: every receiver joins a torch.distributed group at
            :attr:`ChannelSpec.addr <rlcore.refit.specs.ChannelSpec.addr>`/``port`` and the
            sender broadcasts over it. A backend whose receiving process is not the worker
            (an inference server) has that process join the group through its own API;
            otherwise it reads what the transport left for the step (files).
        device_ipc: the receivers map the sender's own device storages through IPC
            handles (same GPU), so a backend whose two sides hold the same layout may move
            its native tensors in place (``offer_layout``/``agreed_layout`` of
            :mod:`rlcore.refit.transports.cuda_ipc`) instead of the plan's.

    A backend's worker dispatches on these attributes
    (``transports.get(spec.transport).process_group``), never on a transport's name, so a
    transport added to the registry reaches its paths by what it is.
    """

    transport: ClassVar[Transport]
    describe: ClassVar[str]
    accelerator: ClassVar[str | None] = None
    colocated_rank: ClassVar[int | None] = None
    apart_rank: ClassVar[int | None] = None
    lockstep: ClassVar[bool] = False
    process_group: ClassVar[bool] = False
    device_ipc: ClassVar[bool] = False

    def channel(self, req: ChannelRequest) -> ChannelSpec:
        """Driver: the spec both sides of a new channel open."""
        raise NotImplementedError

    def open(self, spec: ChannelSpec, rank: int) -> None:
        """Worker: open this process's end of ``spec`` as channel ``rank`` (all ranks at
        once; idempotent per channel key)."""

    def close(self, spec: ChannelSpec) -> None:
        """Worker: close this process's end of ``spec`` (nothing if it is not open)."""

    def send(
        self, spec: ChannelSpec, step: int, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
    ) -> int:
        """Channel rank 0: send a (name, tensor) stream in plan order; returns bytes sent."""
        raise NotImplementedError

    def receive(
        self, spec: ChannelSpec, rank: int, step: int, buckets: Sequence[Sequence[TensorSpec]], device: Any = None
    ) -> Iterator[tuple[str, Any]]:
        """Channel ranks 1..N: yield (name, tensor) in plan order as the buckets arrive."""
        raise NotImplementedError

    def ceiling(self, spec: ChannelSpec, rank: int, step: int, nbytes: int) -> float:
        """Move ``nbytes`` of raw bytes over ``spec`` with no model in the way; seconds taken
        (``bench/refit.py`` compares refits with it)."""
        raise NotImplementedError

    def remove_step(self, spec: ChannelSpec, step: int) -> None:
        """Driver: drop what ``step`` left behind once every receiver has it (files)."""

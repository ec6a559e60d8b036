"""The refit transports the core implements, and how a channel of each is described.

A backend *declares* the transports it can send or receive over
(:class:`rlcore.declarations.Transport`); this module says which of them the core
can actually run, and builds the :class:`~rlcore.refit.channels.ChannelSpec` both
sides open. The planner chooses only transports listed here (see
:func:`rlcore.setup.planner.choose_transport`), so a plan never names a transport that
setup cannot run.

Adding a transport to the core means: its worker-side ends in
:mod:`rlcore.refit.channels` (or a module it dispatches to) and one
:class:`TransportImpl` registered here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlcore.declarations import Transport
from rlcore.errors import RefitError

if TYPE_CHECKING:
    from rlcore.context import RefitContext
    from rlcore.handles import RefitSender
    from rlcore.refit.channels import ChannelSpec


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


@dataclass(frozen=True)
class TransportImpl:
    """A transport the core runs.

    Attributes:
        transport: which declared transport this implements.
        describe: one line for people (``rlcore plan``).
        accelerator: ``cuda`` if it needs NVIDIA GPUs on both sides, else ``None``.
        channel: builds the channel spec both sides open.
    """

    transport: Transport
    describe: str
    accelerator: str | None
    channel: Callable[[ChannelRequest], ChannelSpec]


def _collective(req: ChannelRequest) -> ChannelSpec:
    from rlcore.refit.channels import ChannelSpec

    addr, port = req.policy.refit_address()
    backend = "nccl" if req.policy.device_type == "cuda" else "gloo"
    return ChannelSpec(
        "collective", req.key, req.world_size, addr=addr, port=port, backend=backend,
        timeout_s=req.ctx.timeout_s,
    )


def _files_under(root: Callable[[ChannelRequest], Path], transport: str) -> Callable[[ChannelRequest], ChannelSpec]:
    def build(req: ChannelRequest) -> ChannelSpec:
        from rlcore.refit.channels import ChannelSpec

        return ChannelSpec(transport, req.key, req.world_size, root=str(root(req)), timeout_s=req.ctx.timeout_s)

    return build


def _shm_dir(_req: ChannelRequest) -> Path:
    from rlcore.refit.channels import shm_root

    return Path(shm_root()) / "rlcore-refit"


_REGISTRY: dict[Transport, TransportImpl] = {}


def register(impl: TransportImpl) -> None:
    """Make ``impl`` a transport the core runs (idempotent per transport)."""
    _REGISTRY[impl.transport] = impl


register(TransportImpl(
    Transport.COLLECTIVE,
    "a private torch.distributed group (NCCL on GPUs, gloo on CPUs), one broadcast per bucket",
    None,
    _collective,
))
register(TransportImpl(
    Transport.DISK,
    "one safetensors file per bucket, published atomically under the cache",
    None,
    _files_under(lambda req: Path(req.ctx.cache_dir) / "refit", "disk"),
))
register(TransportImpl(
    Transport.SHARED_MEMORY,
    "one safetensors file per bucket in /dev/shm, mapped by the receivers",
    None,
    _files_under(_shm_dir, "shared_memory"),
))


def _cuda_ipc(req: ChannelRequest) -> ChannelSpec:
    from rlcore.refit import cuda_ipc

    return cuda_ipc.channel_spec(req)


register(TransportImpl(
    Transport.CUDA_IPC,
    "CUDA IPC handles between processes on the same GPU (device UUIDs checked at open); "
    "the receiver copies straight from the sender's memory",
    "cuda",
    _cuda_ipc,
))


def implemented(accelerator: str | None = None) -> dict[Transport, TransportImpl]:
    """The transports the core runs; with ``accelerator``, only those usable on it."""
    return {
        t: impl
        for t, impl in _REGISTRY.items()
        if accelerator is None or impl.accelerator in (None, accelerator)
    }


def get(transport: str) -> TransportImpl:
    """The implementation of ``transport``; :class:`RefitError` if the core has none."""
    try:
        return _REGISTRY[Transport(transport)]
    except (KeyError, ValueError):
        raise RefitError(
            f"the core has no '{transport}' refit transport; it runs "
            f"{sorted(t.value for t in _REGISTRY)} (a backend pair may move weights its own way "
            "by implementing rlcore_refit)"
        ) from None

"""The refit transports the core runs: one class each, looked up by name.

A backend *declares* the transports it can send or receive over
(:class:`rlcore.declarations.Transport`); this registry says which of them the core
can actually run. The planner chooses only transports registered here (see
:func:`rlcore.setup.planner.choose_transport`), so a plan never names a transport
that setup cannot run; the refit (:mod:`rlcore.refit.sessions`, :mod:`rlcore.refit.sync`)
and the workers' ends (:mod:`rlcore.refit.channels`) reach a transport only through
:func:`get`, never by testing its name.

One module per transport, each one :class:`~rlcore.refit.transports.base.RefitTransport`:

* :mod:`~rlcore.refit.transports.collective`: a private torch.distributed group;
* :mod:`~rlcore.refit.transports.disk` and :mod:`~rlcore.refit.transports.shared_memory`:
  safetensors files per bucket (:mod:`~rlcore.refit.transports.files`);
* :mod:`~rlcore.refit.transports.cuda_ipc`: CUDA IPC handles on one GPU.

Adding a transport to the core: a module here with one ``RefitTransport`` subclass,
registered below with :func:`register`.
"""

from __future__ import annotations

from rlcore.declarations import Transport
from rlcore.errors import RefitError
from rlcore.refit.transports.base import ChannelRequest, RefitTransport
from rlcore.refit.transports.collective import CollectiveTransport
from rlcore.refit.transports.cuda_ipc import CudaIpcTransport
from rlcore.refit.transports.disk import DiskTransport
from rlcore.refit.transports.shared_memory import SharedMemoryTransport

__all__ = ["ChannelRequest", "RefitTransport", "get", "implemented", "preferred", "register"]

_REGISTRY: dict[Transport, RefitTransport] = {}


def register(impl: RefitTransport) -> None:
    """Make ``impl`` a transport the core runs (idempotent per transport)."""
    _REGISTRY[impl.transport] = impl


for _impl in (CollectiveTransport(), DiskTransport(), SharedMemoryTransport(), CudaIpcTransport()):
    register(_impl)


def implemented(accelerator: str | None = None) -> dict[Transport, RefitTransport]:
    """The transports the core runs; with ``accelerator``, only those usable on it."""
    return {
        t: impl
        for t, impl in _REGISTRY.items()
        if accelerator is None or impl.accelerator in (None, accelerator)
    }


def preferred(colocated: bool) -> list[Transport]:
    """The transports ``refit.transport: auto`` tries, best first, for a colocated placement
    or not (each transport's ``colocated_rank`` / ``apart_rank``)."""
    ranked = [
        (rank, t)
        for t, impl in _REGISTRY.items()
        if (rank := impl.colocated_rank if colocated else impl.apart_rank) is not None
    ]
    return [t for _, t in sorted(ranked)]


def get(transport: str) -> RefitTransport:
    """The implementation of ``transport`` (a name, e.g. a channel spec's ``transport``);
    :class:`RefitError` if the core has none."""
    try:
        return _REGISTRY[Transport(transport)]
    except (KeyError, ValueError):
        raise RefitError(
            f"the core has no '{transport}' refit transport; it runs "
            f"{sorted(t.value for t in _REGISTRY)} (a backend pair may move weights its own way "
            "by implementing rlcore_refit)"
        ) from None

"""What init hooks return: handles to started backends.

A handle is the core's grip on a started backend. Every handle can be shut down;
policy and generation handles add what refit and the training loop need. Handles
are plain Python objects living in the driver process; the work they do usually
happens in Ray actors they own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible HTTP endpoint served by a generation backend."""

    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str  # the model name to put in requests
    api_key: str = "EMPTY"


@runtime_checkable
class BackendHandle(Protocol):
    """A started backend. ``shutdown`` must release every process, actor and port
    the backend started, be safe to call twice, and return within the
    ``setup.shutdown_timeout_s`` the core allows."""

    def shutdown(self) -> None: ...


@dataclass
class RefitReport:
    """What one weight sync did. ``weight_sync_time_s`` is wall time of the whole sync."""

    step: int
    transport: str
    bytes: int
    tensors: int
    weight_sync_time_s: float
    #: Time to create the transport's channel (collective group), non-zero only the first time.
    channel_init_time_s: float = 0.0

    @property
    def throughput_gib_s(self) -> float:
        return self.bytes / max(self.weight_sync_time_s, 1e-9) / 2**30


@runtime_checkable
class RefitSender(Protocol):
    """The policy side of the core's refit (all methods are called in the driver).

    The sending rank streams Hugging Face-named tensors in the order of
    ``weight_specs()``; the core groups them into buckets and the worker-side
    helpers of :mod:`rlcore.refit.channels` move them.
    """

    #: ``cuda`` or ``cpu``: where the sending rank's tensors live (picks NCCL or gloo).
    device_type: str

    def weight_specs(self) -> list[Any]:
        """``TensorSpec`` of every weight, full (unsharded) shapes, in send order."""
        ...

    def refit_address(self) -> tuple[str, int]:
        """A host and free port on the sending rank's node for the collective rendezvous."""
        ...

    def open_refit_channel(self, spec: Any) -> list[Any]:
        """Join channel ``spec`` as rank 0; returns Ray object refs to wait on."""
        ...

    def send_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        """Start streaming the current weights over ``spec``; returns Ray object refs."""
        ...


@runtime_checkable
class RefitReceiver(Protocol):
    """The generation side of the core's refit (all methods are called in the driver)."""

    #: Number of generation workers that receive (channel ranks 1..refit_ranks).
    refit_ranks: int

    def weight_specs(self) -> list[Any]:
        """``TensorSpec`` of every weight the engine expects (Hugging Face names)."""
        ...

    def open_refit_channel(self, spec: Any) -> list[Any]:
        """Join channel ``spec`` as ranks 1..refit_ranks; returns Ray object refs."""
        ...

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        """Receive the buckets and load them into the running engine; returns Ray object refs
        that resolve once every worker has loaded every tensor."""
        ...

"""What init hooks return: handles to started backends.

A handle is the core's grip on a started backend. Every handle can be shut down;
policy and generation handles add what refit and the training loop need. Handles
are plain Python objects living in the driver process; the work they do usually
happens in Ray actors they own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


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

    @property
    def throughput_gib_s(self) -> float:
        return self.bytes / max(self.weight_sync_time_s, 1e-9) / 2**30

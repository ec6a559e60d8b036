"""The transport registry: one class per transport behind one interface, reached by name."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pytest

from rlcore.declarations import Transport
from rlcore.refit import channels, transports
from rlcore.refit.specs import ChannelSpec, TensorSpec
from rlcore.refit.transports.base import RefitTransport


def test_every_transport_is_one_class_in_its_own_module() -> None:
    for name, impl in transports.implemented().items():
        assert isinstance(impl, RefitTransport)
        assert impl.transport is name and impl.describe
        assert type(impl).__module__ == f"rlcore.refit.transports.{name.value}"
        assert transports.get(name.value) is impl


def test_auto_prefers_what_the_planner_always_preferred() -> None:
    assert transports.preferred(True) == [
        Transport.CUDA_IPC, Transport.SHARED_MEMORY, Transport.COLLECTIVE, Transport.DISK
    ]
    assert transports.preferred(False) == [Transport.COLLECTIVE, Transport.DISK, Transport.SHARED_MEMORY]


class Recording(RefitTransport):
    """A transport that records what the workers' ends ask of it."""

    transport = Transport.DISK
    describe = "records calls"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def open(self, spec: ChannelSpec, rank: int) -> None:
        self.calls.append(f"open {rank}")

    def close(self, spec: ChannelSpec) -> None:
        self.calls.append("close")

    def send(
        self, spec: ChannelSpec, step: int, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
    ) -> int:
        self.calls.append(f"send {step}")
        return 7

    def receive(
        self, spec: ChannelSpec, rank: int, step: int, buckets: Sequence[Sequence[TensorSpec]], device: Any = None
    ) -> Iterator[tuple[str, Any]]:
        self.calls.append(f"receive {rank} {step}")
        yield "w", 1

    def remove_step(self, spec: ChannelSpec, step: int) -> None:
        self.calls.append(f"remove {step}")


def test_the_workers_ends_reach_a_transport_only_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recording()
    monkeypatch.setitem(transports._REGISTRY, Transport.DISK, rec)
    spec = ChannelSpec("disk", "k", 2)
    channels.open_channel(spec, 1)
    assert channels.send_weights(spec, 3, [], []) == 7
    assert list(channels.receive_weights(spec, 1, 3, [])) == [("w", 1)]
    channels.remove_step(spec, 3)
    channels.close_channel(spec)
    assert rec.calls == ["open 1", "send 3", "receive 1 3", "remove 3", "close"]


def test_an_unknown_transport_names_those_the_core_runs() -> None:
    from rlcore.errors import RefitError

    with pytest.raises(RefitError, match="no 'carrier_pigeon' refit transport.*collective"):
        channels.open_channel(ChannelSpec("carrier_pigeon", "k", 2), 0)

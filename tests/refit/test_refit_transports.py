"""The transport registry: one class per transport behind one interface, reached by name."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
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


def test_every_transport_says_what_a_receiver_dispatches_on() -> None:
    """Backends choose their receiving path by these attributes: exactly the transports
    they named before (SGLang's server joins collective's group, Megatron's native layout
    rides cuda_ipc) must match, or a backend would take another path for one."""
    impls = transports.implemented()
    for impl in impls.values():
        for attr in ("process_group", "device_ipc", "lockstep"):
            assert type(getattr(impl, attr)) is bool, f"{type(impl).__name__}.{attr}"
    assert {t for t, impl in impls.items() if impl.process_group} == {Transport.COLLECTIVE}
    assert {t for t, impl in impls.items() if impl.device_ipc} == {Transport.CUDA_IPC}


ROOT = Path(__file__).resolve().parents[2]


def _transport_name_tests(tree: ast.AST) -> list[int]:
    """Lines comparing a ``.transport`` with a string literal or a ``Transport`` member
    (``spec.transport == "collective"``, ``t.transport in ("disk", "shared_memory")``)."""

    def is_transport(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "transport"

    def is_name(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Transport":
            return True
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_name(e) for e in node.elts)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_transport(n) for n in sides) and any(is_name(n) for n in sides):
                lines.append(node.lineno)
    return lines


def test_the_finder_catches_a_branch_on_a_transport_name() -> None:
    src = 'if spec.transport == "cuda_ipc": pass\nif s.transport in (Transport.DISK,): pass\nx = spec.transport\n'
    assert _transport_name_tests(ast.parse(src)) == [1, 2]


def test_no_backend_or_core_module_branches_on_a_transport_name() -> None:
    """Outside the transports' own modules, code asks the registry what a transport is
    (``transports.get(spec.transport).process_group``), so a new transport needs no edit there."""
    sources = [*ROOT.glob("plugins/*/rlcore_*/**/*.py"), *ROOT.glob("rlcore/**/*.py")]
    assert any(p.match("plugins/sglang/rlcore_sglang/worker.py") for p in sources)
    own = ROOT / "rlcore" / "refit" / "transports"
    found = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in sources
        if own not in p.parents
        for line in _transport_name_tests(ast.parse(p.read_text(), str(p)))
    ]
    assert found == []


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

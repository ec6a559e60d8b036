"""The cuda_ipc refit transport's protocol, on CPU.

CUDA IPC handles cannot be opened by the process that made them, and this
machine has no GPU: the IPC layer alone is a test double (:class:`ThreadIpc`:
sender and receivers are threads of this process sharing CPU tensors, so a
"shared" tensor is the sender's very memory). Everything else is the real
transport: the TCPStore side channel, the messages, the plan checks, staging,
timeouts, aborts and cleanup. The real CUDA IPC layer is exercised on a GPU by
``plugins/megatron/tests/test_megatron_colocated_gpu.py``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from rlcore.declarations import Transport
from rlcore.errors import ConfigError, RefitError
from rlcore.refit import channels
from rlcore.refit.specs import ChannelSpec, plan_buckets, spec_of
from rlcore.refit.transports import cuda_ipc
from rlcore.runtime.addresses import free_port


class ThreadIpc:
    """The IPC layer between threads of one process: handles are ids in a shared registry."""

    def __init__(self, registry: dict[int, Any], uuid: str = "GPU-test-0") -> None:
        self.registry, self.uuid = registry, uuid
        self.shared = 0
        self.opened = 0
        self.collected = 0
        self.recorded = 0  # receiver: completion events recorded
        self.waited = 0  # sender: receivers' events waited for

    def device(self) -> torch.device:
        return torch.device("cpu")

    def device_uuid(self) -> str:
        return self.uuid

    def share(self, flat: torch.Tensor) -> Any:
        self.shared += 1
        handle = len(self.registry)
        self.registry[handle] = weakref.ref(flat)  # the sender keeps what it shares alive
        return handle

    def open(self, handle: Any) -> torch.Tensor:
        self.opened += 1
        flat = self.registry[handle]()
        assert flat is not None, "a handle was opened after the sender freed its memory"
        return flat

    def synchronize(self) -> None:
        pass

    def collect(self) -> None:
        self.collected += 1

    def event(self) -> tuple[Any, Any]:
        return "event", "event-handle"

    def open_event(self, handle: Any) -> Any:
        assert handle == "event-handle"
        return "event"

    def record(self, event: Any) -> None:
        self.recorded += 1

    def wait_event(self, event: Any) -> None:
        self.waited += 1


def _spec(world: int = 2, timeout_s: float = 30.0) -> ChannelSpec:
    return ChannelSpec("cuda_ipc", f"t{free_port()}", world, addr="127.0.0.1", port=free_port(), timeout_s=timeout_s)


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(16, 8, generator=g),
        "w1": torch.randn(8, 8, generator=g),
        "fused": torch.randn(12, 8, generator=g),  # streamed as two views: a[:4], a[4:]
        "norm": torch.randn(8, generator=g),
    }


def _stream(model: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """What an export yields: views of parameters, a computed tensor and a cast."""
    yield "embed", model["embed"]
    yield "w1.t", model["w1"].t()  # a non-contiguous view
    yield "fused.a", model["fused"][:4]
    yield "fused.b", model["fused"][4:]
    yield "w1.double", model["w1"] * 2  # computed: staged
    yield "norm.half", model["norm"].to(torch.bfloat16)  # cast: staged


class Pair:
    """A sender and ``n`` receivers of one channel, each end in its own thread (ends are
    made directly: :func:`cuda_ipc.open_channel` keeps one end per channel per process)."""

    def __init__(
        self, receivers: int = 1, uuids: tuple[str, ...] = (), timeout_s: float = 30.0, layouts: tuple[str, ...] = ()
    ) -> None:
        self.registry: dict[int, Any] = {}
        self.spec = _spec(1 + receivers, timeout_s)
        self.ipcs = [
            ThreadIpc(self.registry, uuids[i] if i < len(uuids) else "GPU-test-0") for i in range(1 + receivers)
        ]
        self.ends: list[Any] = [None] * (1 + receivers)

        def make(r: int) -> None:
            layout = layouts[r] if r < len(layouts) else ""
            end = (
                cuda_ipc.SenderEnd(self.spec, self.ipcs[0], layout) if r == 0
                else cuda_ipc.ReceiverEnd(self.spec, r, self.ipcs[r], layout)
            )
            self.ends[r] = end

        self.open_errors = self.run([lambda r=r: make(r) for r in range(1 + receivers)])

    def run(self, fns: list[Callable[[], Any]], timeout: float = 60.0) -> list[BaseException | None]:
        errors: list[BaseException | None] = [None] * len(fns)
        self.results: list[Any] = [None] * len(fns)

        def call(i: int) -> None:
            try:
                self.results[i] = fns[i]()
            except BaseException as err:
                errors[i] = err

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(fns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
            assert not t.is_alive(), "a channel end hung"
        return errors

    def refit(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        buckets: Any,
        sinks: list[dict[str, torch.Tensor]],
        consume: Callable[[Iterator[tuple[str, torch.Tensor]], dict[str, torch.Tensor]], None] | None = None,
        layout: str = "",
        sent_layout: str = "",
    ) -> list[BaseException | None]:
        def load(rank: int) -> None:
            it = self.ends[rank].receive(buckets, layout)
            if consume is not None:
                consume(it, sinks[rank - 1])
                return
            for name, t in it:
                sinks[rank - 1][name].copy_(t)

        fns: list[Callable[[], Any]] = [lambda: self.ends[0].send(stream, buckets, sent_layout)]
        fns += [lambda r=r: load(r) for r in range(1, self.spec.world_size)]
        return self.run(fns)

    @property
    def sender(self) -> Any:
        return self.ends[0]

    def close(self) -> None:
        for end in reversed(self.ends):
            if end is not None:
                end.close()


@pytest.fixture
def model() -> dict[str, torch.Tensor]:
    return _model()


def _sink(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in _stream(model)}


def _expected(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in _stream(model)}


def test_round_trip_exact_and_handles_opened_once(model: dict[str, torch.Tensor]) -> None:
    """Two receivers get every tensor bit for bit; the parameters are shared in place (a
    view of the sender's memory, no copy), computed tensors staged; the second refit
    shares nothing new, and the receivers see the sender's in-place update. The sender returns
    only after each receiver's completion event; the receivers clear the last message's keys."""
    pair = Pair(receivers=2)
    try:
        assert pair.open_errors == [None, None, None]
        pair.sender.register(model.values())
        specs = [spec_of(n, t) for n, t in _stream(model)]
        buckets = plan_buckets(specs, 300)
        assert len(buckets) > 1
        seen: dict[str, int] = {}
        views: dict[int, list[int]] = {}  # per receiver (its sink), the yielded objects

        def consume(it: Iterator[tuple[str, torch.Tensor]], sink: dict[str, torch.Tensor]) -> None:
            for name, t in it:
                seen[name] = t.data_ptr()
                views.setdefault(id(sink), []).append(id(t))
                sink[name].copy_(t)

        sinks = [_sink(model), _sink(model)]
        assert pair.refit(_stream(model), buckets, sinks, consume) == [None, None, None]
        for sink in sinks:
            for name, t in _expected(model).items():
                assert torch.equal(sink[name], t), name
        # parameters: the receiver read the sender's memory itself
        assert seen["embed"] == model["embed"].data_ptr()
        assert seen["fused.b"] == model["fused"][4:].data_ptr()
        assert seen["w1.double"] not in {t.data_ptr() for t in model.values()}
        shared_once = pair.ipcs[0].shared
        assert shared_once == 4  # embed, w1, fused (norm is only cast) + the staging buffer
        assert pair.ipcs[1].opened == pair.ipcs[2].opened == shared_once

        with torch.no_grad():  # an optimizer step: in place
            for t in model.values():
                t.add_(1.0)
        assert pair.refit(_stream(model), buckets, sinks, consume) == [None, None, None]
        for sink in sinks:
            for name, t in _expected(model).items():
                assert torch.equal(sink[name], t), name
        assert pair.ipcs[0].shared == shared_once
        # the second message repeats the first: each receiver yields the views it built then
        n = len(specs)
        assert all(len(v) == 2 * n and v[:n] == v[n:] for v in views.values()) and len(views) == 2
        assert pair.results[0] == sum(s.nbytes for s in specs)
        # each receiver marked its copies with its event, the sender waited for both, each time
        assert pair.ipcs[1].recorded == pair.ipcs[2].recorded == 2 and pair.ipcs[0].waited == 4
        # the first message's keys went at the second (by the receivers); the second's stay until the next
        store = pair.sender.store
        assert not any(store.check([k]) for k in ("m/0", "a/0/1", "a/0/2")) and store.check(["m/1"])
    finally:
        pair.close()


def test_staging_grows_and_releases_the_old_buffer(model: dict[str, torch.Tensor]) -> None:
    """A refit that stages more than the last shares a larger buffer, carries the old slots
    over and tells the receiver to drop the old one; nothing stays registered."""
    pair = Pair()
    try:
        pair.sender.register([model["embed"], model["fused"]])  # w1 is not persistent
        specs = [spec_of(n, t) for n, t in _stream(model)]
        buckets = plan_buckets(specs, 1 << 20)
        sink = _sink(model)
        assert pair.refit(_stream(model), buckets, [sink]) == [None, None]
        sender = pair.sender
        first = weakref.ref(sender.staging[1])
        size = sender.staging[1].numel()

        def more(m: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in _stream(m):  # now "embed" arrives as a copy: staged
                yield name, (t.clone() if name == "embed" else t)

        assert pair.refit(more(model), buckets, [sink]) == [None, None]
        for name, t in _expected(model).items():
            assert torch.equal(sink[name], t), name
        assert sender.staging[1].numel() > size
        assert first() is None  # the old staging buffer is gone on both sides
        assert pair.ipcs[0].collected >= 1
    finally:
        pair.close()
    assert not sender.shared and sender.staging is None


def test_other_gpu_refused_on_both_sides() -> None:
    """A receiver on another physical device (another UUID) refuses; the sender fails too,
    and both messages name the UUIDs and the fix."""
    pair = Pair(uuids=("GPU-aaaa", "GPU-bbbb"))
    try:
        sender_err, receiver_err = pair.open_errors
        assert isinstance(receiver_err, RefitError) and isinstance(sender_err, RefitError)
        for err in (sender_err, receiver_err):
            assert "GPU-aaaa" in str(err) and "GPU-bbbb" in str(err)
            assert "refit.transport: collective" in str(err)
    finally:
        pair.close()


@pytest.mark.parametrize(
    ("layouts", "agreed", "why"),
    [
        (("A", "A", "A"), "A", ""),
        (("A", "A", "B"), "", "receiver rank 2 holds another layout"),
        (("A", "", "A"), "", "receiver rank 1 offered no native layout"),
        (("", "A", "A"), "", "the sender offered no native layout"),
    ],
)
def test_native_layout_agreed_at_open_only_when_every_end_offers_it(
    model: dict[str, torch.Tensor], layouts: tuple[str, ...], agreed: str, why: str
) -> None:
    """Every end learns at open which native layout the channel agreed on (the sender's, when
    each receiver offered the same) or none, with the reason; a stream under a layout the
    channel did not agree on, or a message under another layout than the receiver expects,
    is refused before any byte is written; the plan's tensors always pass."""
    pair = Pair(receivers=2, layouts=layouts)
    try:
        assert pair.open_errors == [None, None, None]
        assert [e.agreed for e in pair.ends] == [agreed] * 3
        assert pair.sender.why_not_native.startswith(why)
        buckets = plan_buckets([spec_of(n, t) for n, t in _stream(model)], 1 << 20)
        sinks = [_sink(model), _sink(model)]
        if not agreed:
            with pytest.raises(RefitError, match="agreed on none at open"):
                pair.sender.send(_stream(model), buckets, layouts[0] or "A")
            assert pair.refit(_stream(model), buckets, sinks) == [None, None, None]
        else:
            errors = pair.refit(_stream(model), buckets, sinks, layout=agreed)  # the plan's, expected the layout
            assert isinstance(errors[0], RefitError) and "receiving side" in str(errors[0])
            assert all(isinstance(e, RefitError) and "nothing was written" in str(e) for e in errors[1:])
            assert all(not t.any() for sink in sinks for t in sink.values())
            assert pair.refit(_stream(model), buckets, sinks, layout=agreed, sent_layout=agreed) == [None] * 3
            expected = _expected(model)
            assert all(torch.equal(sink[n], expected[n]) for sink in sinks for n in expected)
    finally:
        pair.close()


def test_sender_failure_mid_stream_writes_nothing(model: dict[str, torch.Tensor]) -> None:
    """The sender's stream breaks half-way (an error, then a tensor off the plan): the
    receiver raises before yielding a single tensor, its weights stay as they were, and
    the channel stays usable for the next refit."""
    pair = Pair()
    try:
        pair.sender.register(model.values())
        buckets = plan_buckets([spec_of(n, t) for n, t in _stream(model)], 200)
        sink = _sink(model)
        before = {n: t.clone() for n, t in sink.items()}
        pulled = []

        def consume(it: Iterator[tuple[str, torch.Tensor]], s: dict[str, torch.Tensor]) -> None:
            for name, t in it:
                pulled.append(name)
                s[name].copy_(t)

        def broken() -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(_stream(model)):
                if i == 3:
                    raise ValueError("export failed")
                yield item

        def off_plan() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in _stream(model):
                yield name, (t[:1] if name == "w1.double" else t)

        for stream, words in ((broken(), "export failed"), (off_plan(), "the plan says")):
            errors = pair.refit(stream, buckets, [sink], consume)
            assert words in str(errors[0])
            assert isinstance(errors[1], RefitError) and "before any byte was written" in str(errors[1])
            assert words in str(errors[1])
            assert pulled == []
            assert all(torch.equal(sink[n], before[n]) for n in sink)
        assert pair.refit(_stream(model), buckets, [sink]) == [None, None]
        assert all(torch.equal(sink[n], t) for n, t in _expected(model).items())
    finally:
        pair.close()


def test_receiver_failure_reaches_the_sender(model: dict[str, torch.Tensor]) -> None:
    """A receiver whose load fails (and closes the stream) answers at once: the sender's
    refit fails naming the rank instead of waiting out the channel's timeout (600 s here;
    the threads must end within 60), and the next refit works."""
    pair = Pair(timeout_s=600.0)
    try:
        buckets = plan_buckets([spec_of(n, t) for n, t in _stream(model)], 1 << 20)

        def consume(it: Iterator[tuple[str, torch.Tensor]], s: dict[str, torch.Tensor]) -> None:
            with contextlib.closing(it):  # a consumer that fails closes (or drains) the stream
                for name, _ in it:
                    if name == "fused.a":
                        raise KeyError("no such parameter in the engine")

        errors = pair.refit(_stream(model), buckets, [_sink(model)], consume)
        assert isinstance(errors[0], RefitError) and "rank 1: the receiver stopped reading" in str(errors[0])
        assert isinstance(errors[1], KeyError)
        sink = _sink(model)
        assert pair.refit(_stream(model), buckets, [sink]) == [None, None]
        assert all(torch.equal(sink[n], t) for n, t in _expected(model).items())
    finally:
        pair.close()


def test_bounded_wait_then_broken(model: dict[str, torch.Tensor]) -> None:
    """A receiver whose sender never sends gives up after the channel's timeout, and the
    channel then refuses further use with a message saying to reopen it."""
    pair = Pair(timeout_s=1.5)
    try:
        buckets = plan_buckets([spec_of(n, t) for n, t in _stream(model)], 1 << 20)
        errors = pair.run([lambda: list(pair.ends[1].receive(buckets))], timeout=30)
        assert isinstance(errors[0], RefitError) and "waited 2s" in str(errors[0]) and "refit.timeout_s" in str(errors[0])
        errors = pair.run([lambda: list(pair.ends[1].receive(buckets))], timeout=30)
        assert isinstance(errors[0], RefitError) and "is broken" in str(errors[0])
    finally:
        pair.close()


def test_close_stops_a_waiting_receiver(model: dict[str, torch.Tensor]) -> None:
    """Closing the channel (teardown, cancellation) ends a receiver's wait long before the
    timeout, and leaves nothing registered."""
    pair = Pair(timeout_s=600.0)
    buckets = plan_buckets([spec_of(n, t) for n, t in _stream(model)], 1 << 20)
    receiver = pair.ends[1]
    box: list[BaseException] = []

    def wait() -> None:
        try:
            list(receiver.receive(buckets))
        except BaseException as err:
            box.append(err)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    receiver.close()
    t.join(30)
    pair.close()
    assert not t.is_alive()
    assert isinstance(box[0], RefitError) and "closed" in str(box[0])
    assert not receiver.opened


def test_channels_dispatch(monkeypatch: pytest.MonkeyPatch, model: dict[str, torch.Tensor]) -> None:
    """channels.open_channel/send_weights/close_channel reach this process's cuda_ipc end
    (here the sender; the receiver is an end made directly in a thread); close leaves no
    end, no registered storage and no staging buffer."""
    registry: dict[int, Any] = {}
    monkeypatch.setattr(cuda_ipc, "default_ipc", lambda: ThreadIpc(registry))
    spec = _spec()
    pair = Pair.__new__(Pair)
    pair.spec = spec
    box: list[Any] = []
    errors = pair.run([
        lambda: channels.open_channel(spec, 0),
        lambda: box.append(cuda_ipc.ReceiverEnd(spec, 1, ThreadIpc(registry))),
    ])
    assert errors == [None, None]
    receiver = box[0]
    cuda_ipc.register_persistent(spec, model.values())
    sender = cuda_ipc._ends[spec.key]
    assert isinstance(sender, cuda_ipc.SenderEnd) and len(sender.persistent) == len(model)
    buckets = plan_buckets([spec_of(n, t) for n, t in _stream(model)], 1 << 20)
    sink = _sink(model)

    def load() -> None:
        for name, t in receiver.receive(buckets):
            sink[name].copy_(t)

    errors = pair.run([lambda: channels.send_weights(spec, 0, _stream(model), buckets), load])
    assert errors == [None, None]
    assert all(torch.equal(sink[n], t) for n, t in _expected(model).items())
    assert pair.results[0] == sum(s.nbytes for b in buckets for s in b)
    staging = weakref.ref(sender.staging[1])
    receiver.close()
    channels.close_channel(spec)
    assert spec.key not in cuda_ipc._ends
    assert not sender.shared and not sender.persistent and staging() is None
    assert not receiver.opened


def test_copy_views_merges_runs_adjacent_on_both_sides() -> None:
    """Destinations and sources that lie back to back in one buffer each, in the same order,
    are written with one copy; a break in either side's order starts a new copy; the
    bytes always end up where ``copy_`` per pair would put them."""
    shapes = [(4, 3), (5,), (2, 2), (7,)]
    src_buf = torch.arange(sum(math.prod(s) for s in shapes), dtype=torch.float32)
    dst_buf = torch.zeros_like(src_buf)

    def views(buf: torch.Tensor) -> list[torch.Tensor]:
        out, off = [], 0
        for shape in shapes:
            n = math.prod(shape)
            out.append(buf[off : off + n].view(shape))
            off += n
        return out

    srcs, dsts = views(src_buf), views(dst_buf)
    assert cuda_ipc.copy_views(dsts, srcs) == 1
    assert torch.equal(dst_buf, src_buf)
    src_buf.add_(1)  # the next refit: the same views, the plan found before
    assert cuda_ipc.copy_views(dsts, srcs) == 1
    assert torch.equal(dst_buf, src_buf)
    moved = torch.zeros_like(dsts[1])
    dsts[1].data = moved  # the same object, other memory: the plan is made again
    assert cuda_ipc.copy_views(dsts, srcs) == 3
    assert torch.equal(moved, srcs[1])
    dst_buf.zero_()
    swapped = [srcs[0], srcs[2], srcs[1], srcs[3]]  # sources out of the destinations' order
    dsts2 = [dsts[0], torch.zeros(2, 2), torch.zeros(5), dsts[3]]
    assert cuda_ipc.copy_views(dsts2, [srcs[0], srcs[2], srcs[1], srcs[3]]) == 4
    assert all(torch.equal(d, s) for d, s in zip(dsts2, swapped, strict=True))
    separate = [torch.zeros(s) for s in shapes]  # one allocation each: nothing to merge
    assert cuda_ipc.copy_views(separate, srcs) == len(shapes)
    assert all(torch.equal(d, s) for d, s in zip(separate, srcs, strict=True))


@pytest.mark.parametrize(
    ("accelerator", "colocated", "expected"),
    [("cuda", True, "cuda_ipc"), ("cpu", True, "shared_memory"), ("cuda", False, "collective")],
)
def test_planner_prefers_cuda_ipc_colocated_on_cuda(accelerator: str, colocated: bool, expected: str) -> None:
    """The core runs cuda_ipc (it is in the transport registry, for CUDA hosts): colocated on
    CUDA with both sides declaring it, the planner picks it; on CPU or not colocated, not."""
    from rlcore.config import load_config
    from rlcore.declarations import BackendDeclaration, Role
    from rlcore.refit import transports
    from rlcore.setup.planner import choose_transport

    assert transports.implemented("cuda")[Transport.CUDA_IPC].channel is not None
    assert Transport.CUDA_IPC not in transports.implemented("cpu")
    every = {"cuda_ipc", "shared_memory", "collective", "disk"}
    pol = BackendDeclaration(name="p", roles={Role.POLICY}, send_transports=every)
    gen = BackendDeclaration(name="g", roles={Role.GENERATION}, receive_transports=every)
    cfg = load_config(None, ["policy.backend=p", "generation.backend=g", f"placement.colocated={str(colocated).lower()}"])
    assert choose_transport(cfg, pol, gen, accelerator=accelerator) == expected
    if accelerator == "cpu":
        asked = load_config(None, ["policy.backend=p", "generation.backend=g", "refit.transport=cuda_ipc"])
        with pytest.raises(ConfigError, match="it needs cuda and this host has cpu"):
            choose_transport(asked, pol, gen, accelerator="cpu")


def test_the_registry_builds_the_channel_through_cuda_ipc() -> None:
    """The driver's side as the run's sessions use it: the registry's cuda_ipc entry builds
    the spec from the sender's refit address and the refit's timeout."""
    from rlcore.refit import transports

    class Policy:
        device_type = "cuda"

        def refit_address(self) -> tuple[str, int]:
            return "10.0.0.8", 29600

    class Ctx:
        timeout_s = 7.0

    req = transports.ChannelRequest("key1", 2, Policy(), Ctx())  # type: ignore[arg-type]
    spec = transports.get("cuda_ipc").channel(req)
    assert (spec.transport, spec.addr, spec.port, spec.world_size, spec.timeout_s) == ("cuda_ipc", "10.0.0.8", 29600, 2, 7.0)

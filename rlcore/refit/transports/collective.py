"""The ``collective`` refit transport: a private torch.distributed process group.

The group (gloo on CPU, NCCL on GPU) is built from its own TCPStore, so it never
disturbs the default group of either side's worker group. The sending policy rank is
rank 0 of a channel; generation workers are ranks 1..N. One broadcast per bucket;
every operation carries the channel's timeout. Both ends pipeline: the sender keeps
packing (and its stream producing, e.g. tensor-parallel gathers) while earlier
buckets are on the wire, up to :data:`IN_FLIGHT_BYTES`; a receiver posts the
broadcast of bucket ``k + 1`` before it hands out bucket ``k``'s tensors, so the
consumer's copies overlap the transfer.

Over NCCL a receiver posts bucket ``k``'s broadcast only once the sender says (over
a small gloo group beside the NCCL one) that bucket ``k`` is packed on its GPU. An
NCCL kernel posted earlier would spin on the receiver's GPU until the sender's
export caught up; when that GPU also runs another process (a colocated policy rank
exporting its shards), the two processes' spinning kernels hold the GPU in turns of
one time slice each, and a refit took several times its work
(``bench/megatron_gpu.py``).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rlcore.declarations import Transport
from rlcore.errors import RefitError
from rlcore.refit.specs import ChannelSpec, TensorSpec, buckets_in_order
from rlcore.refit.transports.base import ChannelRequest, RefitTransport

log = logging.getLogger(__name__)

#: The sender's packed buckets not yet known to be sent (at least one bucket): the
#: export runs this far ahead of the slowest receiver.
IN_FLIGHT_BYTES = 1 << 30


class _Collective:
    def __init__(self, spec: ChannelSpec, rank: int) -> None:
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        assert spec.addr is not None and spec.port is not None
        from rlcore.runtime.rendezvous import tcp_store  # loopback-only on a single host

        store = tcp_store(spec.addr, spec.port, spec.world_size, rank == 0, spec.timeout_s)
        prefixed = dist.PrefixStore(f"rlcore-refit-{spec.key}", store)
        if spec.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
        self.ready: Any = None
        announce = spec.backend == "nccl" if spec.announce is None else spec.announce
        if announce:
            # "bucket k is packed": receivers post their broadcast of bucket k only then.
            ready = dist.PrefixStore(f"rlcore-refit-ready-{spec.key}", store)
            self.ready = dist.ProcessGroupGloo(ready, rank, spec.world_size, timeout)
        self.store = store  # keep the store alive as long as the group
        self.timeout = timeout
        self.rank = rank

    def broadcast(self, buf: Any) -> Any:
        """Start broadcasting ``buf`` from rank 0; returns the work (``wait()`` before
        touching ``buf`` again: on CUDA it orders the current stream after the transfer,
        on gloo it blocks until done)."""
        return self.pg.broadcast(buf, 0, self.timeout)

    def wait_ready(self) -> None:
        """Receivers: block until the sender announces its next bucket (NCCL channels)."""
        if self.ready is not None:
            import torch

            self.ready.broadcast(torch.empty(1), 0, self.timeout).wait()

    def close(self) -> None:
        for pg in (self.pg, self.ready):
            if pg is not None:
                try:
                    pg.shutdown()
                except Exception as err:  # closing must not raise
                    log.debug("refit channel: process group shutdown failed: %s", err)
        self.pg = self.ready = None
        self.store = None


class _Announcer:
    """The sender's side of :meth:`_Collective.wait_ready`: a thread that waits for each
    bucket's CUDA event (packing done; True on CPU, where packing is synchronous) and
    then announces it, in order, so the sending thread never waits for the GPU."""

    def __init__(self, ch: _Collective) -> None:
        self.ch = ch
        self.events: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rlcore-refit-ready", daemon=True)
        self.thread.start()

    def announce(self, event: Any) -> None:
        self.events.put(event)

    def _run(self) -> None:
        import torch

        flag = torch.ones(1)
        while (event := self.events.get()) is not None:
            if self.error is None:
                try:
                    if event is not True:
                        event.synchronize()
                    self.ch.ready.broadcast(flag, 0, self.ch.timeout).wait()
                except BaseException as err:  # reported by close()
                    self.error = err

    def close(self) -> None:
        self.events.put(None)
        self.thread.join()
        if self.error is not None:
            raise RefitError(f"refit channel: announcing a bucket failed: {self.error}") from self.error


_open: dict[str, _Collective] = {}


def _pack(tensors: Sequence[Any], out: Any) -> Any:
    """The tensors' bytes, back to back, into the flat uint8 ``out`` (exactly their size)."""
    import torch

    flat = [t.detach().to(out.device).contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(flat, out=out)


def _unpack(buf: Any, bucket: Sequence[TensorSpec]) -> list[Any]:
    import torch

    out, off = [], 0
    for s in bucket:
        n = s.nbytes
        dtype = getattr(torch, s.dtype)
        raw = buf[off : off + n]
        if off % dtype.itemsize:  # unaligned for this dtype (after an odd-sized tensor): copy
            raw = raw.clone()
        out.append(raw.view(dtype).reshape(s.shape))
        off += n
    return out



def _send_collective(
    ch: _Collective, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
) -> int:
    """Pack and broadcast bucket by bucket, up to :data:`IN_FLIGHT_BYTES` ahead; bytes sent.

    Each bucket is packed into its own buffer and its broadcast started without
    waiting; the oldest broadcast is waited for (``wait()``: on CUDA a stream
    dependency, not a host wait) only when the packed-but-unsent bytes would pass
    the budget. Over NCCL each bucket is announced to the receivers once packed
    (:class:`_Announcer`).
    """
    from collections import deque

    import torch

    sizes = [sum(s.nbytes for s in bucket) for bucket in buckets]
    in_flight: deque[tuple[Any, Any, int]] = deque()
    announcer = _Announcer(ch) if ch.ready is not None else None
    sent = 0
    try:
        for i, tensors in buckets_in_order(named, buckets):
            while in_flight and sum(n for *_, n in in_flight) + sizes[i] > IN_FLIGHT_BYTES:
                in_flight.popleft()[1].wait()
            buf = _pack(tensors, torch.empty(sizes[i], dtype=torch.uint8, device=ch.device))
            if announcer is not None:
                packed: Any = True  # on CPU the pack is done when _pack returns
                if ch.device.type == "cuda":
                    packed = torch.cuda.Event()
                    packed.record()
                announcer.announce(packed)
            in_flight.append((buf, ch.broadcast(buf), sizes[i]))
            sent += sizes[i]
    finally:
        try:
            if announcer is not None:
                announcer.close()
        finally:
            for _, work, _ in in_flight:
                work.wait()
    return sent



def _channel(spec: ChannelSpec, who: str) -> _Collective:
    ch = _open.get(spec.key)
    if ch is None:
        raise RefitError(f"refit channel {spec.key} is not open on {who}")
    return ch


class CollectiveTransport(RefitTransport):
    """A private torch.distributed group (see the module doc)."""

    transport = Transport.COLLECTIVE
    describe = "a private torch.distributed group (NCCL on GPUs, gloo on CPUs), one broadcast per bucket"
    colocated_rank, apart_rank = 2, 0
    lockstep = True  # every broadcast waits for every receiver
    process_group = True

    def channel(self, req: ChannelRequest) -> ChannelSpec:
        addr, port = req.policy.refit_address()
        backend = "nccl" if req.policy.device_type == "cuda" else "gloo"
        return ChannelSpec(
            "collective", req.key, req.world_size, addr=addr, port=port, backend=backend,
            timeout_s=req.ctx.timeout_s,
        )

    def open(self, spec: ChannelSpec, rank: int) -> None:
        """Join the group (all ranks at once)."""
        if spec.key not in _open:
            _open[spec.key] = _Collective(spec, rank)

    def close(self, spec: ChannelSpec) -> None:
        ch = _open.pop(spec.key, None)
        if ch is not None:
            ch.close()

    def send(
        self, spec: ChannelSpec, step: int, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
    ) -> int:
        return _send_collective(_channel(spec, "the sender"), named, buckets)

    def receive(
        self, spec: ChannelSpec, rank: int, step: int, buckets: Sequence[Sequence[TensorSpec]], device: Any = None
    ) -> Iterator[tuple[str, Any]]:
        """Buckets in fresh buffers, one broadcast posted ahead of the one handed out."""
        import torch

        ch = _channel(spec, f"receiver rank {rank}")

        def post(bucket: Sequence[TensorSpec]) -> tuple[Any, Any]:
            buf = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8, device=ch.device)
            ch.wait_ready()
            return buf, ch.broadcast(buf)

        # One bucket ahead: bucket k + 1 is in flight while the consumer copies bucket k.
        # Buffers are fresh per bucket, so the yielded tensors stay valid after the step.
        ahead = post(buckets[0]) if buckets else None
        for i, bucket in enumerate(buckets):
            assert ahead is not None
            buf, work = ahead
            ahead = post(buckets[i + 1]) if i + 1 < len(buckets) else None
            work.wait()
            yield from zip((s.name for s in bucket), _unpack(buf, bucket), strict=True)

    def ceiling(self, spec: ChannelSpec, rank: int, step: int, nbytes: int) -> float:
        """One broadcast of a flat buffer."""
        import time

        import torch

        t0 = time.monotonic()
        ch = _channel(spec, f"rank {rank}")
        buf = (torch.ones if rank == 0 else torch.empty)(nbytes, dtype=torch.uint8, device=ch.device)
        ch.broadcast(buf).wait()
        if ch.device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic() - t0

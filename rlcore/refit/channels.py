"""Refit channels: the worker-side ends of the transports.

These functions run inside backend workers (Ray actors). The sending policy
rank is rank 0 of a channel; generation workers are ranks 1..N. Both sides
walk the same bucket plan, so no extra metadata crosses the wire.

* ``collective``: a private torch.distributed process group (gloo on CPU, NCCL
  on GPU) built from its own TCPStore, so it never disturbs the default group
  of either side's worker group. One broadcast per bucket; every operation
  carries the channel's timeout. Both ends pipeline: the sender keeps packing
  (and its stream producing, e.g. tensor-parallel gathers) while earlier
  buckets are on the wire, up to :data:`IN_FLIGHT_BYTES`; a receiver posts the
  broadcast of bucket ``k + 1`` before it hands out bucket ``k``'s tensors, so
  the consumer's copies overlap the transfer.

  Over NCCL a receiver posts bucket ``k``'s broadcast only once the sender
  says (over a small gloo group beside the NCCL one) that bucket ``k`` is
  packed on its GPU. An NCCL kernel posted earlier would spin on the receiver's
  GPU until the sender's export caught up; when that GPU also runs another
  process (a colocated policy rank exporting its shards), the two processes'
  spinning kernels hold the GPU in turns of one time slice each, and a refit
  took several times its work (``bench/megatron_gpu.py``).
* ``disk`` / ``shared_memory``: one safetensors file per bucket, published
  atomically as one directory per step (under the cache for disk, under
  /dev/shm for shared memory, where receivers map the files).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import shutil
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.errors import PublishError, RefitError
from rlcore.refit.specs import TensorSpec

log = logging.getLogger(__name__)

#: The sender's packed buckets not yet known to be sent (at least one bucket): the
#: export runs this far ahead of the slowest receiver.
IN_FLIGHT_BYTES = 1 << 30


@dataclass(frozen=True)
class ChannelSpec:
    """Everything a worker needs to open its end of a refit channel."""

    transport: str  # collective | cuda_ipc | disk | shared_memory
    key: str  # unique per policy/generation pair
    world_size: int  # 1 sender + N receivers
    addr: str | None = None  # collective, cuda_ipc: rendezvous host (the sender's node)
    port: int | None = None  # collective, cuda_ipc: rendezvous port
    backend: str = "gloo"  # collective: gloo or nccl
    root: str | None = None  # file transports: parent directory of per-step dirs
    timeout_s: float = 300.0
    # collective: receivers post a bucket's broadcast only once the sender announces it
    # packed (None: on NCCL, where an early post spins on the receiver's GPU)
    announce: bool | None = None


class _Collective:
    def __init__(self, spec: ChannelSpec, rank: int) -> None:
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        assert spec.addr is not None and spec.port is not None
        from rlcore.runtime.workers import tcp_store  # loopback-only on a single host

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


def open_channel(spec: ChannelSpec, rank: int) -> None:
    """Open this process's end of ``spec`` (collective: joins the group; all ranks at once)."""
    if spec.transport == "cuda_ipc":
        from rlcore.refit import cuda_ipc

        cuda_ipc.open_channel(spec, rank)
    if spec.transport == "collective" and spec.key not in _open:
        _open[spec.key] = _Collective(spec, rank)


def close_channel(spec: ChannelSpec) -> None:
    if spec.transport == "cuda_ipc":
        from rlcore.refit import cuda_ipc

        cuda_ipc.close_channel(spec)
    ch = _open.pop(spec.key, None)
    if ch is not None:
        ch.close()


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


def step_dir(spec: ChannelSpec, step: int) -> Path:
    """Where a file transport (disk, shared memory) publishes the buckets of ``step``:
    one directory per step, published atomically (a receiver that loads a whole
    directory, e.g. a server's load-from-disk API, waits for it with
    :func:`rlcore.publish.wait_for_artifact`)."""
    assert spec.root is not None
    return Path(spec.root) / spec.key / f"step-{step:06d}"


def _buckets_in_order(
    named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
) -> Iterator[tuple[int, list[Any]]]:
    """Regroup a (name, tensor) stream into the planned buckets, checking each tensor on the way.

    Names, shapes and dtypes must be the plan's: receivers size their buffers from the
    plan alone, so a tensor of another dtype would shift every byte after it (NCCL does
    not notice; gloo aborts the receiving process).
    """
    it = iter(named)
    for i, bucket in enumerate(buckets):
        tensors = []
        for s in bucket:
            try:
                name, t = next(it)
            except StopIteration:
                raise RefitError(f"sender stream ended before '{s.name}' (bucket {i})") from None
            if name != s.name:
                raise RefitError(f"sender stream out of plan: got '{name}', expected '{s.name}' (bucket {i})")
            got = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            if got != (tuple(s.shape), s.dtype):
                raise RefitError(
                    f"sender stream: '{name}' is {got[0]} {got[1]}, the plan says {tuple(s.shape)} {s.dtype} (bucket {i})"
                )
            tensors.append(t)
        yield i, tensors


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
        for i, tensors in _buckets_in_order(named, buckets):
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


def send_weights(
    spec: ChannelSpec, step: int, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
) -> int:
    """Send a (name, tensor) stream bucket by bucket; returns bytes sent."""
    sent = 0
    if spec.transport == "cuda_ipc":
        from rlcore.refit import cuda_ipc

        return cuda_ipc.send_weights(spec, named, buckets)
    if spec.transport == "collective":
        ch = _open.get(spec.key)
        if ch is None:
            raise RefitError(f"refit channel {spec.key} is not open on the sender")
        return _send_collective(ch, named, buckets)
    from safetensors.torch import save_file

    from rlcore.publish import publish_dir

    def write(staging: Path) -> None:
        nonlocal sent
        for i, tensors in _buckets_in_order(named, buckets):
            payload = {s.name: t.detach().contiguous().cpu() for s, t in zip(buckets[i], tensors, strict=True)}
            save_file(payload, str(staging / f"bucket-{i:05d}.safetensors"))
            sent += sum(t.numel() * t.element_size() for t in payload.values())

    try:
        publish_dir(step_dir(spec, step), write)
    except PublishError as err:
        if isinstance(err.__cause__, RefitError):  # the stream's fault, not the disk's
            raise err.__cause__ from None
        raise
    return sent


def receive_weights(
    spec: ChannelSpec, rank: int, step: int, buckets: Sequence[Sequence[TensorSpec]], *, device: Any = None
) -> Iterator[tuple[str, Any]]:
    """Yield (name, tensor) as buckets arrive, in plan order (cuda_ipc: views of the
    sender's memory, valid until the generator ends: :func:`rlcore.refit.cuda_ipc.receive_weights`)."""
    if spec.transport == "cuda_ipc":
        from rlcore.refit import cuda_ipc

        yield from cuda_ipc.receive_weights(spec, buckets)
        return
    if spec.transport == "collective":
        import torch

        ch = _open.get(spec.key)
        if ch is None:
            raise RefitError(f"refit channel {spec.key} is not open on receiver rank {rank}")

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
        return
    from safetensors import safe_open

    from rlcore.errors import Deadline
    from rlcore.publish import wait_for_artifact

    directory = wait_for_artifact(step_dir(spec, step), deadline=Deadline(spec.timeout_s, "refit files"))
    for i, bucket in enumerate(buckets):
        with safe_open(str(directory / f"bucket-{i:05d}.safetensors"), framework="pt", device=str(device or "cpu")) as f:
            for s in bucket:
                yield s.name, f.get_tensor(s.name)


def remove_step(spec: ChannelSpec, step: int) -> None:
    """Delete a file transport's step directory once every receiver has loaded it."""
    if spec.transport != "collective" and spec.root:
        shutil.rmtree(step_dir(spec, step), ignore_errors=True)
        with contextlib.suppress(OSError):  # the channel's directory, once empty
            os.rmdir(step_dir(spec, step).parent)


def shm_root() -> str:
    """Where the shared-memory transport puts its files (tmpfs)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else str(Path(os.environ.get("TMPDIR", "/tmp")))


def ceiling(spec: ChannelSpec, rank: int, step: int, nbytes: int) -> float:
    """Move ``nbytes`` of raw bytes over ``spec`` with no model in the way; seconds taken.

    The raw ceiling of a transport between the very processes a refit uses:
    one broadcast of a flat buffer (collective), or one file written, published
    and read back (disk, shared memory). ``bench/refit.py`` compares refits with it.
    """
    import time

    import torch

    if spec.transport == "cuda_ipc":  # one device-to-device copy through shared memory
        from rlcore.refit import cuda_ipc

        return cuda_ipc.ceiling(spec, rank, nbytes)
    t0 = time.monotonic()
    if spec.transport == "collective":
        ch = _open.get(spec.key)
        if ch is None:
            raise RefitError(f"refit channel {spec.key} is not open on rank {rank}")
        buf = (torch.ones if rank == 0 else torch.empty)(nbytes, dtype=torch.uint8, device=ch.device)
        ch.broadcast(buf).wait()
        if ch.device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic() - t0
    from rlcore.errors import Deadline
    from rlcore.publish import publish_dir, wait_for_artifact

    directory = step_dir(spec, step)
    if rank == 0:
        publish_dir(directory, lambda d: (d / "raw.bin").write_bytes(b"\x01" * nbytes))
    else:
        wait_for_artifact(directory, deadline=Deadline(spec.timeout_s, "raw ceiling"))
        with open(directory / "raw.bin", "rb") as f:
            while f.read(1 << 24):
                pass
    return time.monotonic() - t0

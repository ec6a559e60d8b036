"""Refit channels: the worker-side ends of the transports.

These functions run inside backend workers (Ray actors). The sending policy
rank is rank 0 of a channel; generation workers are ranks 1..N. Both sides
walk the same bucket plan, so no extra metadata crosses the wire.

* ``collective``: a private torch.distributed process group (gloo on CPU, NCCL
  on GPU) built from its own TCPStore, so it never disturbs the default group
  of either side's worker group. One broadcast per bucket; every operation
  carries the channel's timeout.
* ``disk`` / ``shared_memory``: one safetensors file per bucket, published
  atomically as one directory per step (under the cache for disk, under
  /dev/shm for shared memory, where receivers map the files).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.errors import PublishError, RefitError
from rlcore.refit.specs import TensorSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChannelSpec:
    """Everything a worker needs to open its end of a refit channel."""

    transport: str  # collective | disk | shared_memory
    key: str  # unique per policy/generation pair
    world_size: int  # 1 sender + N receivers
    addr: str | None = None  # collective: rendezvous host (the sender's node)
    port: int | None = None  # collective: rendezvous port
    backend: str = "gloo"  # collective: gloo or nccl
    root: str | None = None  # file transports: parent directory of per-step dirs
    timeout_s: float = 300.0


class _Collective:
    def __init__(self, spec: ChannelSpec, rank: int) -> None:
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        assert spec.addr is not None and spec.port is not None
        store = dist.TCPStore(spec.addr, spec.port, spec.world_size, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(f"rlcore-refit-{spec.key}", store)
        if spec.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
        self.store = store  # keep the store alive as long as the group
        self.timeout = timeout
        self.rank = rank

    def broadcast(self, buf: Any) -> None:
        self.pg.broadcast(buf, 0, self.timeout).wait()

    def close(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception as err:  # closing must not raise
                log.debug("refit channel: process group shutdown failed: %s", err)
        self.pg = None
        self.store = None


_open: dict[str, _Collective] = {}


def open_channel(spec: ChannelSpec, rank: int) -> None:
    """Open this process's end of ``spec`` (collective: joins the group; all ranks at once)."""
    if spec.transport == "collective" and spec.key not in _open:
        _open[spec.key] = _Collective(spec, rank)


def close_channel(spec: ChannelSpec) -> None:
    ch = _open.pop(spec.key, None)
    if ch is not None:
        ch.close()


def _pack(tensors: Sequence[Any]) -> Any:
    import torch

    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


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


def _step_dir(spec: ChannelSpec, step: int) -> Path:
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


def send_weights(
    spec: ChannelSpec, step: int, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
) -> int:
    """Send a (name, tensor) stream bucket by bucket; returns bytes sent."""
    sent = 0
    if spec.transport == "collective":
        ch = _open.get(spec.key)
        if ch is None:
            raise RefitError(f"refit channel {spec.key} is not open on the sender")
        for _, tensors in _buckets_in_order(named, buckets):
            buf = _pack([t.to(ch.device) for t in tensors])
            ch.broadcast(buf)
            sent += buf.numel()
        return sent
    from safetensors.torch import save_file

    from rlcore.publish import publish_dir

    def write(staging: Path) -> None:
        nonlocal sent
        for i, tensors in _buckets_in_order(named, buckets):
            payload = {s.name: t.detach().contiguous().cpu() for s, t in zip(buckets[i], tensors, strict=True)}
            save_file(payload, str(staging / f"bucket-{i:05d}.safetensors"))
            sent += sum(t.numel() * t.element_size() for t in payload.values())

    try:
        publish_dir(_step_dir(spec, step), write)
    except PublishError as err:
        if isinstance(err.__cause__, RefitError):  # the stream's fault, not the disk's
            raise err.__cause__ from None
        raise
    return sent


def receive_weights(
    spec: ChannelSpec, rank: int, step: int, buckets: Sequence[Sequence[TensorSpec]], *, device: Any = None
) -> Iterator[tuple[str, Any]]:
    """Yield (name, tensor) as buckets arrive, in plan order."""
    if spec.transport == "collective":
        import torch

        ch = _open.get(spec.key)
        if ch is None:
            raise RefitError(f"refit channel {spec.key} is not open on receiver rank {rank}")
        for bucket in buckets:
            buf = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8, device=ch.device)
            ch.broadcast(buf)
            yield from zip((s.name for s in bucket), _unpack(buf, bucket), strict=True)
        return
    from safetensors import safe_open

    from rlcore.publish import wait_for_artifact
    from rlcore.waiting import Deadline

    directory = wait_for_artifact(_step_dir(spec, step), deadline=Deadline(spec.timeout_s, "refit files"))
    for i, bucket in enumerate(buckets):
        with safe_open(str(directory / f"bucket-{i:05d}.safetensors"), framework="pt", device=str(device or "cpu")) as f:
            for s in bucket:
                yield s.name, f.get_tensor(s.name)


def remove_step(spec: ChannelSpec, step: int) -> None:
    """Delete a file transport's step directory once every receiver has loaded it."""
    if spec.transport != "collective" and spec.root:
        shutil.rmtree(_step_dir(spec, step), ignore_errors=True)
        with contextlib.suppress(OSError):  # the channel's directory, once empty
            os.rmdir(_step_dir(spec, step).parent)


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

    t0 = time.monotonic()
    if spec.transport == "collective":
        ch = _open.get(spec.key)
        if ch is None:
            raise RefitError(f"refit channel {spec.key} is not open on rank {rank}")
        buf = (torch.ones if rank == 0 else torch.empty)(nbytes, dtype=torch.uint8, device=ch.device)
        ch.broadcast(buf)
        if ch.device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic() - t0
    from rlcore.publish import publish_dir, wait_for_artifact
    from rlcore.waiting import Deadline

    directory = _step_dir(spec, step)
    if rank == 0:
        publish_dir(directory, lambda d: (d / "raw.bin").write_bytes(b"\x01" * nbytes))
    else:
        wait_for_artifact(directory, deadline=Deadline(spec.timeout_s, "raw ceiling"))
        with open(directory / "raw.bin", "rb") as f:
            while f.read(1 << 24):
                pass
    return time.monotonic() - t0

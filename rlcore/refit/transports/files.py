"""What the file transports (``disk``, ``shared_memory``) share: one safetensors file per
bucket, published atomically as one directory per step, which the receivers load.

A transport of this kind only says where its files go (:meth:`FileTransport.root`):
under the cache for disk, under /dev/shm for shared memory, where receivers map the
files. A receiver that loads a whole directory (a server's load-from-disk API) waits
for it with :func:`rlcore.publish.wait_for_artifact` at :func:`step_dir`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import PublishError, RefitError
from rlcore.refit.specs import ChannelSpec, TensorSpec, buckets_in_order
from rlcore.refit.transports.base import ChannelRequest, RefitTransport


def step_dir(spec: ChannelSpec, step: int) -> Path:
    """Where a file transport (disk, shared memory) publishes the buckets of ``step``:
    one directory per step, published atomically (a receiver that loads a whole
    directory, e.g. a server's load-from-disk API, waits for it with
    :func:`rlcore.publish.wait_for_artifact`)."""
    assert spec.root is not None
    return Path(spec.root) / spec.key / f"step-{step:06d}"


class FileTransport(RefitTransport):
    """A transport that publishes each step's buckets as files under :meth:`root`."""

    def root(self, req: ChannelRequest) -> Path:
        """The parent directory of this transport's channels."""
        raise NotImplementedError

    def channel(self, req: ChannelRequest) -> ChannelSpec:
        return ChannelSpec(
            self.transport.value, req.key, req.world_size, root=str(self.root(req)), timeout_s=req.ctx.timeout_s
        )

    def send(
        self, spec: ChannelSpec, step: int, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
    ) -> int:
        """One safetensors file per bucket, the step's directory published atomically."""
        from safetensors.torch import save_file

        from rlcore.publish import publish_dir

        sent = 0

        def write(staging: Path) -> None:
            nonlocal sent
            for i, tensors in buckets_in_order(named, buckets):
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

    def receive(
        self, spec: ChannelSpec, rank: int, step: int, buckets: Sequence[Sequence[TensorSpec]], device: Any = None
    ) -> Iterator[tuple[str, Any]]:
        """Wait for the step's directory, then load bucket by bucket onto ``device`` (cpu)."""
        from safetensors import safe_open

        from rlcore.errors import Deadline
        from rlcore.publish import wait_for_artifact

        directory = wait_for_artifact(step_dir(spec, step), deadline=Deadline(spec.timeout_s, "refit files"))
        for i, bucket in enumerate(buckets):
            with safe_open(str(directory / f"bucket-{i:05d}.safetensors"), framework="pt", device=str(device or "cpu")) as f:
                for s in bucket:
                    yield s.name, f.get_tensor(s.name)

    def ceiling(self, spec: ChannelSpec, rank: int, step: int, nbytes: int) -> float:
        """One file written, published and read back."""
        import time

        from rlcore.errors import Deadline
        from rlcore.publish import publish_dir, wait_for_artifact

        t0 = time.monotonic()
        directory = step_dir(spec, step)
        if rank == 0:
            publish_dir(directory, lambda d: (d / "raw.bin").write_bytes(b"\x01" * nbytes))
        else:
            wait_for_artifact(directory, deadline=Deadline(spec.timeout_s, "raw ceiling"))
            with open(directory / "raw.bin", "rb") as f:
                while f.read(1 << 24):
                    pass
        return time.monotonic() - t0

    def remove_step(self, spec: ChannelSpec, step: int) -> None:
        """Delete the step's directory once every receiver has loaded it."""
        if spec.root:
            shutil.rmtree(step_dir(spec, step), ignore_errors=True)
            with contextlib.suppress(OSError):  # the channel's directory, once empty
                os.rmdir(step_dir(spec, step).parent)

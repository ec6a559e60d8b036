"""The ``shared_memory`` refit transport: the buckets' files in /dev/shm (same host)."""

from __future__ import annotations

import os
from pathlib import Path

from rlcore.declarations import Transport
from rlcore.refit.transports.base import ChannelRequest
from rlcore.refit.transports.files import FileTransport


def shm_root() -> str:
    """Where the shared-memory transport puts its files (tmpfs)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else str(Path(os.environ.get("TMPDIR", "/tmp")))


class SharedMemoryTransport(FileTransport):
    """One safetensors file per bucket in tmpfs, mapped by the receivers
    (:mod:`~rlcore.refit.transports.files`)."""

    transport = Transport.SHARED_MEMORY
    describe = "one safetensors file per bucket in /dev/shm, mapped by the receivers"
    colocated_rank, apart_rank = 1, 2

    def root(self, req: ChannelRequest) -> Path:
        return Path(shm_root()) / "rlcore-refit"

"""The ``disk`` refit transport: the buckets' files under the run's cache (always works)."""

from __future__ import annotations

from pathlib import Path

from rlcore.declarations import Transport
from rlcore.refit.transports.base import ChannelRequest
from rlcore.refit.transports.files import FileTransport


class DiskTransport(FileTransport):
    """One safetensors file per bucket under ``<cache>/refit`` (:mod:`~rlcore.refit.transports.files`)."""

    transport = Transport.DISK
    describe = "one safetensors file per bucket, published atomically under the cache"
    colocated_rank, apart_rank = 3, 1

    def root(self, req: ChannelRequest) -> Path:
        return Path(req.ctx.cache_dir) / "refit"

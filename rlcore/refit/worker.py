"""Worker-side refit methods that policy and generation workers share.

:class:`RefitChannels` keeps the refit channels a rank joined and closes them at
teardown; :class:`RefitSenderWorker` adds the sender's side of
:class:`rlcore.handles.RefitSender` for a worker group whose rank 0 sends: every
rank runs the export (it may be collective: FSDP unit gathers, tensor-parallel
all-gathers), rank 0 joins the channel and streams the buckets. A worker class
provides ``export_stream()`` (Hugging Face names and the plan's shapes and dtypes,
in plan order, on rank 0; the core checks every tensor against the plan).
:class:`HFWeightSpecs` gives a receiving engine that takes Hugging Face names its
``weight_specs()``, worked out while its server starts and cached between runs.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from rlcore.runtime.rendezvous import listening_address

if TYPE_CHECKING:
    from rlcore.refit.specs import ChannelSpec, TensorSpec

log = logging.getLogger(__name__)


class RefitChannels:
    """Channel bookkeeping of one rank (a mixin for :class:`rlcore.runtime.worker_group.DistributedWorker`)."""

    rank: int

    def refit_address(self) -> tuple[str, int]:
        """Where the channel's store meets (:func:`rlcore.runtime.rendezvous.listening_address`:
        the receivers may connect before this rank's store exists)."""
        return listening_address()

    def _joined_channels(self) -> list[ChannelSpec]:
        joined: list[ChannelSpec] | None = self.__dict__.get("_refit_channels")
        if joined is None:
            joined = self.__dict__["_refit_channels"] = []
        return joined

    def join_refit_channel(self, spec: ChannelSpec, channel_rank: int) -> None:
        """Join ``spec`` as ``channel_rank``; :meth:`close_refit_channels` leaves it."""
        from rlcore.refit import channels

        channels.open_channel(spec, channel_rank)
        self._joined_channels().append(spec)

    def close_refit_channels(self) -> None:
        """Leave every joined channel (never raises: called from teardown)."""
        from rlcore.refit import channels

        joined = self._joined_channels()
        for spec in joined:
            try:
                channels.close_channel(spec)
            except Exception as err:  # teardown must not raise
                log.warning(
                    "rank %d: closing refit channel %s failed: %s", self.rank, spec.key, err
                )
        joined.clear()


class RefitSenderWorker(RefitChannels):
    """The sending side of refit for a group whose rank 0 is channel rank 0."""

    def open_refit_channel(self, spec: ChannelSpec) -> None:
        """Join refit channel ``spec`` as its rank 0 (the sender); other ranks do nothing."""
        if self.rank == 0:
            self.join_refit_channel(spec, 0)

    def refit_ceiling(self, spec: ChannelSpec, step: int, nbytes: int) -> float:
        """Rank 0 sends ``nbytes`` raw over the channel (bench: the transport's ceiling)."""
        from rlcore.refit import channels

        return channels.ceiling(spec, 0, step, nbytes) if self.rank == 0 else 0.0

    def send_weights(self, spec: ChannelSpec, step: int, buckets: list[list[TensorSpec]]) -> int:
        """Stream the current weights over ``spec`` following the plan ``buckets``.

        Every rank runs the export (it may be collective); rank 0 sends. If sending
        fails, rank 0 still finishes the export so its peers are not left waiting in
        a gather. Returns the bytes sent (0 on other ranks).
        """
        from rlcore.refit import channels

        stream = self.export_stream()  # type: ignore[attr-defined]
        try:
            if self.rank == 0:
                return channels.send_weights(spec, step, stream, buckets)
            return 0
        finally:
            for _ in stream:
                pass


class HFWeightSpecs:
    """``weight_specs()`` of an engine that receives weights under Hugging Face names (a
    mixin for :class:`rlcore.runtime.generation_group.EngineWorker`, whose ``model_dir``,
    ``dtype`` and ``specs_cache`` it reads).

    The specs are :func:`rlcore.refit.hf_specs.hf_weight_specs` of the checkpoint: built
    from ``config.json`` on the meta device (no weight read, so it works refit-fed) and
    kept in the run's cache for the next run.
    """

    model_dir: str
    dtype: str
    specs_cache: str | None
    #: The specs being worked out since the server's launch (:meth:`_work_out_specs_ahead`).
    _specs_ahead: Future[list[TensorSpec]] | None = None

    def weight_specs(self) -> list[TensorSpec]:
        """``TensorSpec`` of every weight the engine expects (tied weights under every name)."""
        if self._specs_ahead is not None:
            return list(self._specs_ahead.result())
        return self._hf_specs()

    def _work_out_specs_ahead(self) -> None:
        """Start working out :meth:`weight_specs` in a thread. A worker whose engine is a
        server calls it right after the launch: the handle asks for the specs once the
        server is ready, and a first run's torch, transformers and meta model take seconds
        that the wait hides."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="weight-specs")
        self._specs_ahead = pool.submit(self._hf_specs)
        pool.shutdown(wait=False)

    def _hf_specs(self) -> list[TensorSpec]:
        from rlcore.refit.hf_specs import hf_weight_specs

        return hf_weight_specs(self.model_dir, self.dtype, self.specs_cache)

"""The ``rlcore`` weight-transfer engine: rlcore's refit channels behind vLLM's RL API.

vLLM 0.32 drives weight updates of a running engine through four calls that
exist both on ``LLM`` and as HTTP routes of its server:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
``finish_weight_update``. Each is forwarded to a *weight-transfer engine* inside
every vLLM worker process, picked by ``weight_transfer_config.backend``. This
module registers one named ``rlcore`` whose receiving side is
:mod:`rlcore.refit.channels`, so the policy sends with the core's own channel
code and vLLM loads what arrives:

* ``init_info`` = ``{"channel": <ChannelSpec fields>, "rank_offset": int}``:
  join the channel as rank ``rank_offset + <rank inside this engine>``
  (collective transports rendezvous here; file transports need nothing).
  Several channels (one per transport) may be open at once.
* ``start_weight_update``: vLLM's layerwise reload (weights go to the meta
  device and are rebuilt layer by layer as they arrive; needed on CPU, where
  linear layers keep pre-packed copies of their weights).
* ``update_info`` = ``{"channel": key, "step": int, "buckets": [[{"name",
  "shape", "dtype"}, ...], ...]}``: receive every bucket of the plan and feed
  the (name, tensor) stream to ``model.load_weights``.
* ``finish_weight_update``: finalise the layerwise reload.

If receiving or loading fails half-way, the engine drains the rest of a
lockstep transport's stream (collective: so the sender is not left blocked), finalises the reload
(layers that got no new weight keep their old one) and re-raises.

:func:`register` is idempotent and imports vLLM only when called. It is the
``vllm.general_plugins`` entry point of this distribution, so every process
that builds a vLLM engine (the OpenAI server's engine core included) has the
engine; in-process users call it before building ``LLM``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

#: ``weight_transfer_config.backend`` of the engine this module registers.
BACKEND = "rlcore"


def register(strict: bool = False) -> None:
    """Register the ``rlcore`` engine with vLLM's ``WeightTransferEngineFactory`` (idempotent).

    As vLLM's plugin hook (``strict=False``) a failure is logged, not raised: a
    plugin must never stop an unrelated vLLM engine from starting. rlcore's own
    worker calls it with ``strict=True`` to see the cause.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        engine = engine_class()
    except Exception as err:
        if strict:
            raise
        log.warning("rlcore weight-transfer engine not registered: %s: %s", type(err).__name__, err)
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, engine)
    except ValueError:  # already registered (vLLM loads general plugins in every process)
        return
    # Rotary embeddings hold a cache computed from the config, never a checkpoint
    # weight; vLLM warns "RotaryEmbedding: Failed to load weights" after every reload.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_quiet_rotary)


def _quiet_rotary(record: logging.LogRecord) -> bool:
    return not (
        record.msg == "%s: Failed to load weights"
        and isinstance(record.args, tuple)
        and str(record.args[0]).endswith("RotaryEmbedding")
    )


def init_info(channel: Any, rank_offset: int) -> dict[str, Any]:
    """``init_info`` for ``init_weight_transfer_engine``: a JSON-able dict."""
    import dataclasses

    return {"channel": dataclasses.asdict(channel), "rank_offset": int(rank_offset)}


def update_info(channel: Any, step: int, buckets: list[list[Any]]) -> dict[str, Any]:
    """``update_info`` for ``update_weights``: a JSON-able dict (buckets of TensorSpec)."""
    return {
        "channel": channel.key,
        "step": int(step),
        "buckets": [
            [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in bucket]
            for bucket in buckets
        ],
    }


@functools.cache
def _info_classes() -> tuple[type, type]:
    """vLLM's init and update info for rlcore channels (defined on first use)."""
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class RlcoreInitInfo(WeightTransferInitInfo):
        channel: dict[str, Any]
        rank_offset: int

    @dataclass
    class RlcoreUpdateInfo(WeightTransferUpdateInfo):
        channel: str
        step: int
        buckets: list[list[dict[str, Any]]]

    return RlcoreInitInfo, RlcoreUpdateInfo


def _plan(buckets: list[list[dict[str, Any]]]) -> list[list[Any]]:
    """The bucket plan an update carries (JSON) as :class:`~rlcore.refit.specs.TensorSpec` lists."""
    from rlcore.refit.specs import TensorSpec

    return [
        [TensorSpec(d["name"], tuple(int(x) for x in d["shape"]), d["dtype"]) for d in bucket]
        for bucket in buckets
    ]


def _load_all(model: Any, stream: Any, expected: int, step: int) -> None:
    """``model.load_weights`` over the whole stream; RefitError unless it took every tensor."""
    from rlcore.errors import RefitError

    seen = 0

    def counted() -> Any:
        nonlocal seen
        for item in stream:
            seen += 1
            yield item

    model.load_weights(counted())
    if seen != expected:
        raise RefitError(
            f"rlcore weight transfer: vLLM's load_weights consumed {seen} of "
            f"{expected} tensors of step {step}"
        )


def _recover(model: Any, model_config: Any, spec: Any, stream: Any) -> None:
    """After a failed update: keep the sender unblocked and the model whole."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    from rlcore.refit import transports

    if transports.get(spec.transport).lockstep:
        try:
            for _ in stream:  # receive the buckets the sender still sends
                pass
        except Exception as err:
            log.warning(
                "rlcore weight transfer: draining channel %s failed: %s", spec.key, err
            )
    try:
        # vLLM ends the session on error without finalising; layers still on the
        # meta device would break the engine, so put their old weights back.
        finalize_layerwise_reload(model, model_config)
    except Exception as err:
        log.warning(
            "rlcore weight transfer: restoring layers after a failed update failed: %s", err
        )


def _receive_update(engine: Any, update_info: Any) -> None:
    """The engine's ``receive_weights``: the step's stream over its channel into the model
    (after a failure, :func:`_recover`)."""
    from rlcore.errors import RefitError
    from rlcore.refit import channels

    if update_info.channel not in engine.channels:
        raise RefitError(
            f"rlcore weight transfer: channel {update_info.channel} was never opened "
            "here (init_weight_transfer_engine first)"
        )
    spec, rank = engine.channels[update_info.channel]
    buckets = _plan(update_info.buckets)
    stream = channels.receive_weights(spec, rank, update_info.step, buckets)
    try:
        _load_all(engine.model, stream, sum(len(b) for b in buckets), update_info.step)
    except BaseException:
        _recover(engine.model, engine.model_config, spec, stream)
        raise


@functools.cache
def engine_class() -> type:
    """The engine class, defined on first use so that importing this module stays light."""
    import torch
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from rlcore.refit import channels

    init_cls, update_cls = _info_classes()

    class RlcoreWeightTransferEngine(WeightTransferEngine[init_cls, update_cls]):  # type: ignore[valid-type]
        """Receives weights over rlcore refit channels and loads them into the vLLM model."""

        init_info_cls = init_cls
        update_info_cls = update_cls
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # channel key -> (ChannelSpec, this process's rank in it)
            self.channels: dict[str, tuple[channels.ChannelSpec, int]] = {}

        def init_transfer_engine(self, init_info: Any) -> None:
            spec = channels.ChannelSpec(**init_info.channel)
            rank = init_info.rank_offset + self.parallel_config.rank
            channels.open_channel(spec, rank)
            self.channels[spec.key] = (spec, rank)
            log.info(
                "rlcore weight transfer: joined %s channel %s as rank %d",
                spec.transport,
                spec.key,
                rank,
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which fails on CPU.
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu":
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: Any) -> None:
            _receive_update(self, update_info)

        def shutdown(self) -> None:
            for spec, _ in self.channels.values():
                channels.close_channel(spec)
            self.channels.clear()

    return RlcoreWeightTransferEngine

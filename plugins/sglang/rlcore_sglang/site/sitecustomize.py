"""Loaded by every Python process of an rlcore-started SGLang server (``PYTHONPATH``).

rlcore_sglang puts this directory first on the server's ``PYTHONPATH``, so
Python's ``site`` imports this module at start in the server process and in
every process SGLang spawns from it (scheduler, detokenizer). It does two things,
both only once the module they concern is imported:

1. **torchvision op schemas.** The only torchvision on PyPI for torch 2.13 is a
   CUDA build; on a CPU-only host its compiled ops do not load, and its import
   then fails with ``operator torchvision::nms does not exist`` (its meta
   registrations refer to ops its missing library would have defined). SGLang's
   config module imports torchvision (an image processor). Defining the schemas
   of ``torchvision::nms`` and ``torchvision::qnms`` (no kernels: a text model
   never calls them) before torchvision runs gets its import through.
2. **rlcore refit channels in SGLang's weight updater.** SGLang's
   ``/init_weights_update_group`` builds its process group with its own store
   prefixes, which the core's sending rank (:mod:`rlcore.refit.channels`) does
   not share. For groups whose name starts with :data:`GROUP_PREFIX`, the
   patched updater joins the core's channel instead (same code as every other
   rlcore receiver), and ``/update_weights_from_distributed`` with
   ``load_format="flattened_bucket"`` receives one bucket through it: one
   broadcast of the bucket's packed bytes, which is both what the core's sender
   sends and SGLang's own flattened-bucket layout. Loading, sessions
   (``begin/end_weight_update``), cache flush and ``weight_version`` stay
   SGLang's. ``load_format="rlcore_drain"`` receives a bucket and loads nothing
   (a client that gave up on a refit keeps the sender from blocking).

Nothing here runs unless this directory is on ``PYTHONPATH``; it never imports
rlcore_sglang (the server venv does not have it), only the core.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

#: Group names of the core's refit channels: ``rlcore-refit:<key>:<timeout_s>``.
GROUP_PREFIX = "rlcore-refit:"
#: ``load_format`` of a bucket that is received and not loaded.
DRAIN = "rlcore_drain"

_TORCHVISION_LIB: Any = None
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"


def define_torchvision_schemas() -> None:
    """Define ``torchvision::nms`` / ``torchvision::qnms`` unless torchvision's library did."""
    global _TORCHVISION_LIB
    if _TORCHVISION_LIB is not None:
        return
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in (
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
    ):
        try:
            lib.define(schema)
        except RuntimeError:  # already defined (a torchvision whose ops did load)
            pass
    _TORCHVISION_LIB = lib  # keep the definitions alive


class _Group:
    """What ``_model_update_group[name]`` holds for a core refit channel."""

    def __init__(self, spec: Any, rank: int) -> None:
        self.spec = spec
        self.rank = rank


def _channel_spec(group_name: str, addr: str, port: int, world_size: int, backend: str) -> Any:
    from rlcore.refit.channels import ChannelSpec

    key, timeout = group_name[len(GROUP_PREFIX) :].rsplit(":", 1)
    return ChannelSpec(
        "collective", key, int(world_size), addr=addr, port=int(port), backend=backend,
        timeout_s=float(timeout),
    )


def patch_weight_updater(module: Any) -> None:
    """Route rlcore groups of SGLang's ``WeightUpdater`` through :mod:`rlcore.refit.channels`."""
    cls = module.WeightUpdater
    if getattr(cls, "_rlcore_patched", False):
        return
    init_group = cls.init_weights_update_group
    receive = cls.receive_weights_from_distributed
    destroy = cls.destroy_weights_update_group

    def init_weights_update_group(
        self: Any, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str = "nccl",
    ) -> tuple[bool, str]:
        if not group_name.startswith(GROUP_PREFIX):
            return init_group(self, master_address, master_port, rank_offset, world_size, group_name, backend)
        from rlcore.refit import channels

        try:
            spec = _channel_spec(group_name, master_address, master_port, world_size, backend)
            rank = int(rank_offset) + self.tp_rank
            channels.open_channel(spec, rank)
        except Exception as err:  # SGLang answers 400 with this message
            return False, f"Failed to join rlcore refit channel {group_name}: {type(err).__name__}: {err}"
        self._model_update_group[group_name] = _Group(spec, rank)
        return True, f"Joined rlcore refit channel {spec.key} as rank {rank}."

    def receive_weights_from_distributed(
        self: Any, *, names: Any, dtypes: Any, shapes: Any, group_name: str, load_format: str | None = None
    ) -> Any:
        group = self._model_update_group.get(group_name)
        if not isinstance(group, _Group):
            return receive(self, names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, load_format=load_format)
        if load_format not in ("flattened_bucket", DRAIN):
            raise ValueError(
                f"rlcore refit channels move one packed bucket per call: load_format must be "
                f"'flattened_bucket' or '{DRAIN}', got {load_format!r}"
            )
        from rlcore.refit import channels
        from rlcore.refit.specs import TensorSpec

        bucket = [
            TensorSpec(str(n), tuple(int(d) for d in s), str(t).removeprefix("torch."))
            for n, t, s in zip(names, dtypes, shapes, strict=True)
        ]
        received = list(channels.receive_weights(group.spec, group.rank, 0, [bucket]))
        return [] if load_format == DRAIN else received

    def destroy_weights_update_group(self: Any, group_name: str) -> tuple[bool, str]:
        group = self._model_update_group.get(group_name)
        if not isinstance(group, _Group):
            return destroy(self, group_name)
        from rlcore.refit import channels

        del self._model_update_group[group_name]
        channels.close_channel(group.spec)
        return True, f"Left rlcore refit channel {group.spec.key}."

    cls.init_weights_update_group = init_weights_update_group
    cls.receive_weights_from_distributed = receive_weights_from_distributed
    cls.destroy_weights_update_group = destroy_weights_update_group
    cls._rlcore_patched = True


_AFTER_IMPORT = {"torchvision": None, _UPDATER: patch_weight_updater}


class _Finder(importlib.abc.MetaPathFinder):
    """Runs the actions above around the import of the modules they concern."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _AFTER_IMPORT:
            return None
        if name == "torchvision":
            define_torchvision_schemas()  # before torchvision's own code runs
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        after = _AFTER_IMPORT[name]
        if spec is None or spec.loader is None or after is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            after(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Finder())

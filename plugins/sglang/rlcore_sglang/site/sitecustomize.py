"""Loaded by every Python process of an rlcore-started SGLang server (``PYTHONPATH``).

rlcore_sglang puts this directory first on the server's ``PYTHONPATH``, so
Python's ``site`` imports this module at start in the server process and in
every process SGLang spawns from it (scheduler, detokenizer). It does three things,
each only once the module it concerns is imported:

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

3. **Per-request sampling seeds on CPU** (only with ``RLCORE_SGLANG_SEEDS=1``, which
   rlcore_sglang sets on CPU). SGLang honours ``sampling_seed`` only in its
   deterministic mode, which needs GPU attention backends, and hashes (seed,
   position, token) with a ``sgl_kernel`` op that PyPI has no CPU build of. Here
   every batch carries a seed per request (its ``sampling_seed``, else a random
   one drawn once for the request) and the hash has a torch version on CPU, so a
   request sampled with a seed gives the same tokens every time, in any batch.

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
    from rlcore.refit.specs import ChannelSpec

    key, timeout = group_name[len(GROUP_PREFIX) :].rsplit(":", 1)
    return ChannelSpec(
        "collective", key, int(world_size), addr=addr, port=int(port), backend=backend,
        timeout_s=float(timeout),
    )


def _receive_bucket(group: _Group, names: Any, dtypes: Any, shapes: Any, load_format: str | None) -> list[Any]:
    """One packed bucket over a core refit channel: its (name, tensor) pairs (none to drain)."""
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
        return _receive_bucket(group, names, dtypes, shapes, load_format)

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


def _murmur_hash32_torch(seed: Any, positions: Any, col_indices: Any) -> Any:
    """A 32-bit hash of (seed, position, column) per row and column, in torch (CPU).

    Stands in for SGLang's ``sgl_kernel`` op on CPU: any well-mixed hash will do, since
    SGLang only turns it into uniform noise for Gumbel-max sampling. Values are in
    ``[0, 2**32)`` (int64; arithmetic is modulo ``2**32``).
    """
    import torch

    m = 0xFFFFFFFF
    s = seed.to(torch.int64).view(-1, 1) & m
    s2 = (seed.to(torch.int64).view(-1, 1) >> 32) & m
    p = positions.to(torch.int64).view(-1, 1) & m
    c = col_indices.to(torch.int64).view(1, -1) & m
    h = (s * 0x9E3779B1 + s2 * 0x7FEB352D + p * 0x85EBCA77 + c * 0xC2B2AE3D + 0x165667B1) & m
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = ((h ^ (h >> shift)) * mult) & m
    return h ^ (h >> 16)


def patch_murmur_hash(module: Any) -> None:
    """SGLang's seeded-sampling hash: the torch version for CPU tensors."""
    original = module.murmur_hash32

    def murmur_hash32(seed: Any, positions: Any, col_indices: Any) -> Any:
        if seed.device.type == "cpu":
            return _murmur_hash32_torch(seed, positions, col_indices)
        return original(seed, positions, col_indices)

    module.murmur_hash32 = murmur_hash32


def patch_sampling_batch_info(module: Any) -> None:
    """Every batch carries one seed per request (``RLCORE_SGLANG_SEEDS=1`` only)."""
    import os

    if os.environ.get("RLCORE_SGLANG_SEEDS") != "1":
        return
    cls = module.SamplingBatchInfo
    original = cls.from_schedule_batch.__func__

    def from_schedule_batch(klass: Any, batch: Any, vocab_size: int) -> Any:
        import random

        import torch

        info = original(klass, batch, vocab_size)
        if info.sampling_seed is None:
            seeds = []
            for req in batch.reqs:
                params = req.sampling_params
                if params.sampling_seed is None:  # drawn once: kept for the request's decode steps
                    params.sampling_seed = random.getrandbits(62)
                seeds.append(params.sampling_seed)
            info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=batch.device)
        return info

    cls.from_schedule_batch = classmethod(from_schedule_batch)


_AFTER_IMPORT = {
    "torchvision": None,
    _UPDATER: patch_weight_updater,
    "sglang.kernels.ops.sampling.murmur_hash": patch_murmur_hash,
    "sglang.srt.sampling.sampling_batch_info": patch_sampling_batch_info,
}


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

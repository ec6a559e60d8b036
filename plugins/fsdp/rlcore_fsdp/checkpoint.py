"""Training checkpoints of the FSDP policy: one rank's part of a save and a load.

Format ``fsdp-sharded-dcp`` version 1, one directory:

* ``.metadata`` and ``__<rank>_0.distcp``: torch.distributed.checkpoint (DCP) of
  ``{"model": ..., "optim": ...}`` taken under FSDP1's ``SHARDED_STATE_DICT`` (each rank's
  ShardedTensor shards of the weights and of AdamW's moments, FQN-keyed through
  ``FSDP.optim_state_dict``). Every rank writes its own file at the same time, so no rank
  gathers the model; rank 0 adds only the small ``.metadata``.
* ``rng-<rank>.pt``: that rank's RNG states (torch CPU, CUDA where initialised, python
  ``random``, numpy), tensors and plain lists only (loaded with ``weights_only=True``).
* ``fsdp-checkpoint.json``: rank 0's description (format, world size, every weight's name,
  shape and dtype, whether the optimizer had stepped), read by the driver before a load.

Why sharded DCP rather than LOCAL_STATE_DICT: both copy the exact bytes of every shard
(the round trip is bitwise either way), but DCP's files carry each shard's global offsets,
so a checkpoint loads into another world size (DCP reads the overlapping parts of the
saved shards); local flat-parameter files only fit the world size that wrote them.

A staged save (:func:`stage`, :func:`written`: contract 2.3's ``stage_checkpoint`` and
``checkpoint_written``) writes the same files through DCP's ``async_save``: the shards are
copied into host memory (pinned where there is a GPU; one copy per rank, kept and reused by
the next save, so the host memory held stays the size of one rank's state) and written by
DCP's thread, whose collectives run on a gloo group of their own beside the training's
NCCL. The RNG states and the description are small and written before :func:`stage`
returns. :func:`written` only asks whether that thread is done.

Under ``policy.options.lora`` the model part holds the adapters alone (``adapters_only`` in the
description, with ``base_model``: the checkpoint directory the frozen base weights come from
and a fingerprint of it): the base never changes while adapters train, so a resume takes it
from the model the run starts from, and a checkpoint of a 1 B model with rank-16 adapters is
megabytes, not gigabytes. A resume on another base is refused, naming both.

Functions here run inside a rank (torch imported lazily); :func:`save`, :func:`stage` and
:func:`load` are collective: every rank calls them with the same directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.errors import CheckpointError
from rlcore.runtime import rng as rng_states

if TYPE_CHECKING:
    from rlcore_fsdp.worker import FSDPWorker

#: The ``format`` the plugin declares (:class:`rlcore.declarations.CheckpointSupport`).
FORMAT = "fsdp-sharded-dcp"
#: Bump when this module can no longer load what an earlier release wrote.
VERSION = "1"
META_FILE = "fsdp-checkpoint.json"
DCP_METADATA = ".metadata"


def rng_file(rank: int) -> str:
    return f"rng-{rank}.pt"


# ------------------------------------------------------------------------ save


def save(worker: FSDPWorker, directory: str) -> dict[str, Any]:
    """Write this rank's part of a checkpoint of ``worker`` into ``directory``. Collective.

    Only reads the policy's state (no unshard with writeback, no optimizer step, no RNG
    draw), so the next step gives what it would have given without the save. Returns this
    rank's seconds and bytes written. A write failure raises the ``OSError`` of the rank
    that hit it, naming the path.
    """
    import torch.distributed.checkpoint as dcp

    t0 = time.monotonic()
    path = Path(directory)
    state = _sharded_state(worker, with_optimizer=bool(worker.optimizer.state), adapters_only=trains_adapters(worker))
    try:
        with _quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=False))
    except dcp.api.CheckpointException as err:  # a BaseException: turned into what it wraps
        raise _first_failure(err, f"fsdp checkpoint save into {path}") from None
    # After DCP's collectives: a rank failing here fails alone, its peers do not wait on it.
    _write_rank_files(worker, path)
    nbytes = sum(
        f.stat().st_size for f in path.iterdir() if f.name.startswith(f"__{worker.rank}_")
    )
    return {"seconds": time.monotonic() - t0, "bytes": nbytes}


@dataclass
class StagedSave:
    """A rank's staged save being written: DCP's future and where."""

    future: Any
    path: Path


def stage(worker: FSDPWorker, directory: str) -> dict[str, float]:
    """Copy this rank's part of a checkpoint into host memory and start writing it into
    ``directory`` in the background (DCP's ``async_save``); returns once copied, with the
    host bytes the copy holds and the seconds it took. What is written is the state now.
    Collective. A staged save still being written is refused (the core waits for it)."""
    import torch.distributed.checkpoint as dcp

    pending = worker.staged_save
    if pending is not None and not pending.future.done():
        raise CheckpointError(f"fsdp checkpoint {directory}: the staged save into {pending.path} is still being written")
    t0 = time.monotonic()
    path = Path(directory)
    state = _sharded_state(worker, with_optimizer=bool(worker.optimizer.state), adapters_only=trains_adapters(worker))
    try:
        with _quiet():
            future = dcp.async_save(
                state, storage_writer=dcp.FileSystemWriter(path, sync_files=False),
                process_group=_io_group(worker), async_stager=_stager(worker),
            )
    except dcp.api.CheckpointException as err:
        raise _first_failure(err, f"fsdp checkpoint save into {path}") from None
    worker.staged_save = StagedSave(future, path)
    _write_rank_files(worker, path)
    return {"host_bytes": float(_host_bytes(state)), "stage_s": time.monotonic() - t0}


def written(worker: FSDPWorker) -> bool:
    """Whether this rank's staged save is written (True when none is staged); raises the
    write's failure once, as :func:`save` would have. Local: no collective, returns at once."""
    pending = worker.staged_save
    if pending is None:
        return True
    if not pending.future.done():
        return False
    worker.staged_save = None
    try:
        pending.future.result()
    except BaseException as err:  # DCP's CheckpointException, or what its thread raised
        raise _first_failure(err, f"fsdp checkpoint save into {pending.path}") from None
    return True


def _stager(worker: FSDPWorker) -> Any:
    """The rank's DCP stager (:class:`_HostCopy`), made once and kept."""
    if worker.stager is None:
        worker.stager = _HostCopy()
    return worker.stager


class _HostCopy:
    """A DCP ``AsyncStager`` that copies every tensor of the state (ShardedTensors' local
    shards included) into host memory it allocates at the first save, pinned where CUDA
    is, and copies into again at every later one: one rank's state of host memory however
    many saves. Always a copy, CPU tensors too, so the policy may train on at once (DCP's
    own stagers either skip CPU tensors or do not take ShardedTensors)."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        import torch
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self.cache is None:
            self.cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        try:
            return _copy_state_dict(state_dict, self.cache)
        except Exception:  # noqa: BLE001 - the state's layout changed (optimizer state since): copy anew
            self.cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            return _copy_state_dict(state_dict, self.cache)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.cache = None


def _io_group(worker: FSDPWorker) -> Any:
    """The process group of DCP's background collectives: a gloo group of its own, made once
    (``async_save`` needs a CPU backend, and collectives of two threads on one group would
    interleave: the training's own, gloo on CPU, go on while DCP writes)."""
    import torch.distributed as dist

    if worker.io_group is None:
        worker.io_group = dist.new_group(backend="gloo")
    return worker.io_group


def _host_bytes(state: Any) -> int:
    """Bytes of the tensors in a staged state dict (ShardedTensors: their local shards)."""
    import torch

    if isinstance(state, dict):
        return sum(_host_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_host_bytes(v) for v in state)
    shards = getattr(state, "local_shards", None)  # a ShardedTensor (a Tensor too): its own part
    if callable(shards):
        return sum(_host_bytes(s.tensor) for s in shards())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0


def _write_rank_files(worker: FSDPWorker, path: Path) -> None:
    """This rank's RNG states, and on rank 0 the checkpoint's description, beside DCP's files."""
    _write_rng(path / rng_file(worker.rank))
    if worker.rank == 0:
        _write_meta(path / META_FILE, worker, optimizer=bool(worker.optimizer.state))


def _sharded_state(worker: FSDPWorker, *, with_optimizer: bool, adapters_only: bool = False) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as FSDP1's sharded state dicts (ShardedTensors, not
    DTensors; plain tensors at world size 1, where FSDP runs NO_SHARD); ``adapters_only``:
    the model's adapter matrices alone (the optimizer holds nothing else). The tensors share
    storage with the live shards: DCP reads from them on save and writes into them on load."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from rlcore_fsdp import adapters

    with _sharded(worker):
        model = worker.model.state_dict()
        if adapters_only:
            model = {k: v for k, v in model.items() if adapters.is_adapter(k)}
        state: dict[str, Any] = {"model": model}
        if with_optimizer:
            state["optim"] = FSDP.optim_state_dict(worker.model, worker.optimizer)
    return state


def trains_adapters(worker: FSDPWorker) -> bool:
    """Whether ``worker`` trains adapters (its saves then hold them alone)."""
    return worker.options is not None and worker.options.lora is not None


def base_model(model_dir: str) -> dict[str, str]:
    """The base model an adapters-only checkpoint is written on: its directory and a
    fingerprint of its ``config.json`` and weight files' names and sizes (read, not hashed
    whole: a 70 B model's weights are not read again to save a few megabytes)."""
    import hashlib

    path = Path(model_dir)
    digest = hashlib.sha256((path / "config.json").read_bytes() if (path / "config.json").is_file() else b"")
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return {"path": str(path.resolve()), "fingerprint": digest.hexdigest()[:16]}


def _write_rng(path: Path) -> None:
    import torch

    torch.save(rng_states.capture(), path)


def _write_meta(path: Path, worker: FSDPWorker, *, optimizer: bool) -> None:
    import torch

    meta = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": worker.world_size,
        "optimizer": optimizer,
        # What trains: the adapters' options under policy.options.lora (None: every weight).
        "lora": dataclasses.asdict(worker.options.lora) if worker.options and worker.options.lora else None,
        # Adapters alone, on top of this base (absent: every weight is in the files).
        "adapters_only": trains_adapters(worker),
        "base_model": base_model(worker.model_dir) if trains_adapters(worker) else None,
        "torch": torch.__version__,
        "weights": [[s.name, list(s.shape), s.dtype] for s in worker.weight_specs()],
    }
    path.write_text(json.dumps(meta, indent=1))


# ------------------------------------------------------------------------ load


def read_meta(directory: str) -> dict[str, Any]:
    """The checkpoint's description; :class:`CheckpointError` naming the file when it is
    missing or unreadable (the driver checks it before any rank loads)."""
    path = Path(directory) / META_FILE
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        int(meta["world_size"])
        return meta
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"fsdp checkpoint {directory}: cannot read {path}: {err} (not a complete checkpoint "
            "of the fsdp policy)"
        ) from err


def check_compatible(directory: str, meta: dict[str, Any], specs: list[Any], lora: dict[str, Any] | None = None) -> None:
    """Raise :class:`CheckpointError` naming the first difference when the checkpoint holds
    another model than ``specs`` (the running policy's weights), other adapters than
    ``lora`` (the running ``policy.options.lora``), or a file is missing."""
    if meta.get("lora") != lora:
        raise CheckpointError(
            f"fsdp checkpoint {directory} was written with policy.options.lora={meta.get('lora')}, "
            f"the running policy has {lora} (resume with the options the run was started with)"
        )
    saved = [(n, tuple(s), d) for n, s, d in meta["weights"]]
    running = [(s.name, tuple(s.shape), s.dtype) for s in specs]
    if saved != running:
        diff = next(
            ((a, b) for a, b in zip(saved, running, strict=False) if a != b),
            (f"{len(saved)} weights", f"{len(running)} weights"),
        )
        raise CheckpointError(
            f"fsdp checkpoint {directory} holds another model than the running policy: "
            f"saved {diff[0]}, running {diff[1]} (resume with the model the run was started with)"
        )
    ranks = int(meta["world_size"])
    for name in [DCP_METADATA, *(rng_file(r) for r in range(ranks))]:
        if not (Path(directory) / name).is_file():
            raise CheckpointError(f"fsdp checkpoint {directory}: missing {Path(directory) / name}")


def load(worker: FSDPWorker, directory: str, meta: dict[str, Any]) -> dict[str, Any]:
    """Restore ``worker`` from ``directory`` (checked by :func:`check_compatible`). Collective.

    Weights and optimizer state are read into the live shards through DCP, which also
    reshards a checkpoint of another world size. RNG states: rank ``r`` takes those of
    saved rank ``r mod saved world size`` (every rank starts from one seed anyway).
    Returns this rank's seconds.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    t0 = time.monotonic()
    path = Path(directory)
    _check_dcp_files(path)
    rng = _agreed(worker, lambda: _read_rng(path / rng_file(worker.rank % int(meta["world_size"]))))
    only = bool(meta.get("adapters_only"))
    if only:
        _check_base(worker, directory, meta)
    worker.reset_optimizer()
    with_optimizer = bool(meta["optimizer"])
    if with_optimizer:
        _init_optimizer_state(worker)
    state = _sharded_state(worker, with_optimizer=with_optimizer, adapters_only=only)
    try:
        with _quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    except dcp.api.CheckpointException as err:
        files = ", ".join(sorted(str(f) for f in path.glob("*.distcp")))
        raise _first_failure(err, f"fsdp checkpoint {path}: cannot read its shards ({files})") from None
    with _sharded(worker), _base_not_in_files(only):
        # Adapters only: the frozen base stays as the run loaded it from its model.
        worker.model.load_state_dict(state["model"], strict=not only)
        if with_optimizer:
            worker.optimizer.load_state_dict(
                FSDP.optim_state_dict_to_load(worker.model, worker.optimizer, state["optim"])
            )
    rng_states.restore(rng)
    return {"seconds": time.monotonic() - t0}


def _check_base(worker: FSDPWorker, directory: str, meta: dict[str, Any]) -> None:
    """An adapters-only checkpoint loads only on the base it was written on."""
    saved, running = meta.get("base_model") or {}, base_model(worker.model_dir)
    if saved.get("fingerprint") != running["fingerprint"]:
        raise CheckpointError(
            f"fsdp checkpoint {directory} holds LoRA adapters trained on the base model {saved.get('path')} "
            f"(fingerprint {saved.get('fingerprint')}); the running policy's base is {running['path']} "
            f"(fingerprint {running['fingerprint']}): resume with model.path the run was started with"
        )


@contextlib.contextmanager
def _base_not_in_files(only: bool) -> Iterator[None]:
    """FSDP1's sharded load logs a warning for every weight a partial state dict leaves out:
    with adapters only, every base weight, as meant."""
    import logging

    fsdp_log = logging.getLogger("torch.distributed.fsdp._state_dict_utils")
    level = fsdp_log.level
    if only:
        fsdp_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        fsdp_log.setLevel(level)


def _check_dcp_files(path: Path) -> None:
    """Every data file DCP's metadata names is there and long enough: a missing or truncated
    one is named here instead of deep inside DCP's read."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(
            f"fsdp checkpoint {path}: cannot read {path / DCP_METADATA}: {type(err).__name__}: {err}"
        ) from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < size:
            state = "missing" if have is None else f"truncated ({have} of {size} bytes)"
            raise CheckpointError(f"fsdp checkpoint {path}: {file} is {state}")


def _init_optimizer_state(worker: FSDPWorker) -> None:
    """Give a fresh AdamW its state tensors, so that the sharded optimizer state dict has
    the shapes DCP loads into: one step on zero gradients at learning rate 0 leaves every
    weight bit-identical (AdamW's decay multiplies by 1 - 0 * wd, its update adds 0) and
    the state it creates is overwritten by the load."""
    import torch

    optimizer = worker.optimizer
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def _read_rng(path: Path) -> dict[str, Any]:
    import torch

    try:
        state = torch.load(path, weights_only=True)
        if not isinstance(state, dict) or "torch" not in state or "python" not in state:
            raise ValueError("no torch and python RNG states in it")
        return state
    except Exception as err:
        raise CheckpointError(
            f"fsdp checkpoint: cannot read the RNG states in {path}: {type(err).__name__}: {err}"
        ) from err


def _agreed(worker: FSDPWorker, read: Callable[[], Any]) -> Any:
    """``read()`` on every rank, raising on every rank when it failed on any: a rank that
    failed alone would leave its peers waiting in DCP's collectives until the timeout."""
    import torch.distributed as dist

    error: CheckpointError | None = None
    result = None
    try:
        result = read()
    except CheckpointError as err:
        error = err
    errors: list[Any] = [str(error) if error else None] * worker.world_size
    if worker.world_size > 1:
        dist.all_gather_object(errors, errors[worker.rank])
    if error is not None:
        raise error
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise CheckpointError(failed)
    return result


# --------------------------------------------------------------------- helpers


def _first_failure(err: BaseException, what: str) -> Exception:
    """DCP's ``CheckpointException`` (per-rank failures) as the first rank's own error: an
    ``OSError`` (a full disk) keeps its type, errno and path; anything else becomes a
    :class:`CheckpointError`."""
    failures = getattr(err, "failures", {}) or {}
    for rank, (exc, _trace) in sorted(failures.items()):
        if isinstance(exc, OSError):
            return OSError(exc.errno, f"{what}: rank {rank}: {exc.strerror or exc}", exc.filename)
    first = next(iter(sorted(failures.items())), None)
    detail = f"rank {first[0]}: {type(first[1][0]).__name__}: {first[1][0]}" if first else str(err)
    return CheckpointError(f"{what}: {detail}")


@contextlib.contextmanager
def _sharded(worker: FSDPWorker) -> Iterator[None]:
    """FSDP1's ``SHARDED_STATE_DICT`` mode for model and optimizer state dicts, kept on the
    device (DCP copies to and from the files itself)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import (
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    with _quiet(), FSDP.state_dict_type(
        worker.model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(offload_to_cpu=False),
        ShardedOptimStateDictConfig(offload_to_cpu=False),
    ):
        yield


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """FSDP1's state-dict calls warn about FSDP1's deprecation and, at world size 1, that
    NO_SHARD returns full tensors; both are expected here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
        # DCP's collectives over a gloo group ask torch for the group's device in a way torch
        # deprecates, twice per call per rank; nothing to act on here.
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
        warnings.filterwarnings("ignore", message="Multiple backends are registered with this ProcessGroup.*")
        yield

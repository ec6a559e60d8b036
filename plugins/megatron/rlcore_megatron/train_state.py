"""Training checkpoints of the Megatron policy: weights, AdamW state and every rank's RNG states.

Not the converted Hugging Face checkpoint the policy publishes for a generation engine
(:mod:`rlcore_megatron.checkpoint`): this is what ``rlcore run --resume`` restores, the
policy's whole training state, written by its worker ranks into the directory the core
hands :meth:`rlcore_megatron.handle.MegatronPolicy.save_checkpoint`.

A checkpoint directory holds:

* ``dist/``: megatron-core's distributed checkpoint (``dist_checkpointing``, ``torch_dist``
  format) of ``model.sharded_state_dict()`` and of the AdamW moments. The moments have
  their parameter's shape and sharding, so they are stated as ShardedTensors beside it
  (:func:`megatron.core.dist_checkpointing.optimizer.optim_state_to_sharding_state`):
  megatron-core writes each global tensor once (replicas of other data-parallel ranks
  are skipped) and reshards it on load, for the moments as for the weights. Their
  float32 bytes are written and read back as they are, so the round trip is exact.
  AdamW's scalar step counts (equal on every rank) and its hyper-parameters go to
  ``common.pt`` (``torch.save`` by rank 0).
* ``rng/rank<NNNNN>.pt``: each rank's RNG states (torch CPU, CUDA where present,
  python ``random``, numpy, megatron-core's tensor-parallel tracker), one file per rank
  because they differ per rank and no other layout can take them.
* :data:`META_NAME`: written by rank 0 last: format version, the layout (tensor- and
  data-parallel sizes), the model's shape, dtype and padded vocabulary, and whether the
  optimizer had state yet (AdamW creates it at the first step).

Loading at another layout (tensor- or data-parallel size) reshards weights and moments;
the RNG states cannot follow (they are per rank), so the ranks keep theirs and say so.
A checkpoint of another model, dtype or padded vocabulary raises
:class:`rlcore.errors.CheckpointError` naming both sides.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.errors import CheckpointError
from rlcore.runtime import rng as rng_states

if TYPE_CHECKING:
    from rlcore_megatron.worker import MegatronPolicyWorker

log = logging.getLogger(__name__)

#: What :class:`rlcore.declarations.CheckpointSupport` names this format.
FORMAT = "megatron-dist-ckpt"
#: Version of the layout below; bump it when an older one can no longer be loaded.
FORMAT_VERSION = "1"
#: The checkpoint's record, written by rank 0 once everything else is.
META_NAME = "rlcore_megatron_train.json"
DIST_DIR = "dist"
RNG_DIR = "rng"


def rng_file(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its RNG states in checkpoint ``directory``."""
    return Path(directory) / RNG_DIR / f"rank{rank:05d}.pt"


def layout_of(worker: MegatronPolicyWorker) -> dict[str, int]:
    """The parallel layout a checkpoint records (and is compared on at load)."""
    return {"tp": worker.tp_size, "dp": worker.dp_size, "world_size": worker.world_size}


def _describe(layout: dict[str, Any], padded_vocab: Any) -> str:
    return (
        f"tp={layout.get('tp')}, dp={layout.get('dp')}, world size {layout.get('world_size')}, "
        f"padded vocabulary {padded_vocab}"
    )


# ---------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------


def save(worker: MegatronPolicyWorker, directory: str) -> dict[str, float]:
    """Write this rank's part of the checkpoint into ``directory``. Collective: every rank
    calls it with the same directory, on a filesystem all of them see.

    Reads the state only: the weights, the optimizer and the RNG states are as they were.
    Returns ``seconds`` and ``bytes`` this rank wrote (its RNG file, and on rank 0 the
    record; the dist checkpoint's files are counted by the caller).
    """
    from megatron.core import dist_checkpointing

    t0 = time.monotonic()
    root = Path(directory)
    for sub in (DIST_DIR, RNG_DIR):  # every rank: no rank waits for another's mkdir
        (root / sub).mkdir(exist_ok=True)
    rng_bytes = _write_bytes(rng_file(root, worker.rank), _serialize(capture_rng(worker)))
    optimizer_state = bool(worker.optimizer is not None and worker.optimizer.state)
    state = _sharded_state(worker, with_optimizer=optimizer_state)
    try:
        dist_checkpointing.save(state, str(root / DIST_DIR))
    except _failures() as err:
        raise _save_error(err, root / DIST_DIR) from err
    written = rng_bytes
    if worker.rank == 0:
        written += _write_bytes(root / META_NAME, json.dumps(_meta(worker, optimizer_state), indent=1).encode())
    return {"seconds": time.monotonic() - t0, "bytes": float(written)}


def _meta(worker: MegatronPolicyWorker, optimizer_state: bool) -> dict[str, Any]:
    from megatron.core import package_info

    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "layout": layout_of(worker),
        "model": dataclasses.asdict(worker.spec),
        "dtype": worker.dtype,
        "padded_vocab_size": padded_vocab(worker),
        "optimizer": type(worker.optimizer).__name__ if worker.optimizer is not None else None,
        "optimizer_state": optimizer_state,
        "megatron_core": package_info.__version__,
    }


def padded_vocab(worker: MegatronPolicyWorker) -> int:
    """The vocabulary this rank's model is built with (the embedding's global rows)."""
    return int(worker.spec.padded_vocab_size(worker.tp_size, worker.divisible))


def _write_bytes(path: Path, data: bytes) -> int:
    # Path.write_bytes raises an OSError that names the path (a full disk included);
    # torch.save into the file would raise a RuntimeError without it.
    path.write_bytes(data)
    return len(data)


def _serialize(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _failures() -> tuple[type[BaseException], ...]:
    """What a dist save or load raises when it fails: torch DCP's CheckpointException (a
    BaseException, gathering every rank's error) besides ordinary exceptions."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _save_error(err: BaseException, path: Path) -> BaseException:
    """An OSError naming ``path`` when the dist save failed on one (a full disk, on any
    rank: megatron-core wraps them); else ``err`` as it is."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, OSError):
            return OSError(e.errno, f"writing the Megatron checkpoint {path}: {e}", str(path))
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # torch DCP's CheckpointException: per rank
        if isinstance(failures, dict):
            todo += [x for x in failures.values() if isinstance(x, BaseException)]
    return err


# ---------------------------------------------------------------------------
# The sharded state dict
# ---------------------------------------------------------------------------


def _sharded_state(worker: MegatronPolicyWorker, *, with_optimizer: bool) -> dict[str, Any]:
    """The model's sharded state dict, and with ``with_optimizer`` the optimizer's: its
    moments as ShardedTensors sharded like their parameters, its step counts as plain
    (common) tensors. Views of the live tensors: saving copies nothing, loading writes
    into fresh state that :func:`load` then hands to the optimizer."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_state = worker.model.sharded_state_dict()
    state: dict[str, Any] = {"model": model_state}
    if not with_optimizer:
        return state
    optimizer = worker.optimizer
    assert optimizer is not None
    optim = optimizer.state_dict()  # a new dict over the live tensors: the optimizer is untouched
    # The scalar steps have no parameter's shape, so they cannot be sharded like one:
    # they are the same on every rank and go to common.pt as they are.
    steps = {pid: s["step"] for pid, s in optim["state"].items() if "step" in s}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state_to_sharding_state(
        optim, get_param_id_to_sharded_param_map(model_state, params), exclude_keys=("step",)
    )
    state["optimizer"] = optim
    state["optimizer_steps"] = steps
    return state


def _init_adamw_state(optimizer: Any) -> None:
    """Give every parameter of ``optimizer`` AdamW's moments (zeros), as its first step
    would: the templates that the checkpoint's moments load into (megatron-core's own
    optimizers do the same before loading)."""
    import torch

    if not isinstance(optimizer, torch.optim.AdamW):
        raise CheckpointError(
            f"the megatron policy's optimizer is {type(optimizer).__name__}; its training "
            "checkpoints hold AdamW state"
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The record of checkpoint ``directory``; :class:`CheckpointError` if it has none,
    or one of another format or version."""
    file = Path(directory) / META_NAME
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(
            f"{directory} is not a Megatron training checkpoint: {META_NAME} is missing "
            "(the save did not finish, or the directory is another backend's)"
        ) from err
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} cannot be read: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} checkpoint record")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: {FORMAT} version {meta.get('version')!r}; this rlcore-megatron "
            f"reads version {FORMAT_VERSION}"
        )
    return meta


def check_fits(worker: MegatronPolicyWorker, meta: dict[str, Any], directory: str) -> bool:
    """Raise :class:`CheckpointError` unless this rank's model can take the checkpoint;
    True when it was written at this very layout (RNG states restorable too)."""
    from rlcore_megatron.convert import ModelSpec

    want = dataclasses.asdict(worker.spec)
    got = dict(meta.get("model") or {})
    diff = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    if diff:
        named = ", ".join(f"{k}: checkpoint {a!r}, policy {b!r}" for k, (a, b) in sorted(diff.items()))
        raise CheckpointError(f"{directory} holds another model than this megatron policy ({named})")
    if meta.get("dtype") != worker.dtype:
        raise CheckpointError(
            f"{directory} was trained in {meta.get('dtype')}, this megatron policy runs "
            f"{worker.dtype} (model.dtype)"
        )
    ours, theirs = layout_of(worker), dict(meta.get("layout") or {})
    if meta.get("padded_vocab_size") != padded_vocab(worker):
        spec = ModelSpec(**got)
        raise CheckpointError(
            f"{directory} was written at {_describe(theirs, meta.get('padded_vocab_size'))}; "
            f"this megatron policy runs {_describe(ours, padded_vocab(worker))}. Its embedding "
            "cannot be resharded to another padded vocabulary: resume at the checkpoint's "
            "policy.options.tensor_model_parallel_size, or choose "
            "policy.options.make_vocab_size_divisible_by so that both pad "
            f"{spec.vocab_size} tokens alike"
        )
    return theirs == ours


def load(worker: MegatronPolicyWorker, directory: str) -> dict[str, Any]:
    """Restore this rank's training state from checkpoint ``directory``. Collective.

    Every check that can fail on a rank runs before the first collective and gives the
    same answer on every rank, so a refused checkpoint raises everywhere instead of
    leaving the other ranks waiting. Returns ``seconds`` and ``resharded`` (written at
    another layout: weights and moments resharded, RNG states kept).
    """
    from megatron.core import dist_checkpointing

    t0 = time.monotonic()
    root = Path(directory)
    refused: CheckpointError | None = None
    try:
        meta = read_meta(root)
        same_layout = check_fits(worker, meta, directory)
        rng = _read_rng(root, worker.rank) if same_layout else None
        if not (root / DIST_DIR / "metadata.json").is_file():
            raise CheckpointError(
                f"{root / DIST_DIR} is not a megatron-core distributed checkpoint (metadata.json missing)"
            )
    except CheckpointError as err:
        refused = err
    _agree(worker, refused, root)
    worker._before_step()  # a sleeping (colocated) policy's optimizer state comes back first
    with_optimizer = bool(meta.get("optimizer_state"))
    if with_optimizer:
        _init_adamw_state(worker.optimizer)
    template = _sharded_state(worker, with_optimizer=with_optimizer)
    try:
        loaded = dist_checkpointing.load(template, str(root / DIST_DIR))
    except _failures() as err:
        raise CheckpointError(
            f"loading the Megatron checkpoint {root / DIST_DIR} failed on rank {worker.rank}: "
            f"{type(err).__name__}: {err}"
        ) from err
    _load_model(worker.model, loaded["model"], root)
    _load_optimizer(worker, loaded if with_optimizer else None)
    if rng is not None:
        restore_rng(worker, rng)
    elif worker.rank == 0:
        log.warning(
            "%s was written at %s; this policy runs %s: weights and optimizer state resharded, "
            "the ranks keep their own RNG states",
            directory,
            _describe(dict(meta["layout"]), meta["padded_vocab_size"]),
            _describe(layout_of(worker), padded_vocab(worker)),
        )
    return {"seconds": time.monotonic() - t0, "resharded": not same_layout}


def _agree(worker: MegatronPolicyWorker, refused: CheckpointError | None, root: Path) -> None:
    """Raise on every rank when any refused the checkpoint (its own RNG file may be the
    only one missing): the others must not go on into the load's collectives alone, and
    every rank names the first refusal, whichever rank the driver hears from first."""
    import torch.distributed as dist

    if worker.world_size == 1:
        if refused is not None:
            raise refused
        return
    reasons: list[str | None] = [None] * worker.world_size
    dist.all_gather_object(reasons, None if refused is None else str(refused))
    first = next(((r, why) for r, why in enumerate(reasons) if why is not None), None)
    if first is not None:
        rank, why = first
        raise CheckpointError(f"rank {rank} refused {root}: {why}") from refused


def _load_model(model: Any, state: dict[str, Any], root: Path) -> None:
    from rlcore_megatron.checkpoint import load_model_state

    unfit = load_model_state(model, state)
    if unfit:
        raise CheckpointError(f"{root}: the checkpoint's weights do not fit the model ({unfit})")


def _load_optimizer(worker: MegatronPolicyWorker, loaded: dict[str, Any] | None) -> None:
    """Hand the loaded moments and steps to the optimizer; ``None``: the checkpoint was
    taken before the first step, so the optimizer has no state either."""
    optimizer = worker.optimizer
    assert optimizer is not None
    if loaded is None:
        optimizer.state.clear()
        return
    optim = loaded["optimizer"]
    for pid, step in loaded["optimizer_steps"].items():
        optim["state"][pid]["step"] = step
    optimizer.load_state_dict(optim)


# ---------------------------------------------------------------------------
# RNG states
# ---------------------------------------------------------------------------


def capture_rng(worker: MegatronPolicyWorker) -> dict[str, Any]:
    """This process's RNG states (:func:`rlcore.runtime.rng.capture`: torch CPU, CUDA, python
    ``random``, numpy) and megatron-core's tensor-parallel tracker (named states that dropout
    inside tensor-parallel regions draws from), as copies."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return {
        **rng_states.capture(),
        "tracker": {name: _state_tensor(s).clone() for name, s in tracker.get_states().items()},
    }


def _state_tensor(state: Any) -> Any:
    # A tracker's named state is a ByteTensor, or a torch.Generator where megatron-core
    # keeps graph-safe CUDA generators.
    return state.get_state() if hasattr(state, "get_state") else state


def restore_rng(worker: MegatronPolicyWorker, rng: dict[str, Any]) -> None:
    """Set the states :func:`capture_rng` took."""
    from megatron.core import tensor_parallel

    rng_states.restore(rng)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    states = {}
    for name, saved in rng["tracker"].items():
        live = current.get(name)
        if live is not None and hasattr(live, "set_state"):
            live.set_state(saved)
            states[name] = live
        else:
            states[name] = saved.clone()
    tracker.set_states(states)


def _read_rng(root: Path, rank: int) -> dict[str, Any]:
    import torch

    path = rng_file(root, rank)
    try:
        # weights_only: a checkpoint is data; tensors, lists and numbers are all it holds
        rng = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointError(f"{root}: rank {rank}'s RNG states are missing ({path})") from err
    except Exception as err:
        raise CheckpointError(f"{path} cannot be read: {type(err).__name__}: {err}") from err
    if not isinstance(rng, dict) or not {"torch", "python", "tracker"} <= set(rng):
        raise CheckpointError(f"{path} does not hold a rank's RNG states")
    return rng


def release() -> None:
    """Stop the process megatron-core's checkpoint writer started in this process for its
    results queue (a ``multiprocessing`` manager, kept in a module global for the process's
    lifetime); a rank's teardown calls it, so a worker leaves no process of its own behind.
    The writer's per-file processes end with each save."""
    filesystem_async = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if filesystem_async is None:  # no checkpoint writer was ever loaded here
        return
    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    filesystem_async._results_queue = None
    if manager is not None:
        try:
            manager.shutdown()
        except Exception as err:  # teardown must not raise
            log.debug("stopping megatron-core's checkpoint results queue failed: %s", err)

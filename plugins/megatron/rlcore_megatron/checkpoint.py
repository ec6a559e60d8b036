"""The converted Megatron checkpoint: its cache key, atomic publish and loading.

A Hugging Face checkpoint is converted once per (model, conversion options) and
shared by every worker group that needs it: the Megatron policy publishes it,
a Megatron generation that is not refit-fed waits for it. Both compute the
same :func:`checkpoint_key`, from the model directory and the *policy's*
options, and find it at ``<cache>/megatron.checkpoint/<key>``.

:func:`convert_and_publish` writes it through rlcore's atomic publish: the
conversion fills a private staging directory, the core marks it complete and
renames it into place. A converter killed at any moment leaves only a staging
directory (removed by the next publisher), never a destination that counts as
complete; concurrent converters of one key end with one published copy.

The conversion itself runs in ``tensor_model_parallel_size`` child processes
(``python -m rlcore_megatron._convert_worker``), one per tensor-parallel rank,
which build the local-spec ``GPTModel``, load their shards straight from the
safetensors files (one layer of Hugging Face tensors at a time) and write with
``megatron.core.dist_checkpointing.save`` in the ``torch_dist`` format. Child
processes keep megatron-core's global state and torch.distributed out of the
caller, and make the conversion cancellable: on cancellation or deadline they
are killed. They also die with their parent (``PR_SET_PDEATHSIG``).

Format of a published checkpoint directory: megatron-core's ``torch_dist``
files (``.metadata``, ``__*_*.distcp``, ``common.pt``, ``metadata.json``),
plus :data:`INFO_NAME` (conversion record, including the Hugging Face config),
plus the core's completion marker. ``torch_dist`` stores global tensors with
their shard offsets, so a checkpoint written at one tensor-parallel size loads
at another. Its ``.metadata`` records the absolute staging path it was written
to; loading does not use it, so loading after the rename works (tested).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlcore.errors import Cancelled, CancelToken, Deadline
from rlcore_megatron.convert import RECIPE_VERSION, ConversionError
from rlcore_megatron.options import CHECKPOINT_ARTIFACT, MegatronOptions

log = logging.getLogger(__name__)

#: Conversion record written beside the torch_dist files.
INFO_NAME = "rlcore_megatron.json"
#: Version of :data:`INFO_NAME`'s format.
INFO_FORMAT = 1
#: Scratch directory of a running conversion inside its output directory (logs, rendezvous).
WORK_DIR_NAME = ".rlcore-convert"

_SAFETENSORS_ENTRY = ("model.safetensors", "model.safetensors.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]+")

#: ``publish(destination, write) -> destination``: rlcore's atomic publish, bound to a
#: cancellation token and deadline (from a hook: ``ctx.publish_hook`` with them).
PublishFn = Callable[[Path, Callable[[Path], None]], Path]


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


def model_identity(model_dir: str | Path) -> str:
    """A digest of a Hugging Face checkpoint directory that changes when its content does.

    Covers the resolved path, the bytes of ``config.json`` and the name, size and
    modification time of every weight file (hashing the weights themselves would
    take minutes for a large model). The tiny model rlcore publishes in its cache
    has a content key in its directory name and is never rewritten, so this
    identifies it exactly too.
    """
    path = Path(model_dir).expanduser().resolve()
    h = hashlib.sha256()
    h.update(str(path).encode())
    try:
        h.update((path / "config.json").read_bytes())
    except OSError as err:
        raise ConversionError(
            f"{path} is not a Hugging Face checkpoint (config.json: {err})"
        ) from err
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name.endswith(_WEIGHT_SUFFIXES) and entry.is_file():
            st = entry.stat()
            h.update(f"\0{entry.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def checkpoint_key(
    model_dir: str | Path, options: MegatronOptions | None = None, *, dtype: str = "float32"
) -> str:
    """The cache key of the converted checkpoint of ``model_dir``.

    Policy and generation both call this with the **policy's** options (the ones
    the checkpoint is written with) and ``model.dtype``. The key is readable
    (model directory name, tensor-parallel size, dtype, recipe) and ends with a
    digest of the model's identity (:func:`model_identity`) and of every
    conversion option, so any change gives a new key.
    """
    options = options or MegatronOptions()
    opts = {
        "recipe": RECIPE_VERSION,
        "tp": int(options.tensor_model_parallel_size),
        "dtype": dtype,
        "make_vocab_size_divisible_by": int(options.make_vocab_size_divisible_by),
        "format": "torch_dist",
    }
    digest = hashlib.sha256(
        (model_identity(model_dir) + json.dumps(opts, sort_keys=True)).encode()
    ).hexdigest()[:16]
    name = _SAFE.sub("_", Path(model_dir).expanduser().resolve().name)[:48] or "model"
    return f"{name}-tp{opts['tp']}-{dtype}-r{RECIPE_VERSION}-{digest}"


def checkpoint_path(cache_root: str | Path, key: str) -> Path:
    """Where the checkpoint with ``key`` lives (``InitContext.artifact_path`` agrees)."""
    return Path(cache_root) / CHECKPOINT_ARTIFACT / key


# ---------------------------------------------------------------------------
# Converting into a directory (the ``write`` of atomic publish)
# ---------------------------------------------------------------------------


def _terminate(procs: list[subprocess.Popen[bytes]], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaps every process."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


def convert_to_directory(
    hf_dir: str | Path,
    out_dir: str | Path,
    options: MegatronOptions | None = None,
    *,
    dtype: str = "float32",
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
    poll_s: float = 0.05,
) -> dict[str, Any]:
    """Convert ``hf_dir`` into ``out_dir`` (an empty directory) with one process per TP rank.

    Blocks until done; raises :class:`Cancelled` / :class:`DeadlineExceeded`
    (after killing the converter processes) or :class:`ConversionError` naming
    the failing rank and the end of its log. Returns the conversion record
    (also written to ``out_dir/`` :data:`INFO_NAME`).
    """
    options = options or MegatronOptions()
    tp = int(options.tensor_model_parallel_size)
    if tp < 1:
        raise ConversionError(f"tensor_model_parallel_size must be >= 1, got {tp}")
    out = Path(out_dir)
    what = f"conversion of {hf_dir} to Megatron (tp={tp}, {dtype})"
    _check_convertible(hf_dir, tp)
    job = _conversion_job(hf_dir, out, options, dtype)
    # Logs and the rendezvous file live inside the output (staging) directory, so a
    # killed conversion leaves them where the next publisher cleans up; removed on success.
    # Rendezvous through a file: no port to pick or race for.
    logs = out / WORK_DIR_NAME
    logs.mkdir(parents=True, exist_ok=True)
    job["init_method"] = (logs / "rendezvous").as_uri()
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    try:
        _spawn_converters(job, logs, procs)
        _wait_converters(procs, logs, what, cancel=cancel, deadline=deadline, poll_s=poll_s)
    except BaseException:
        _terminate(procs)
        raise
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    info = read_info(out)
    log.info("%s took %.2fs", what, time.monotonic() - t0)
    return info


def _check_convertible(hf_dir: str | Path, tp: int) -> None:
    """Fail fast, before paying for processes that import megatron-core."""
    from rlcore_megatron.convert import ModelSpec

    ModelSpec.from_hf(hf_dir).check_tp(tp)
    if not any((Path(hf_dir) / n).is_file() for n in _SAFETENSORS_ENTRY):
        raise ConversionError(
            f"{hf_dir} has no model.safetensors or model.safetensors.index.json "
            "(only safetensors checkpoints are supported)"
        )


def _conversion_job(
    hf_dir: str | Path, out: Path, options: MegatronOptions, dtype: str
) -> dict[str, Any]:
    """What every converter process is told (:mod:`rlcore_megatron._convert_worker`)."""
    return {
        "hf_dir": str(Path(hf_dir).expanduser().resolve()),
        "out_dir": str(out.resolve()),
        "tp": int(options.tensor_model_parallel_size),
        "dtype": dtype,
        "make_vocab_size_divisible_by": int(options.make_vocab_size_divisible_by),
        "seed": int(options.seed),
        "timeout_s": float(options.timeout_s),
        "parent_pid": os.getpid(),
    }


def _spawn_converters(
    job: dict[str, Any], logs: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Start one converter per tensor-parallel rank, each logging to ``logs/rank<r>.log``;
    appended to ``procs`` as they start, so the caller ends those started before a failure."""
    for rank in range(job["tp"]):
        log_file = open(logs / f"rank{rank}.log", "wb")  # closed below, once inherited
        try:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "rlcore_megatron._convert_worker",
                        str(rank),
                        json.dumps(job),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"},
                )
            )
        finally:
            log_file.close()


def _wait_converters(
    procs: list[subprocess.Popen[bytes]],
    logs: Path,
    what: str,
    *,
    cancel: CancelToken | None,
    deadline: Deadline | None,
    poll_s: float,
) -> None:
    """Wait until every converter exits 0; on a failure, cancellation or deadline, end
    them all and raise (a failure names the rank and the end of its log)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r = failed[0]
            _terminate(procs)
            raise ConversionError(
                f"{what}: converter rank {r} exited with code {codes[r]}; its log ends with:\n"
                + _tail(logs / f"rank{r}.log")
            )
        if all(c == 0 for c in codes):
            return
        if cancel is not None and cancel.cancelled:
            _terminate(procs)
            raise Cancelled(f"{what} cancelled: {cancel.reason}")
        if deadline is not None and deadline.expired:
            _terminate(procs)
            deadline.raise_if_expired(what)
        if cancel is not None:
            cancel.sleep(poll_s)
        else:
            time.sleep(poll_s)


def convert_and_publish(
    hf_dir: str | Path,
    cache_root: str | Path,
    options: MegatronOptions | None = None,
    *,
    dtype: str = "float32",
    cancel: CancelToken | None = None,
    deadline: Deadline | None = None,
    publish: PublishFn | None = None,
) -> Path:
    """Publish the converted checkpoint of ``hf_dir`` at ``<cache_root>/megatron.checkpoint/<key>``.

    If it is already published, returns at once without converting. Otherwise
    converts into the private staging directory that atomic publish gives
    (:func:`convert_to_directory`) and returns the published path; concurrent
    callers for the same key all return that path, and exactly one conversion
    is published. A caller that finds another live converter of this host at
    work on the key waits for its result instead of converting too, and
    converts only if that one fails or dies (:func:`rlcore.publish.publish_dir`).

    Args:
        hf_dir: Hugging Face checkpoint directory (safetensors).
        cache_root: the shared artifact cache (``InitContext.cache_dir``).
        options: the policy's backend options (tensor-parallel size etc.).
        dtype: parameter dtype of the converted checkpoint (``model.dtype``).
        cancel, deadline: observed while converting and while publishing.
        publish: ``publish(destination, write)``; by default
            :func:`rlcore.publish.publish_dir` with ``cancel`` and ``deadline``.
            From an init hook, route it through the ``rlcore_publish`` hook.
    """
    options = options or MegatronOptions()
    destination = checkpoint_path(cache_root, checkpoint_key(hf_dir, options, dtype=dtype))

    def write(staging: Path) -> None:
        convert_to_directory(
            hf_dir, staging, options, dtype=dtype, cancel=cancel, deadline=deadline
        )

    if publish is None:
        from rlcore.publish import publish_dir

        return publish_dir(destination, write, cancel=cancel, deadline=deadline)
    return Path(publish(destination, write))


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def read_info(path: str | Path) -> dict[str, Any]:
    """The conversion record of a converted checkpoint directory."""
    file = Path(path) / INFO_NAME
    try:
        info = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConversionError(
            f"{path} is not a converted Megatron checkpoint ({file}: {err})"
        ) from err
    if info.get("format") != INFO_FORMAT:
        raise ConversionError(
            f"{file}: unknown format {info.get('format')!r} (expected {INFO_FORMAT})"
        )
    return info


def load_checkpoint(model: Any, path: str | Path) -> None:
    """Load a converted checkpoint into a local-spec ``GPTModel`` (any tensor-parallel size).

    Collective over the model's ranks: every rank calls it. megatron-core
    reshards ``torch_dist`` checkpoints written at another tensor-parallel size.
    """
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(path))
    unfit = load_model_state(model, state)
    if unfit:
        raise ConversionError(f"{path}: checkpoint does not fit the model ({unfit})")


def load_model_state(model: Any, state: dict[str, Any]) -> str | None:
    """Copy a loaded (dist checkpoint) state into ``model``'s parameters in place; what did
    not fit (``missing [...], unexpected [...]``), or None. megatron-core's ``_extra_state``
    entries (Transformer Engine's; empty in the local spec) are not weights."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    return f"missing {missing}, unexpected {unexpected}" if missing or unexpected else None

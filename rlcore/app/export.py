"""``rlcore export DIR [--step N] --to HF_DIR``: a training checkpoint as a Hugging Face model.

Reads top to bottom:

1. :func:`find_checkpoint`: the checkpoint to export, before anything starts: ``--step N``,
   else the newest one whose files match their digests (a newer one that does not is
   named with why); the checkpoint's own ``config.yaml`` is the config.
2. :func:`start_policy`: a Ray cluster as a run starts it (``cluster.*``; embedded by
   default) and the policy backend alone (:func:`rlcore.setup.prepared.prepare_role`: no
   generation, no env, no refit), through the same setup runner, context and teardown.
3. ``load_checkpoint`` of the policy handle, then every weight by its Hugging Face name
   through the core's refit into a capture actor (:func:`rlcore.refit.capture.capture_export`):
   the weights an engine would get, whichever backend trained them.
4. :func:`write_model`: the model's Hugging Face files (``config.json``, tokenizer,
   ``generation_config.json``, any custom code) beside ``model.safetensors`` (sharded when
   large), published at ``HF_DIR`` atomically (:func:`rlcore.publish.publish_dir`): an export
   that fails or is killed leaves nothing there that looks complete.

Nothing here names a backend: any policy that implements the checkpoint contract
(:class:`rlcore.handles.Checkpointable`) and sends HF-named weights exports.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.app.checkpoints import POLICY_DIR, Chosen, Found, newest_whole, scan, step_of, verify
from rlcore.config import RunConfig, cache_dir, load_config
from rlcore.declarations import Role
from rlcore.errors import CancelToken, CheckpointError, ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from rlcore.handles import Pair
    from rlcore.setup.prepared import PreparedRun

log = logging.getLogger(__name__)

__all__ = ["Exported", "export_checkpoint", "find_checkpoint", "start_policy", "write_adapter", "write_model"]

#: Files of a Hugging Face model directory that hold weights: the export writes its own.
_WEIGHT_FILE = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.h5|\.msgpack|\.index\.json)$")
#: Largest ``model-0000i-of-0000n.safetensors`` shard (transformers' own default).
MAX_SHARD = "5GB"


@dataclass(frozen=True)
class Exported:
    """A finished export.

    Attributes:
        path: the Hugging Face model directory written.
        selected: the checkpoint it came from.
        files: the files written, by name.
        logprobs: the restored policy's per-token logprobs of the ``probe`` pairs given to
            :func:`export_checkpoint` (to hold the written model to the policy it came from).
    """

    path: Path
    selected: Chosen
    files: list[str]
    logprobs: list[list[float]] = field(default_factory=list)


# ---------------------------------------------------------------- which checkpoint


def checkpoint_root(directory: Path) -> tuple[Path, int | None]:
    """Where ``DIR`` keeps its checkpoints, and the step it names if it is one checkpoint:
    a step directory, a run directory (its ``checkpoint.dir``, else ``checkpoints/``), or a
    checkpoints root itself."""
    from rlcore.app.resume import checkpoint_root as run_checkpoints

    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"rlcore export {directory}: no such directory", key="DIR")
    named = step_of(directory)
    if named is not None:
        return directory.parent, named
    if (directory / "checkpoints").is_dir() or not (directory / "config.yaml").is_file():
        return (directory / "checkpoints" if (directory / "checkpoints").is_dir() else directory), None
    return run_checkpoints(load_config(directory / "config.yaml"), directory), None


def find_checkpoint(directory: Path, step: int | None = None) -> Chosen:
    """The checkpoint to export from ``directory`` (module doc, step 1).

    Raises:
        ConfigError: ``--step`` names no checkpoint there, or one that is incomplete or
            corrupt (naming the steps there); none there verifies (naming each and why).
    """
    root, named = checkpoint_root(directory)
    if named is not None and step is not None and step != named:
        raise ConfigError(f"--step {step} but {directory} is the checkpoint of step {named}", key="--step")
    step = named if step is None else step
    found = scan(root)
    if step is not None:
        return Chosen(_the_step(found, step, root))
    newest, skipped = newest_whole(found)
    if newest is not None:
        return Chosen(newest, skipped)
    what = f"found {', '.join(skipped)}" if skipped else "it holds no checkpoint"
    raise ConfigError(
        f"nothing to export in {root}: {what}. A run saves checkpoints with checkpoint.every_steps=N",
        key="DIR",
    )


def _the_step(found: Sequence[Found], step: int, root: Path) -> Found:
    there = ", ".join(f.describe() for f in found) or "none"
    for f in found:
        if f.step == step:
            problem = verify(f)
            if problem is None:
                return f
            raise ConfigError(f"--step {step}: {f.path} is unusable: {problem}; checkpoints there: {there}", key="--step")
    raise ConfigError(f"--step {step}: no checkpoint of step {step} in {root}; checkpoints there: {there}", key="--step")


def check_target(to: Path) -> Path:
    """``--to``: a new or empty directory (an export never mixes its files with others)."""
    to = Path(to).expanduser()
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ConfigError(f"--to {to} exists and is not empty; give a new directory", key="--to")
    return to


def checkpoint_config(selected: Chosen) -> RunConfig:
    """The run's config as the checkpoint saved it."""
    path = selected.found.path / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{selected.found.path} has no config.yaml (not an rlcore checkpoint)", key="DIR")
    return load_config(path)


# ---------------------------------------------------------------- the policy alone


@contextmanager
def start_policy(prepared: PreparedRun, work_dir: Path, cancel: CancelToken, console: Console) -> Iterator[Any]:
    """The cluster and the policy backend, started as a run starts them; both torn down
    (bounded: ``setup.shutdown_timeout_s``, the cluster's own exit wait) when the block
    is left, whatever it is left with (a signal cancels ``cancel`` first)."""
    from rlcore.runtime.cluster import Cluster
    from rlcore.runtime.join import choose_cluster
    from rlcore.setup.runner import SetupResult, run_prepared

    config = prepared.config
    choice = choose_cluster(config.cluster)
    console.print(f"cluster: {choice.describe()}")
    cluster = Cluster(config.cluster, choice)
    setup: SetupResult | None = None
    try:
        with console.status("starting Ray cluster"):
            cluster.start()
            devices = cluster.reserve_devices(config)
        with console.status(f"starting policy backend {config.policy.backend}"):
            setup = run_prepared(
                prepared, run_dir=work_dir, cancel=cancel, network=cluster.network(config), devices=devices
            )
        yield setup.handles[Role.POLICY.value]
    except BaseException as err:
        cancel.cancel(f"export stopped: {type(err).__name__}")
        raise
    finally:
        if setup is not None:
            for line in setup.shutdown():
                console.print(f"[yellow]shutdown: {line}[/yellow]")
        cluster.shutdown()


def capture_weights(policy: Any, prepared: PreparedRun, step: int, cancel: CancelToken) -> dict[str, Any]:
    """Every weight of ``policy`` by Hugging Face name, as a refit sends it (CPU tensors)."""
    from rlcore.refit.capture import capture_export, file_transport_first
    from rlcore.refit.sessions import RefitSessions
    from rlcore.setup.planner import detect_accelerator
    from rlcore.setup.runner import refit_context

    config = prepared.config
    decl = prepared.declarations[Role.POLICY]
    transport = file_transport_first(decl.send_transports, detect_accelerator())
    if transport is None:
        raise CheckpointError(
            f"policy backend '{decl.name}' sends its weights over no transport the core runs on this "
            f"host ({', '.join(map(str, decl.send_transports)) or 'none declared'}): nothing can take them"
        )
    ctx = refit_context(config, step=step, transport=transport, cancel=cancel, sessions=RefitSessions())
    return capture_export(policy, ctx)


# ---------------------------------------------------------------- the model directory


def write_model(staging: Path, weights: Mapping[str, Any], model_dir: Path, max_shard: str = MAX_SHARD) -> list[str]:
    """Fill ``staging`` with a Hugging Face model: ``model_dir``'s files but its weights
    (config, tokenizer, generation config, custom code), then ``weights`` as safetensors
    (``model.safetensors``, or shards and their index past ``max_shard``). The config's
    ``torch_dtype`` is the weights' own. Returns the file names written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    for src in sorted(Path(model_dir).iterdir()):
        if src.is_file() and not _WEIGHT_FILE.search(src.name) and not src.name.startswith("."):
            shutil.copy2(src, staging / src.name)
    _set_dtype(staging / "config.json", weights)
    split = split_torch_state_dict_into_shards(
        dict(weights), filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard
    )
    for filename, names in split.filename_to_tensors.items():
        shard = {n: weights[n].contiguous() for n in names}
        save_file(shard, str(staging / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": _total_bytes(weights)}, "weight_map": split.tensor_to_filename}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return sorted(p.name for p in staging.iterdir())


def _total_bytes(weights: Mapping[str, Any]) -> int:
    return sum(int(t.numel()) * int(t.element_size()) for t in weights.values())


def _set_dtype(config_json: Path, weights: Mapping[str, Any]) -> None:
    """``torch_dtype`` of ``config.json``: the dtype the floating weights were saved in."""
    dtypes = {str(t.dtype).removeprefix("torch.") for t in weights.values() if t.is_floating_point()}
    if len(dtypes) != 1 or not config_json.is_file():
        return
    data = json.loads(config_json.read_text(encoding="utf-8"))
    data["torch_dtype"] = dtypes.pop()
    config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- the command


def export_checkpoint(
    directory: Path,
    to: Path,
    *,
    step: int | None = None,
    console: Console | None = None,
    probe: Sequence[Pair] = (),
    extra_plugins: Sequence[tuple[str, Any]] = (),
    adapter: bool = False,
) -> Exported:
    """Export a checkpoint of ``directory`` to the Hugging Face model directory ``to``
    (module doc). Signals are the caller's to route (the CLI's
    :class:`~rlcore.app.interrupts.SignalGuard`): an interrupt tears everything down.
    ``adapter``: write the trained LoRA adapters as a peft adapter directory instead
    (``adapter_model.safetensors``, ``adapter_config.json`` naming the base model), for a
    policy that trained them (:class:`rlcore.handles.AdapterSource`).

    Raises:
        ConfigError: bad input, before anything started (no such checkpoint, ``to`` not
            empty, a config or policy backend that cannot load it).
        RlcoreError: the policy's start, its load or the capture failed; torn down.
    """
    from rich.console import Console

    from rlcore.publish import publish_dir
    from rlcore.setup.prepared import prepare_role
    from rlcore.setup.registry import load_registry

    console = console or Console(highlight=False, soft_wrap=True)
    to = check_target(to)
    selected = find_checkpoint(directory, step)
    config = checkpoint_config(selected)
    _say_selected(console, selected)
    prepared = prepare_role(config, load_registry(config.plugins.allow, extra=extra_plugins), Role.POLICY)
    _check_format(prepared, selected)
    if adapter:
        _check_adapters(prepared)
    cancel = CancelToken()
    with tempfile.TemporaryDirectory(prefix="rlcore-export-") as work:
        with start_policy(prepared, Path(work), cancel, console) as policy:
            weights, logprobs, adapter_config = _restore_and_capture(
                policy, prepared, selected, cancel, console, probe, adapter=adapter
            )
        model_dir = _model_dir(config, cancel)
        t0 = time.monotonic()
        with console.status(f"writing {to}"):
            written: list[str] = []
            if adapter:
                write = lambda d: written.extend(write_adapter(d, weights, adapter_config, model_dir))  # noqa: E731
            else:
                write = lambda d: written.extend(write_model(d, weights, model_dir))  # noqa: E731
            publish_dir(to, write, cancel=cancel)
    console.print(f"wrote {to} ({len(weights)} tensors, {_total_bytes(weights) / 2**20:.1f} MiB in "
                  f"{time.monotonic() - t0:.1f}s): {', '.join(written)}")
    return Exported(to, selected, written, logprobs)


def _say_selected(console: Console, selected: Chosen) -> None:
    skipped = f"; skipped {', '.join(selected.skipped)}" if selected.skipped else ""
    console.print(f"exporting {selected.found.path} (step {selected.step}){skipped}")


def _check_format(prepared: PreparedRun, selected: Chosen) -> None:
    """The checkpoint's policy format is one this policy backend loads (else refused now)."""
    from rlcore.app.resume import policy_format

    fmt = policy_format(prepared)
    saved = (selected.found.manifest or {}).get("policy") or {}
    refusal = "it declares no checkpoints" if fmt is None else fmt.refusal(saved)
    if refusal is not None:
        raise ConfigError(
            f"policy backend '{prepared.config.policy.backend}' cannot load {selected.found.path}: {refusal}",
            key="policy.backend",
        )


def _restore_and_capture(
    policy: Any, prepared: PreparedRun, selected: Chosen, cancel: CancelToken, console: Console,
    probe: Sequence[Pair], *, adapter: bool = False,
) -> tuple[dict[str, Any], list[list[float]], dict[str, Any]]:
    """Load the checkpoint into the started policy and take its weights, or its adapters
    and their config with ``adapter`` (and the probe's logprobs, when asked) before it is
    torn down."""
    from rlcore.handles import AdapterSource

    t0 = time.monotonic()
    with console.status(f"loading the checkpoint of step {selected.step}"):
        policy.load_checkpoint(str(selected.found.path / POLICY_DIR))
    console.print(f"loaded the checkpoint of step {selected.step} in {time.monotonic() - t0:.1f}s")
    logprobs = [list(row) for row in policy.logprobs(list(probe))] if probe else []
    t0 = time.monotonic()
    if adapter:
        if not isinstance(policy, AdapterSource):
            raise ConfigError(
                f"policy backend '{prepared.config.policy.backend}' gives no adapters "
                "(rlcore.handles.AdapterSource); export without --adapter for the merged model",
                key="policy.backend",
            )
        with console.status("taking the adapters"):
            tensors, adapter_config = policy.adapter_state()
        console.print(f"took {len(tensors)} adapter tensors in {time.monotonic() - t0:.1f}s")
        return dict(tensors), logprobs, dict(adapter_config)
    with console.status("taking the weights by Hugging Face name"):
        weights = capture_weights(policy, prepared, selected.step, cancel)
    console.print(f"took {len(weights)} weights in {time.monotonic() - t0:.1f}s")
    return weights, logprobs, {}


def _check_adapters(prepared: PreparedRun) -> None:
    """``--adapter`` only for a run whose policy trained adapters (refused before start)."""
    from rlcore.lora import requested_lora

    decl = prepared.declarations[Role.POLICY]
    if not decl.trains_adapters or not requested_lora(prepared.config.policy.options):
        raise ConfigError(
            f"rlcore export --adapter: the checkpoint's run trained every weight (policy backend "
            f"'{decl.name}', no policy.options.lora); export without --adapter for the model",
            key="policy.options.lora",
        )


def write_adapter(
    staging: Path, tensors: Mapping[str, Any], config: Mapping[str, Any], model_dir: Path
) -> list[str]:
    """Fill ``staging`` with a peft adapter directory: ``adapter_model.safetensors`` and
    ``adapter_config.json`` whose ``base_model_name_or_path`` is ``model_dir`` (the model the
    run started from); peft's ``PeftModel.from_pretrained(base, staging)`` loads it. Returns
    the file names written."""
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors.items()}, str(staging / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    data = {**config, "base_model_name_or_path": str(Path(model_dir).resolve())}
    (staging / "adapter_config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return sorted(p.name for p in staging.iterdir())


def _model_dir(config: RunConfig, cancel: CancelToken) -> Path:
    """The model's Hugging Face files: ``model.path``, or the model rlcore made (cached)."""
    from rlcore.models.tiny import ensure_model

    return ensure_model(config.model, cache_dir(config), cancel=cancel)


"""Every check that needs no cluster, run before anything starts.

:func:`check_before_start` is what ``rlcore run`` and ``rlcore plan`` both call
after loading the config (which already checked keys, types and ranges, see
:func:`rlcore.config.validate_run_config`). It starts no process, imports no
heavy dependency and reads only small files, so a bad input fails in well under
a second with one line that names the key and the fix:

1. the selected backends exist and serve their roles, their options are valid, the
   declarations make a plan (refit transport included), ``grpo.max_staleness`` is
   one the policy backend declares and the placement lets overlap
   (:func:`rlcore.setup.schedule.plan_schedule`), and ``setup.task_deadline_s``
   names tasks of that plan: the run is prepared once (:func:`rlcore.setup.prepared.prepare`),
   and what this returns is what setup runs;
2. ``generation.on_worker_loss: replace`` is not asked of a run whose env holds the
   generation's endpoint;
3. ``model.path`` is a loadable Hugging Face checkpoint: ``config.json`` parses,
   a tokenizer is there, and every safetensors file's header is read and its
   size compared with what the header says (a truncated file is named);
4. the policy and generation workers fit the embedded cluster's CPUs (or GPUs)
   when the run joins no cluster (Ray would otherwise wait forever), and
   ``placement.nodes`` is asked only of a joined cluster, in Ray's terms (a cluster to
   join is asked by the app, through its GCS, before the run directory is written:
   :func:`check_joined_resources`);
5. each logger ``logging.*`` enables has its packages installed (:func:`check_loggers`);
6. the output directory and the cache directory can be created and written (a few KiB are
   written and removed, so a full disk is found here); a given ``--out`` is checked by the
   app (:func:`rlcore.app.rundir.check_run_dir`, the same write check and whether it holds
   another run's results).

Every failure is a :class:`~rlcore.errors.ConfigError` with a one-line message.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rlcore.config import RunConfig, cache_dir
from rlcore.config.placement import RESOURCE_ROLES, device_layout
from rlcore.declarations import Role
from rlcore.errors import ConfigError
from rlcore.runtime.join import choose_cluster
from rlcore.setup.prepared import PreparedRun, prepare

if TYPE_CHECKING:
    from rlcore.config.placement import NodeInfo
    from rlcore.runtime.join import ClusterFacts
    from rlcore.setup.plan import Plan
    from rlcore.setup.registry import Registry

#: Largest safetensors header read (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 * 2**20
#: Files that make a directory a loadable tokenizer for transformers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def one_line(message: str) -> str:
    """``message`` as one line (a line that ends a sentence is followed by a space, any
    other by ``; ``): errors found before start are printed as one line."""
    out = ""
    for part in (p.strip() for p in str(message).splitlines()):
        if part:
            out += (" " if out.endswith(".") else "; ") * bool(out) + part
    return out


def check_before_start(
    config: RunConfig,
    registry: Registry,
    *,
    output_dir: bool = True,
    accelerator: str | None = None,
) -> PreparedRun:
    """Run every check that needs no cluster; return the run, prepared once.

    Args:
        config: the loaded config (keys, types and ranges already checked).
        registry: the loaded plugins.
        output_dir: check that ``output_dir`` can be written (a run that writes a new
            timestamped directory there); ``False`` when the run directory is a given
            ``--out``, which the app checks (:func:`rlcore.app.rundir.check_run_dir`).
        accelerator: ``cuda`` or ``cpu``; ``None`` detects it (without torch).

    Raises:
        ConfigError: one line naming the key at fault and what to do.
    """
    prepared = prepare_checked(config, registry, accelerator=accelerator)
    check_worker_loss(config, prepared.plan)
    check_model(config)
    check_resources(config)
    check_placement(config)
    check_checkpoints(prepared)
    check_loggers(config)
    if output_dir:
        check_writable_dir(Path(config.output_dir).expanduser(), key="output_dir")
    check_writable_dir(cache_dir(config), key="setup.cache_dir (or $RLCORE_CACHE_DIR)")
    return prepared


def check_checkpoints(prepared: PreparedRun, *, resume: bool = False) -> None:
    """A run that saves checkpoints (``checkpoint.every_steps``) or resumes from one needs a
    policy backend that declares them; ``checkpoint.dir``, when given, must be writable."""
    config = prepared.config
    if config.checkpoint.every_steps == 0 and not resume:
        return
    info = prepared.backends.get(Role.POLICY)
    if info is not None and (info.declaration is None or info.declaration.checkpoint is None):
        key = "--resume" if resume else "checkpoint.every_steps"
        raise ConfigError(
            f"{key}: policy backend '{config.policy.backend}' ({info.origin()}) declares no "
            "checkpoints (CheckpointSupport); use a policy backend that does (`rlcore plugins` "
            "lists them)" + ("" if resume else ", or set checkpoint.every_steps=0"),
            key=key,
        )
    if config.checkpoint.dir:
        check_writable_dir(Path(config.checkpoint.dir).expanduser(), key="checkpoint.dir")


# ---------------------------------------------------------------- plan


def check_plan(config: RunConfig, registry: Registry, *, accelerator: str | None = None) -> Plan:
    """The plan of the run :func:`prepare_checked` prepares."""
    return prepare_checked(config, registry, accelerator=accelerator).plan


def prepare_checked(config: RunConfig, registry: Registry, *, accelerator: str | None = None) -> PreparedRun:
    """The run prepared (:func:`rlcore.setup.prepared.prepare`: backends, options, plan,
    task deadlines), with every backend, option and transport error as one line."""
    from rlcore.errors import BackendNotFoundError, PlanError
    from rlcore.setup.planner import selected_roles

    try:
        return prepare(config, registry, accelerator=accelerator)
    except BackendNotFoundError as err:
        key = next(
            (f"{r.value}.backend" for r in selected_roles(config) if f"'{r.value}.backend'" in str(err)),
            None,
        )
        raise ConfigError(one_line(str(err)), key=key) from err
    except ConfigError as err:
        if "\n" in str(err):
            raise ConfigError(one_line(str(err)), key=err.key) from err
        raise
    except PlanError as err:
        chosen = ", ".join(
            f"{r.value}.backend={getattr(config, r.value).backend}" for r in selected_roles(config)
        )
        raise ConfigError(
            f"the backends the config selects ({chosen}) cannot run together: {one_line(str(err))}",
            key=None,
        ) from err


def check_worker_loss(config: RunConfig, plan: Plan) -> None:
    """``generation.on_worker_loss: replace`` needs no env that holds the generation's
    endpoint: the replaced engine serves at a new address the env would never learn."""
    from rlcore.declarations import ENDPOINT_EVENT

    if config.generation.on_worker_loss != "replace":
        return
    for wait in plan.waits:
        if wait.kind == "event" and wait.target == ENDPOINT_EVENT:
            raise ConfigError(
                f"config key 'generation.on_worker_loss' is 'replace', but {wait.task} "
                f"({config.env.backend}) talks to the generation through its endpoint, which a "
                "replaced engine serves at a new address; set generation.on_worker_loss=abort",
                key="generation.on_worker_loss",
            )


# ---------------------------------------------------------------- model


def check_model(config: RunConfig) -> None:
    """``model.path`` (when set) is a Hugging Face checkpoint that loads: config, tokenizer,
    weights whose safetensors headers match their sizes. Reads headers only."""
    if config.model.path is None:
        return  # the tiny model, made locally during setup
    key = "model.path"
    raw = config.model.path
    path = Path(raw).expanduser()
    fix = "set model.path to a Hugging Face checkpoint directory, or null for the tiny local model"
    if not path.exists():
        raise ConfigError(f"config key '{key}' is '{raw}', which does not exist; {fix}", key=key)
    if not path.is_dir():
        raise ConfigError(f"config key '{key}' is '{raw}', which is not a directory; {fix}", key=key)
    config_json = path / "config.json"
    if not config_json.is_file():
        raise ConfigError(
            f"config key '{key}' is '{raw}', which has no config.json (not a Hugging Face "
            f"checkpoint); {fix}",
            key=key,
        )
    try:
        model_cfg = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"config key '{key}': {config_json} does not parse as JSON ({err}); {fix}", key=key) from None
    if not isinstance(model_cfg, dict) or "model_type" not in model_cfg:
        raise ConfigError(
            f"config key '{key}': {config_json} has no 'model_type', so transformers cannot "
            f"load it; {fix}",
            key=key,
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"config key '{key}': '{raw}' has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer beside the weights (tokenizer.save_pretrained)",
            key=key,
        )
    for shard in _weight_files(path, key):
        check_safetensors(shard, key=key)


def _weight_files(path: Path, key: str) -> list[Path]:
    """The safetensors files of a checkpoint (those its index names, else all of them)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(
                f"config key '{key}': {index} is not a safetensors index ({type(err).__name__}: "
                f"{err}); re-save the checkpoint",
                key=key,
            ) from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ConfigError(
                f"config key '{key}': {index} names {len(missing)} missing weight file(s), "
                f"e.g. {path / missing[0]}; copy the whole checkpoint",
                key=key,
            )
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files and not list(path.glob("pytorch_model*.bin")):
        raise ConfigError(
            f"config key '{key}': '{path}' has no weights (*.safetensors or pytorch_model*.bin); "
            "copy the whole checkpoint",
            key=key,
        )
    return files


def check_safetensors(file: Path, *, key: str = "model.path") -> None:
    """Read ``file``'s safetensors header and compare the size it implies with the file's.

    Raises :class:`ConfigError` naming the file for a short header, a header that is
    not JSON, bad offsets, or a file shorter or longer than its header says.
    """
    fix = "the file is damaged: copy or convert the checkpoint again"
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
                raise ConfigError(
                    f"config key '{key}': weight file {file} is truncated or not safetensors "
                    f"({size} bytes, no valid header); {fix}",
                    key=key,
                )
            header = json.loads(f.read(n))
    except OSError as err:
        raise ConfigError(f"config key '{key}': cannot read weight file {file}: {err.strerror or err}", key=key) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(
            f"config key '{key}': weight file {file} has a safetensors header that is not JSON; {fix}",
            key=key,
        ) from None
    end = 0
    try:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, stop = entry["data_offsets"]
            if not 0 <= begin <= stop:
                raise ValueError(f"tensor '{name}' has offsets {begin}..{stop}")
            end = max(end, int(stop))
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(
            f"config key '{key}': weight file {file} has a malformed safetensors header ({err}); {fix}",
            key=key,
        ) from None
    expected = 8 + n + end
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise ConfigError(
            f"config key '{key}': weight file {file} is {what}: {size} bytes, its header "
            f"describes {expected}; {fix}",
            key=key,
        )


# ---------------------------------------------------------------- resources


def host_cpus() -> int:
    """CPUs an embedded Ray cluster would offer here: this process's CPU affinity, capped
    by a cgroup (v2) CPU quota, as Ray counts them."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def host_gpus() -> int:
    """NVIDIA GPUs an embedded Ray cluster would detect here (without importing torch)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)])
    except OSError:
        return 0


def check_resources(config: RunConfig) -> None:
    """The policy and generation workers fit the cluster, counted as Ray will count them.

    On GPUs the count is the run's placement group (:func:`rlcore.config.placement.device_layout`):
    shares Ray cannot place are refused, and its GPUs are held against the embedded
    cluster's. On a CPU-only cluster each worker reserves ``devices_per_worker`` CPUs; the groups
    are up at the same time, so their needs add up. A joined cluster (``cluster.address``)
    is checked once joined, when its bundles are reserved.
    """
    gpus = cluster_gpus(config)
    if gpus is None:
        return  # a joined cluster: checked once joined (rlcore.runtime.cluster.reserve_devices)
    if gpus >= 1:
        layout = device_layout(config)  # refuses shares Ray cannot place
        if layout.gpus <= gpus:
            return
        have_key = "cluster.num_gpus"
        where = "" if config.cluster.num_gpus is not None else ", this host"
        roles = " + ".join(
            f"{r}.workers={getattr(config, r).workers} x {getattr(config, r).devices_per_worker:g} GPU"
            for r in RESOURCE_ROLES
        )
        fix = (
            "lower the workers" if layout.colocated
            else "set placement.colocated=true with policy.devices_per_worker=0.5 and "
            "generation.devices_per_worker=0.5 to share GPUs, lower the workers"
        )
        raise ConfigError(
            f"config key 'policy.workers': the {'colocated' if layout.colocated else 'separate'} "
            f"GPU bundles of the workers need {layout.gpus} GPU ({roles}: "
            f"{'; '.join(layout.lines())}), but the embedded Ray cluster has {gpus} "
            f"({have_key}{where}); {fix}, or raise {have_key}",
            key="policy.workers",
        )
    have, have_key = config.cluster.num_cpus or host_cpus(), "cluster.num_cpus"
    need = [(role, getattr(config, role).workers * getattr(config, role).devices_per_worker) for role in RESOURCE_ROLES]
    total = sum(n for _, n in need)
    if total > have + 1e-9:
        parts = " + ".join(
            f"{r}.workers={getattr(config, r).workers} x {getattr(config, r).devices_per_worker:g}"
            for r, _ in need
        )
        worst = max(need, key=lambda rn: rn[1])[0]
        raise ConfigError(
            f"config key '{worst}.workers': the workers need {total:g} CPU ({parts}), but the "
            f"embedded Ray cluster has {have:g} ({have_key}"
            f"{'' if config.cluster.num_cpus is not None else ', this host'}); "
            f"lower {worst}.workers or {worst}.devices_per_worker, or raise {have_key}",
            key=f"{worst}.workers",
        )


def check_joined_resources(config: RunConfig, facts: ClusterFacts) -> None:
    """The run's needs against what the alive nodes of a cluster to join offer, asked of
    its GCS before the run writes anything (:func:`rlcore.runtime.join.check_join`): every
    ``placement.nodes`` selector matches a node, and the GPU bundles (or, on a cluster
    without GPUs, the workers' CPUs) fit the cluster, a pinned role's on the nodes it selects."""
    from rlcore.config import ROLE_SECTIONS
    from rlcore.config.placement import role_placement

    where = f"the Ray cluster at {facts.address}"
    chosen: dict[str, list[NodeInfo]] = {}
    for role in ROLE_SECTIONS:
        placement = role_placement(config, role)
        if not placement.pinned or (role == "env" and not config.env.backend):
            continue
        chosen[role] = [n for n in facts.nodes if placement.matches(n.resources, n.labels)]
        if not chosen[role]:
            custom = sorted({r for n in facts.nodes for r in n.resources if r not in RESERVED_RESOURCES and ":" not in r})
            raise ConfigError(
                f"config key 'placement.nodes.{role}': no alive node of {where} has {placement.describe()} "
                f"(its nodes have the custom resources {custom}); fix the selector or start a node with "
                "it (ray start --resources / --labels)",
                key=f"placement.nodes.{role}",
            )
    totals = facts.totals()
    if totals.get("GPU", 0.0) >= 1:
        layout = device_layout(config)
        if layout.gpus > totals["GPU"] + 1e-9:
            raise ConfigError(
                f"config key 'policy.workers': the GPU bundles of the workers need {layout.gpus} GPU "
                f"({'; '.join(layout.lines())}), but {where} has {totals['GPU']:g}; lower the workers or "
                "share GPUs (placement.colocated=true, devices_per_worker 0.5)",
                key="policy.workers",
            )
        return
    for role in RESOURCE_ROLES:
        section = getattr(config, role)
        need = section.workers * section.devices_per_worker
        nodes = chosen.get(role, facts.nodes)
        have = sum(n.resources.get("CPU", 0.0) for n in nodes)
        if need > have + 1e-9:
            on = f"the {len(nodes)} node(s) placement.nodes.{role} selects" if role in chosen else where
            raise ConfigError(
                f"config key '{role}.workers': {role}'s {section.workers} workers x "
                f"{section.devices_per_worker:g} CPU need {need:g} CPU, but {on} has {have:g} (a cluster "
                f"without GPUs); lower {role}.workers or {role}.devices_per_worker, or add nodes",
                key=f"{role}.workers",
            )


def cluster_gpus(config: RunConfig) -> int | None:
    """GPUs of the cluster the run will use: ``cluster.num_gpus``, else what an embedded
    cluster detects on this host; ``None`` for a joined cluster (``cluster.address``, or
    one :func:`rlcore.runtime.join.choose_cluster` picks) whose size its GCS tells
    (:func:`check_joined_resources`)."""
    if choose_cluster(config.cluster).joined:
        return None
    return config.cluster.num_gpus if config.cluster.num_gpus is not None else host_gpus()


#: Resources a node selector may not name: a worker's share of them is
#: ``<role>.devices_per_worker``, and asking for them again would double the request.
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_placement(config: RunConfig) -> None:
    """``placement.nodes.<role>`` names nodes of a joined cluster, in Ray's terms.

    The embedded cluster is one node with no custom resources or labels: a selector
    could never match. Selectors may not ask for CPU/GPU/memory (``devices_per_worker``
    does), label keys and values are non-empty, an env without a backend has no
    placement, and colocated policy and generation share one selector.
    """
    from rlcore.config import ROLE_SECTIONS

    nodes = config.placement.nodes
    for role in ROLE_SECTIONS:
        sel, key = getattr(nodes, role), f"placement.nodes.{role}"
        if not (sel.resources or sel.labels):
            continue
        if not choose_cluster(config.cluster).joined:
            raise ConfigError(
                f"config key '{key}' places {role} on chosen nodes, but the run joins no cluster "
                "and the embedded cluster is one node with no custom resources or labels; set "
                "cluster.address (or RAY_ADDRESS) to the Ray cluster to join, or remove the selector",
                key=key,
            )
        if role == "env" and not config.env.backend:
            raise ConfigError(f"config key '{key}' places an env, but env.backend is not set", key=key)
        for name in sel.resources:
            if name in RESERVED_RESOURCES:
                raise ConfigError(
                    f"config key '{key}.resources.{name}': {name} is what {role}.devices_per_worker "
                    f"reserves; select nodes by a custom resource or a label instead",
                    key=f"{key}.resources.{name}",
                )
        for label, value in sel.labels.items():
            if not str(label).strip() or not str(value).strip():
                raise ConfigError(
                    f"config key '{key}.labels' has an empty label key or value ({label!r}: {value!r}); "
                    "give both, as the nodes were started with (ray start --labels=key=value)",
                    key=f"{key}.labels",
                )
    if config.placement.colocated and nodes.policy != nodes.generation:
        raise ConfigError(
            "config key 'placement.nodes.generation' differs from placement.nodes.policy, but "
            "placement.colocated is true (both share devices, so one node); give both the same "
            "selector or set placement.colocated=false",
            key="placement.nodes.generation",
        )


# ---------------------------------------------------------------- directories


# ---------------------------------------------------------------- loggers


def logger_needs(config: RunConfig) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(config key, extra, modules)`` of each logger the config enables: the modules it
    imports (:mod:`rlcore.app.logger_sinks`) and the ``rlcore[<extra>]`` that installs them."""
    logging = config.logging
    needs: list[tuple[str, str, tuple[str, ...]]] = []
    if logging.tensorboard:
        needs.append(("logging.tensorboard", "tensorboard", ("tensorboard",)))
    if logging.wandb.enabled:
        needs.append(("logging.wandb.enabled", "wandb", ("wandb",)))
    if logging.mlflow.enabled:
        # The default store, SQLite under the run directory, is MLflow's SQLAlchemy store.
        local = () if logging.mlflow.tracking_uri else ("sqlalchemy", "alembic")
        needs.append(("logging.mlflow.enabled", "mlflow", ("mlflow", *local)))
    return needs


def check_loggers(config: RunConfig) -> None:
    """Each enabled logger's packages are installed (looked up, not imported)."""
    for key, extra, modules in logger_needs(config):
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"config key '{key}' is on but {', '.join(missing)} is not installed: "
                f"pip install 'rlcore[{extra}]' (or turn it off: {key}=false)",
                key=key,
            )


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


#: Bytes the directory checks write (and remove) in the nearest existing ancestor: enough
#: to meet a full disk, which creating an empty directory or file may not.
PROBE_BYTES = 64 * 1024
#: Prefix of the directory the checks write in (removed again; left only by a kill).
PROBE_PREFIX = ".rlcore-write-check-"

def check_writable_dir(path: Path, *, key: str) -> None:
    """``path`` is a directory that exists or can be created, and can be written.

    Creates nothing that stays: a temporary directory holding a file of
    :data:`PROBE_BYTES` is made and removed in the deepest existing ancestor, which
    catches a full disk (or quota), read-only mounts, /proc and /sys, a file in the way,
    and missing permissions (root included).
    """
    anchor = _nearest_existing(path.absolute())
    if not anchor.is_dir():
        what = "is" if anchor == path.absolute() else f"lies under '{anchor}', which is"
        raise ConfigError(
            f"config key '{key}': '{path}' {what} a file, not a directory; choose another path",
            key=key,
        )
    probe: str | None = None
    try:
        probe = tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=anchor)
        # Random bytes: a compressing filesystem would store zeros in no space at all.
        with open(os.path.join(probe, "probe"), "wb") as f:
            f.write(os.urandom(PROBE_BYTES))
    except OSError as err:
        cause = f"{err.strerror or err}" + (f" [Errno {err.errno}]" if err.errno else "")
        raise ConfigError(
            f"config key '{key}': cannot write '{path}' ({cause}, found by writing "
            f"{PROBE_BYTES // 1024} KiB in '{anchor}'); {_write_fix(err.errno)}",
            key=key,
        ) from None
    finally:
        if probe is not None:
            shutil.rmtree(probe, ignore_errors=True)


def _write_fix(code: int | None) -> str:
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free space on that filesystem, or choose a directory on another one"
    if code == errno.EROFS:
        return "that filesystem is mounted read-only: choose a directory on a writable one"
    if code in (errno.EACCES, errno.EPERM):
        return "choose a directory you may write, or give yourself write permission there"
    return "choose a writable directory"

"""Every check that needs no cluster, run before anything starts.

:func:`check_before_start` is what ``rlcore run`` and ``rlcore plan`` both call
after loading the config (which already checked keys, types and ranges, see
:func:`rlcore.config.validate_run_config`). It starts no process, imports no
heavy dependency and reads only small files, so a bad input fails in well under
a second with one line that names the key and the fix:

1. the selected backends exist and serve their roles, their options are valid,
   and the declarations make a plan (refit transport included) — the same
   :func:`rlcore.setup.registry.plan_for` that setup runs;
2. ``setup.task_deadline_s`` names tasks of that plan, and ``generation.on_worker_loss:
   replace`` is not asked of a run whose env holds the generation's endpoint;
3. ``model.path`` is a loadable Hugging Face checkpoint: ``config.json`` parses,
   a tokenizer is there, and every safetensors file's header is read and its
   size compared with what the header says (a truncated file is named);
4. the policy and generation workers fit the embedded cluster's CPUs (or GPUs)
   when no ``cluster.address`` is given (Ray would otherwise wait forever), and
   ``placement.nodes`` is asked only of a joined cluster, in Ray's terms;
5. the run directory and the cache directory can be created and written (a few KiB are
   written and removed, so a full disk is found here), and a ``--out`` is empty unless
   the run resumes, or holds only what a run that completed no step left.

Every failure is a :class:`~rlcore.errors.ConfigError` with a one-line message.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import socket
import tempfile
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rlcore.config import RunConfig, cache_dir
from rlcore.config.placement import RESOURCE_ROLES, device_layout
from rlcore.errors import ConfigError
from rlcore.setup.metrics import is_temp_file

if TYPE_CHECKING:
    from rlcore.declarations import BackendDeclaration, Role
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


def run_dir_for(config: RunConfig, out: str | None, *, now: datetime | None = None) -> Path:
    """The run directory a run writes: ``out``, else ``<output_dir>/<name>-<timestamp>``."""
    if out:
        return Path(out).expanduser()
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path(config.output_dir).expanduser() / f"{config.name}-{stamp}"


def check_before_start(
    config: RunConfig,
    registry: Registry,
    *,
    out: str | None = None,
    resume: bool = False,
    accelerator: str | None = None,
) -> Plan:
    """Run every check that needs no cluster; return the setup plan.

    Args:
        config: the loaded config (keys, types and ranges already checked).
        registry: the loaded plugins.
        out: the run directory asked for (``rlcore run --out``); ``None``: a new
            timestamped directory under ``output_dir``.
        resume: a non-empty ``out`` is accepted (the run appends to it).
        accelerator: ``cuda`` or ``cpu``; ``None`` detects it (without torch).

    Raises:
        ConfigError: one line naming the key at fault and what to do.
    """
    plan = check_plan(config, registry, accelerator=accelerator)
    check_task_deadlines(config, plan)
    check_worker_loss(config, plan)
    check_model(config)
    check_resources(config)
    check_placement(config)
    if out:
        check_run_dir(Path(out).expanduser(), resume=resume)
    else:
        check_writable_dir(Path(config.output_dir).expanduser(), key="output_dir")
    check_writable_dir(cache_dir(config), key="setup.cache_dir (or $RLCORE_CACHE_DIR)")
    return plan


# ---------------------------------------------------------------- plan


def check_plan(config: RunConfig, registry: Registry, *, accelerator: str | None = None) -> Plan:
    """The plan setup would run, with every backend, option and transport error as one line."""
    from rlcore.errors import BackendNotFoundError, PlanError
    from rlcore.setup.planner import build_plan, selected_roles
    from rlcore.setup.registry import selected_backends

    try:
        selected = selected_backends(registry, config)
        check_dtype(config, {r: i.declaration for r, i in selected.items()})  # type: ignore[misc]
        return build_plan(
            config, {r: i.declaration for r, i in selected.items()},  # type: ignore[misc]
            accelerator=accelerator,
        )
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


def check_dtype(config: RunConfig, declarations: dict[Role, BackendDeclaration]) -> None:
    """``model.dtype`` is one that the policy and generation backends declare (a backend
    that declares no ``dtypes`` accepts any)."""
    from rlcore.declarations import Role

    want = config.model.dtype
    for role in (Role.POLICY, Role.GENERATION):
        decl = declarations.get(role)
        if decl is None or not decl.dtypes or want in decl.dtypes:
            continue
        runs = ", ".join(sorted(decl.dtypes))
        raise ConfigError(
            f"config key 'model.dtype' is {want}, but {role.value} backend '{decl.name}' runs "
            f"in {runs} only (its declaration's dtypes); set model.dtype to one of them or pick "
            f"another {role.value}.backend",
            key="model.dtype",
        )


def check_task_deadlines(config: RunConfig, plan: Plan) -> None:
    """``setup.task_deadline_s`` may name only tasks of the plan."""
    names = [t.name for t in plan.tasks]
    for task in config.setup.task_deadline_s:
        if task not in names:
            raise ConfigError(
                f"config key 'setup.task_deadline_s.{task}' names no task of this run's plan; "
                f"its tasks are {', '.join(names)}",
                key=f"setup.task_deadline_s.{task}",
            )


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


def cluster_gpus(config: RunConfig) -> int | None:
    """GPUs of the cluster the run will use: ``cluster.num_gpus``, else what an embedded
    cluster detects on this host; ``None`` for a joined cluster (``cluster.address``)
    whose size is not known before it is joined."""
    if config.cluster.address:
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
        if not config.cluster.address:
            raise ConfigError(
                f"config key '{key}' places {role} on chosen nodes, but no cluster.address is set "
                "and the embedded cluster is one node with no custom resources or labels; set "
                "cluster.address to the Ray cluster to join, or remove the selector",
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

#: The run's own record of how far it got, written whole by ``rlcore run`` at its start,
#: before its first step's metrics line and at its end (``rlcore.app.rundir.RunStatus``):
#: ``{"status": "setting-up" | "running" | "finished" | "failed" | "interrupted",
#: "steps_done": N, "pid": ..., "host": ..., "error": ...}``.
RUN_STATUS_FILE = "run.json"
#: Everything a run writes into its directory (besides the temporary files of
#: :func:`rlcore.setup.metrics.write_atomic`, left only by a kill).
RUN_FILES = (
    RUN_STATUS_FILE, "config.yaml", "metrics.jsonl", "trace.json", "placement.json",
    "setup_timeline.png", "reward.png",
)


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


def check_run_dir(path: Path, *, resume: bool, key: str = "--out") -> None:
    """The run directory can be written, and is new or empty unless ``resume``.

    A directory that holds only what a run that completed no step left (its
    ``run.json`` says so, see :func:`no_step_leftovers`) counts as empty: a run that
    failed in setup never blocks the same ``--out``, and the next run replaces its files.
    """
    check_writable_dir(path, key=key)
    if resume or not path.is_dir() or all(_a_probe(p.name) for p in path.iterdir()):
        return
    why = _why_not_reusable(path)
    if why is None:
        return
    raise ConfigError(
        f"run directory '{path}' ({key}) is not empty{why}; choose a new one, or pass --resume "
        "to append to it",
        key=key,
    )


def read_run_status(path: Path) -> dict[str, object] | None:
    """The run directory's ``run.json``, or ``None`` when it is missing or unreadable."""
    try:
        status = json.loads((path / RUN_STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return status if isinstance(status, dict) else None


def no_step_leftovers(path: Path) -> list[Path] | None:
    """What a run that completed no step left in ``path`` (files to replace), or ``None``
    when ``path`` holds anything else: a run that completed a step or finished, a run
    still in its setup, a file no run wrote, or no ``run.json`` at all."""
    if _why_not_reusable(path) is not None:
        return None
    return sorted(p for p in path.iterdir() if _a_run_wrote(p.name) or _a_probe(p.name))


def _why_not_reusable(path: Path) -> str | None:
    """``None`` when ``path`` holds only what a run that completed no step left; else a
    clause for the refusal (empty when there is nothing more to say than "not empty")."""
    status = read_run_status(path)
    if status is None:
        return ""
    foreign = sorted(p.name for p in path.iterdir() if not (_a_run_wrote(p.name) or _a_probe(p.name)))
    if foreign:
        return f" (it holds '{foreign[0]}', which no run wrote)"
    steps, state = status.get("steps_done"), status.get("status")
    if steps != 0 or state == "finished":
        done = f"{steps} step(s)" if isinstance(steps, int) else "an unknown number of steps"
        if state == "running":  # its end was never written: killed, or its disk filled
            done = f"at least {done}"
        return f": it holds a run that completed {done} (run.json status '{state}')"
    pid = status.get("pid")
    if (
        state == "setting-up"
        and isinstance(pid, int)
        and pid != os.getpid()
        and status.get("host") == socket.gethostname()
        and _alive(pid)
    ):
        return f": a run (pid {pid}) is setting up in it"
    return None


def _a_run_wrote(name: str) -> bool:
    return name in RUN_FILES or is_temp_file(name, RUN_FILES)


def _a_probe(name: str) -> bool:
    """A directory :func:`check_writable_dir` made (in ``--out`` when it exists) and a kill
    kept it from removing: it never makes a directory not empty."""
    return name.startswith(PROBE_PREFIX)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True

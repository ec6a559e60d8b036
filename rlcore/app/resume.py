"""Which checkpoint a resumed run continues from, and whether this run may.

:func:`choose` runs before anything starts (a resume with nothing to resume from fails in
a second, not after minutes of setup). It takes the newest checkpoint that is complete,
whose files match their digests, and that this run's config and policy backend can
continue; a newer one that is corrupt is skipped, named, and set aside (renamed
``step-N.corrupt``), so that this run's own save of step N writes it anew and pruning never
keeps it in place of a checkpoint that is whole. What a save killed mid-way left is removed
and named. It never falls back to step 0: no usable checkpoint is a
:class:`~rlcore.errors.CheckpointError` naming what was found.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.app.checkpoints import Chosen, Found, clean_partial, newest_whole, scan, set_aside
from rlcore.config import RunConfig
from rlcore.declarations import Role
from rlcore.errors import CheckpointError
from rlcore.publish import STAGING_PREFIX
from rlcore.setup.prepared import PreparedRun

#: Config keys a resumed run must share with its checkpoint: what the saved state means
#: (the model), who can read it (the policy backend and its ranks), and what the steps
#: after it would do with it (the env and the loop's sampling and loss). Everything else
#: (``grpo.steps``, the generation engine, timeouts, placement, logging) may change.
SHARED_KEYS = (
    "model", "policy.backend", "policy.workers", "env.backend", "env.options",
    "grpo.prompts_per_step", "grpo.samples_per_prompt", "grpo.max_new_tokens", "grpo.temperature",
    "grpo.learning_rate", "grpo.clip_eps", "grpo.seed", "grpo.max_staleness",
)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def shared_config(config: RunConfig) -> dict[str, Any]:
    """The values of :data:`SHARED_KEYS` in ``config``, flattened to dotted keys, as they
    read back from a manifest (JSON: tuples are lists)."""
    whole = dataclasses.asdict(config)
    out: dict[str, Any] = {}
    for key in SHARED_KEYS:
        value: Any = whole
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        _flatten(key, value, out)
    return dict(json.loads(json.dumps(out, default=str)))


def checkpoint_root(config: RunConfig, run_dir: Path) -> Path:
    """Where a run's checkpoints are: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
    return Path(config.checkpoint.dir).expanduser() if config.checkpoint.dir else Path(run_dir) / "checkpoints"


def differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``key: checkpoint X, this run Y`` for each key whose value differs."""
    keys = sorted(set(saved) | set(now))
    return [
        f"{k}: checkpoint {saved.get(k)!r}, this run {now.get(k)!r}"
        for k in keys if saved.get(k) != now.get(k)
    ]


@dataclass(frozen=True)
class PolicyFormat:
    """The policy backend's side of a checkpoint: who wrote it and in what format."""

    backend: str
    format: str
    version: str
    distribution: str | None = None
    distribution_version: str | None = None

    def refusal(self, saved: Mapping[str, Any]) -> str | None:
        """Why a checkpoint whose manifest says ``saved`` cannot be loaded by this backend."""
        if saved.get("backend") != self.backend:
            return f"it was saved by policy backend {saved.get('backend')!r}, this run's is {self.backend!r}"
        if (saved.get("format"), saved.get("version")) != (self.format, self.version):
            return (
                f"its policy format is {saved.get('format')} version {saved.get('version')} "
                f"({saved.get('distribution')} {saved.get('distribution_version')}), "
                f"{self.backend} now reads {self.format} version {self.version} "
                f"({self.distribution} {self.distribution_version})"
            )
        return None


def policy_format(prepared: PreparedRun) -> PolicyFormat | None:
    """The selected policy backend's checkpoint format (None: it declares none)."""
    info = prepared.backends.get(Role.POLICY)
    decl = None if info is None else info.declaration
    if info is None or decl is None or decl.checkpoint is None:
        return None
    c = decl.checkpoint
    return PolicyFormat(decl.name, c.format, c.version, info.distribution, info.version)


def choose(root: Path, config: RunConfig, policy: PolicyFormat) -> Chosen:
    """The newest usable checkpoint under ``root`` (module doc).

    Raises:
        CheckpointError: none is usable (naming each one found and why), or the newest
            complete one was saved by another config or policy format (naming the
            difference: an older one would differ the same way).
    """
    cleaned = [f"{p.name} (what a {_unfinished(p.name)} left)" for p in clean_partial(root)]
    listed = scan(root)
    found, skipped = newest_whole(listed, lambda f: _check_compatible(f, config, policy))
    if found is not None:
        newer = [f for f in listed if f.step > found.step]  # what newest_whole passed over, in order
        return Chosen(found, [_set_aside_if_corrupt(f, why) for f, why in zip(newer, skipped, strict=True)], cleaned)
    what = f"found {', '.join(skipped)}" if skipped else "it holds no checkpoint"
    raise CheckpointError(
        f"nothing to resume from in {root}: {what}. A run saves checkpoints with "
        "checkpoint.every_steps=N; to start over instead, run with a new --out"
    )


def _unfinished(name: str) -> str:
    return "save that was stopped or killed" if name.startswith(STAGING_PREFIX) else "removal that did not finish"


def _set_aside_if_corrupt(found: Found, why: str) -> str:
    """``why`` a newer checkpoint was passed over, and where it went if it was corrupt (a
    checkpoint of a newer format stays: it is whole, only not for this rlcore)."""
    if "(corrupt: " not in why and "(unreadable " not in why:
        return why
    try:
        return f"{why}, set aside as {set_aside(found).name}"
    except OSError as err:  # a read-only root, say: the resume goes on, the corrupt one stays
        return f"{why}, not set aside ({err.strerror or err}): remove it by hand"


def _check_compatible(f: Found, config: RunConfig, policy: PolicyFormat) -> None:
    assert f.manifest is not None
    refusal = policy.refusal(f.manifest.get("policy") or {})
    if refusal is not None:
        raise CheckpointError(f"cannot resume from {f.path}: {refusal}")
    diff = differences(f.manifest.get("config") or {}, shared_config(config))
    if diff:
        raise CheckpointError(
            f"cannot resume from {f.path}: this run's config differs from the checkpoint's in "
            + "; ".join(diff) + " (resume with the checkpoint's values, or start a new run)"
        )


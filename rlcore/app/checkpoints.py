"""A run's training checkpoints on disk: written whole, found, checked, pruned.

A checkpoint is one directory ``<root>/step-<8 digits>`` published atomically through the
``rlcore_publish`` hook (the core's :func:`rlcore.publish.publish_dir`: a staging directory,
fsync, a completion marker, one rename), so a save that is killed, fails or fills the disk
leaves nothing that counts. Inside:

* ``policy/``: what the policy backend's ``save_checkpoint`` wrote, in its own format;
* ``config.yaml``: the run's whole config (``rlcore export`` starts the policy from it);
* :data:`MANIFEST_NAME`: the step, the policy backend and its checkpoint format, the config
  keys a resumed run must share, the env's state, and the size and SHA-256 of every file.

The digests are what the marker does not give: a file truncated, overwritten or rotted
after the save is found at resume (:func:`verify`), and the run resumes from the newest
checkpoint that is still whole, saying which it skipped and why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcore.publish import MARKER_NAME, clean_stale_staging, discard, read_marker

log = logging.getLogger(__name__)

#: The checkpoint's own manifest (inside the published directory, beside the marker).
MANIFEST_NAME = "checkpoint.json"
#: The manifest's format; a newer one is refused by an older rlcore.
FORMAT = "rlcore-checkpoint"
FORMAT_VERSION = 1
#: Where the policy backend writes, inside a checkpoint.
POLICY_DIR = "policy"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_CHUNK = 8 << 20


def step_dir(root: Path, step: int) -> Path:
    """The checkpoint of ``step`` under ``root``."""
    return Path(root) / f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory's name says (``step-00000040``: 40), else ``None``."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m is not None else None


def file_digests(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every regular file under ``directory``, by relative path."""
    out: dict[str, dict[str, Any]] = {}
    root = Path(directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel in (MANIFEST_NAME, MARKER_NAME) or rel.startswith(f"{MARKER_NAME}."):
            continue
        h = hashlib.sha256()
        size = 0
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
        out[rel] = {"bytes": size, "sha256": h.hexdigest()}
    return out


def write_checkpoint(
    staging: Path,
    *,
    step: int,
    save_policy: Callable[[str], None],
    manifest: Mapping[str, Any],
    config_yaml: str,
) -> dict[str, Any]:
    """Fill a checkpoint's staging directory: the policy's files first, then the config,
    then the manifest with every file's digest (last: a staging directory without it is
    never published). Returns the manifest written."""
    policy = Path(staging) / POLICY_DIR
    policy.mkdir()
    save_policy(str(policy))
    (Path(staging) / "config.yaml").write_text(config_yaml, encoding="utf-8")
    full = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "step": step}
    full["files"] = file_digests(Path(staging))
    full["bytes"] = sum(f["bytes"] for f in full["files"].values())
    (Path(staging) / MANIFEST_NAME).write_text(json.dumps(full, indent=1, sort_keys=True), encoding="utf-8")
    return full


@dataclass(frozen=True)
class Found:
    """One entry of a checkpoint root as :func:`scan` finds it.

    Attributes:
        path: the directory.
        step: the step in its name.
        problem: why it cannot be used (``None``: complete; its digests are checked only
            by :func:`verify`).
        manifest: its parsed manifest, when there is one.
    """

    path: Path
    step: int
    problem: str | None
    manifest: dict[str, Any] | None = None

    def describe(self) -> str:
        return f"{self.path.name} ({self.problem or 'complete'})"


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if read_marker(path) is None:
        return None, "incomplete: no completion marker (a save that was stopped or killed)"
    try:
        data = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return None, f"unreadable {MANIFEST_NAME}: {err}"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None, f"{MANIFEST_NAME} is not an rlcore checkpoint manifest"
    if not isinstance(data.get("format_version"), int) or data["format_version"] > FORMAT_VERSION:
        return None, (
            f"written by a newer rlcore (checkpoint format {data.get('format_version')!r}, "
            f"this rlcore reads up to {FORMAT_VERSION})"
        )
    if not isinstance(data.get("files"), dict):
        return None, f"{MANIFEST_NAME} lists no files"
    return data, None


def scan(root: Path) -> list[Found]:
    """Every ``step-*`` directory under ``root``, newest step first, each with what (if
    anything) keeps it from being used. Scratch of the publisher is not listed."""
    found = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        step = step_of(Path(name))
        if step is None or not (Path(root) / name).is_dir():
            continue
        manifest, problem = _read_manifest(Path(root) / name)
        found.append(Found(Path(root) / name, step, problem, manifest))
    return sorted(found, key=lambda f: f.step, reverse=True)


def verify(found: Found) -> str | None:
    """The first file of the checkpoint that is missing or whose size or SHA-256 differs
    from its manifest, as a phrase; ``None`` when every file is as saved."""
    if found.problem is not None or found.manifest is None:
        return found.problem or "no manifest"
    files: dict[str, Any] = found.manifest["files"]
    for rel, want in sorted(files.items()):
        path = found.path / rel
        try:
            size = path.stat().st_size
        except OSError:
            return f"corrupt: {rel} is missing"
        if size != want.get("bytes"):
            return f"corrupt: {rel} has {size} bytes, {want.get('bytes')} were saved (truncated or overwritten)"
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if h.hexdigest() != want.get("sha256"):
            return f"corrupt: {rel} does not match its SHA-256 digest"
    return None


@dataclass(frozen=True)
class Chosen:
    """The checkpoint a resume or an export reads.

    Attributes:
        found: the checkpoint (its path, step and manifest).
        skipped: newer checkpoints that could not be used, each with why.
        cleaned: what unfinished saves (or removals) had left under the root, removed.
    """

    found: Found
    skipped: list[str] = field(default_factory=list)
    cleaned: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.found.step

    @property
    def manifest(self) -> dict[str, Any]:
        assert self.found.manifest is not None
        return self.found.manifest


def newest_whole(found: Sequence[Found], check: Callable[[Found], None] = lambda f: None) -> tuple[Found | None, list[str]]:
    """The newest of ``found`` (newest first, as :func:`scan` lists them) that is complete
    and whose files match their digests (``None`` if none is), and each one passed over with
    why. ``check(found)`` runs before a candidate's digests are read and may raise (a resume
    refuses another config at once: an older checkpoint would differ the same way)."""
    skipped: list[str] = []
    for f in found:
        if f.problem is not None or f.manifest is None:
            skipped.append(f.describe())
            continue
        check(f)
        problem = verify(f)
        if problem is None:
            return f, skipped
        skipped.append(f"{f.path.name} ({problem})")
    return None, skipped


def prune(root: Path, keep: int, keep_every: int = 0) -> list[Path]:
    """Delete the complete checkpoints older than the newest ``keep`` ones (but those of a
    step that is a multiple of ``keep_every``, when it is > 0: milestones stay), and
    incomplete ones older than the newest complete one (a killed save's leftovers); returns
    what went.

    Only checkpoints older than the newest *complete* one ever go, so a save that has not
    finished never costs the one before it, also across restarts (milestones are told by
    their step, so a restart keeps them too)."""
    found = scan(root)
    complete = [f for f in found if f.problem is None]
    if not complete:
        return []
    newest = complete[0].step
    old = [f for f in complete[keep:] if not (keep_every > 0 and f.step % keep_every == 0)]
    doomed = old + [f for f in found if f.problem is not None and f.step < newest]
    for f in doomed:
        discard(f.path)
        log.info("removed checkpoint %s (checkpoint.keep=%d)", f.path, keep)
    return [f.path for f in doomed]


#: What a checkpoint found corrupt at resume is renamed to (out of :func:`scan`'s sight).
CORRUPT_SUFFIX = ".corrupt"


def set_aside(found: Found) -> Path:
    """Rename a corrupt checkpoint to ``<name>.corrupt`` (``.corrupt.2``, ... when taken): no
    longer a checkpoint (not resumed from, not counted by :func:`prune`, not in the way of
    a new save of its step), still there to be looked at. Returns the new path."""
    n = 1
    while True:
        target = found.path.with_name(found.path.name + CORRUPT_SUFFIX + (f".{n}" if n > 1 else ""))
        if not target.exists():
            os.rename(found.path, target)
            return target
        n += 1


def clean_partial(root: Path) -> list[Path]:
    """Remove what killed saves left under ``root``: publisher scratch no live writer holds.
    (An incomplete ``step-*`` directory cannot exist: the rename publishes whole ones.)"""
    return clean_stale_staging(Path(root)) if Path(root).is_dir() else []

"""Which installed copies of a plugin distribution exist, and which one Python imports.

A distribution installed twice (pip left a stale ``.dist-info`` of an older version
behind, or two site directories on ``sys.path`` each hold a copy) has one set of
metadata per copy, but Python imports one copy's code: ``importlib.metadata`` then
reports the first copy's version and entry points, which need not be the code that
runs. This module reads the metadata of every installed distribution (name, version,
``RECORD``/``SOURCES.txt`` with their hashes, PEP 610 ``direct_url.json``, the
dist-info location), finds the names installed more than once at different versions,
works out whose code Python imports (without importing it) and builds the message
that refuses such a plugin. :mod:`rlcore.setup.registry` decides what to do with it.

Nothing here raises on broken metadata: what cannot be read counts as unknown.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

__all__ = [
    "InstalledCopy",
    "dist_location",
    "hidden_entry_points",
    "installed_twice",
    "normalized_name",
    "refuse_copies",
]


class _EntryPoint(Protocol):
    """What this module reads of an entry point (``dist`` and ``value`` it reads with
    ``getattr``: a stand-in may lack them)."""

    name: str


@dataclass(frozen=True)
class InstalledCopy:
    """One installed copy of a plugin: the metadata directory an entry point comes from.

    Attributes:
        plugin: the entry-point name.
        distribution: the distribution name as its metadata spells it.
        version: that copy's version, if known.
        location: its metadata directory (``.../name-1.0.dist-info``); ``None`` if unknown.
        imported: whether the code Python imports for the plugin is this copy's.
    """

    plugin: str
    distribution: str | None
    version: str | None
    location: str | None
    imported: bool

    def describe(self) -> str:
        """``dist 1.0 at /site/dist-1.0.dist-info``."""
        where = f" at {self.location}" if self.location else ""
        return f"{self.distribution or '?'} {self.version or '(no version)'}{where}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``rlcore plugins --json``)."""
        return {
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
            "location": self.location,
            "imported": self.imported,
        }


# -- which distributions are installed more than once ----------------------------


def normalized_name(dist: importlib.metadata.Distribution | None) -> str | None:
    """The PEP 503 name of ``dist`` (``rlcore_fsdp`` style), or ``None`` if unreadable.

    Args:
        dist: a distribution, e.g. an entry point's ``dist``; ``None`` gives ``None``.
    """
    if dist is None:
        return None
    try:
        name = getattr(dist, "_normalized_name", None) or dist.metadata["Name"]
    except Exception:  # noqa: BLE001 - broken metadata must not stop loading
        return None
    return re.sub(r"[-_.]+", "_", str(name)).lower() if name else None


def dist_location(dist: importlib.metadata.Distribution | None) -> str | None:
    """The metadata directory of ``dist`` (``.../name-1.0.dist-info``), if known.

    Args:
        dist: a distribution found on ``sys.path``; ``None`` (or one not read from a
            directory) gives ``None``.
    """
    path = getattr(dist, "_path", None)
    if path is None:
        return None
    return os.path.abspath(os.fspath(path))


def installed_twice(group: str) -> dict[str, list[importlib.metadata.Distribution]]:
    """Plugin distributions installed more than once at different versions.

    Maps the normalized name to every copy (metadata directory) on ``sys.path``, in
    the order Python finds them, for names where some copy has an entry point of
    ``group`` (``entry_points()`` shows only the first copy's).
    Copies of one version (a project's own ``.egg-info`` beside its editable
    install) are not reported. The same directory reached twice counts once.

    Args:
        group: the entry-point group that makes a distribution a plugin
            (``rlcore.backends``).
    """
    by_name: dict[str, list[importlib.metadata.Distribution]] = {}
    for dist in importlib.metadata.distributions():
        name = normalized_name(dist)
        if name is not None:
            by_name.setdefault(name, []).append(dist)
    twice: dict[str, list[importlib.metadata.Distribution]] = {}
    for name, found in by_name.items():
        if len(found) < 2:
            continue
        unique = {_real_location(d): d for d in reversed(found)}  # the first copy of each
        dists = sorted(unique.values(), key=found.index)
        if len({_dist_version(d) for d in dists}) < 2:
            continue
        if any(_entry_points_of(d, group) for d in dists):
            twice[name] = dists
    return twice


def hidden_entry_points(
    found: Sequence[_EntryPoint],
    twice: dict[str, list[importlib.metadata.Distribution]],
    group: str,
) -> list[importlib.metadata.EntryPoint]:
    """The entry points of ``group`` that only a later copy of a distribution declares.

    ``entry_points()`` reports the first copy's entry points only; these are the ones
    missing from ``found``, in the order of ``twice`` and its copies.

    Args:
        found: the entry points ``entry_points()`` reported.
        twice: :func:`installed_twice` of the same ``group``.
        group: the entry-point group (``rlcore.backends``).
    """
    have = {(ep.name, normalized_name(getattr(ep, "dist", None))) for ep in found}
    extra: list[importlib.metadata.EntryPoint] = []
    for name, dists in twice.items():
        for dist in dists:
            for ep in _entry_points_of(dist, group):
                if (ep.name, name) not in have:
                    have.add((ep.name, name))
                    extra.append(ep)
    return extra


def _entry_points_of(
    dist: importlib.metadata.Distribution, group: str
) -> list[importlib.metadata.EntryPoint]:
    """``dist``'s entry points of ``group`` (none if unreadable)."""
    try:
        return [ep for ep in dist.entry_points if ep.group == group]
    except Exception:  # noqa: BLE001
        return []


def _real_location(dist: importlib.metadata.Distribution) -> str:
    """A key that is equal for one metadata directory reached through two paths."""
    location = dist_location(dist)
    return os.path.realpath(location) if location else f"id:{id(dist)}"


def _dist_version(dist: importlib.metadata.Distribution) -> str | None:
    """``dist``'s version, or ``None`` if its metadata is unreadable."""
    try:
        return str(dist.version)
    except Exception:  # noqa: BLE001
        return None


def _dist_name(dist: importlib.metadata.Distribution) -> str | None:
    """``dist``'s name as its metadata spells it, or ``None`` if unreadable."""
    try:
        return str(dist.metadata["Name"])
    except Exception:  # noqa: BLE001
        return None


# -- which copy's code Python imports ----------------------------------------------


def _module_file(module: str) -> str | None:
    """The file Python would import for ``module``, found without importing it or its
    package (``None`` when it is not found or has no file)."""
    try:
        loaded = sys.modules.get(module)
        if loaded is not None:
            origin = getattr(loaded, "__file__", None)
            return os.path.realpath(origin) if origin else None
        parts = module.split(".")
        spec = importlib.util.find_spec(parts[0])
        for part in parts[1:]:
            if spec is None or not spec.submodule_search_locations:
                return None
            spec = importlib.machinery.PathFinder.find_spec(
                part, list(spec.submodule_search_locations)
            )
        if spec is None or not spec.has_location or not spec.origin:
            return None
        return os.path.realpath(spec.origin)
    except Exception:  # noqa: BLE001 - a broken plugin must not stop loading
        return None


def _file_hash(path: str, mode: str) -> str | None:
    """``path``'s digest as RECORD writes it (urlsafe base64, no padding)."""
    try:
        digest = hashlib.new(mode, Path(path).read_bytes()).digest()
    except (OSError, ValueError):
        return None
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _recorded_files(dist: importlib.metadata.Distribution) -> list[tuple[str, Any]]:
    """``(real path, FileHash or None)`` of every file ``dist``'s RECORD lists."""
    try:
        files = dist.files or []
    except Exception:  # noqa: BLE001
        return []
    out = []
    for f in files:
        try:
            out.append((os.path.realpath(os.fspath(f.locate())), f.hash))
        except Exception:  # noqa: BLE001
            continue
    return out


def _record_verdict(
    dist: importlib.metadata.Distribution, file: str, package_dir: str | None
) -> str:
    """How ``dist``'s file list (RECORD, or an egg-info's SOURCES.txt) sees ``file``.

    ``verified``: listed with a hash that matches the file on disk, as do the hashes of
    every other file it lists under ``package_dir``; ``hashed``: the same but another
    file of the package differs; ``unhashed``: listed without a hash; ``stale``: listed
    with another hash; ``absent``: not listed.
    """
    verdict = "absent"
    other_differs = False
    for path, file_hash in _recorded_files(dist):
        if path == file:
            if file_hash is None:
                verdict = "unhashed"
            else:
                same = _file_hash(path, file_hash.mode) == file_hash.value
                verdict = "verified" if same else "stale"
        elif file_hash is not None and package_dir and path.startswith(package_dir + os.sep):
            other_differs = other_differs or _file_hash(path, file_hash.mode) != file_hash.value
    return "hashed" if verdict == "verified" and other_differs else verdict


def _editable_root(dist: importlib.metadata.Distribution) -> str | None:
    """The project directory of an editable install (PEP 610 ``direct_url.json``)."""
    try:
        data = json.loads(dist.read_text("direct_url.json") or "null")
    except Exception:  # noqa: BLE001
        return None
    if not isinstance(data, dict) or not (data.get("dir_info") or {}).get("editable"):
        return None
    url = urlparse(str(data.get("url", "")))
    return os.path.realpath(unquote(url.path)) if url.scheme == "file" else None


def _package_dir(file: str, module: str) -> str | None:
    """The directory of ``module``'s top-level package, given the file it resolves to
    (``None`` for a top-level single-file module)."""
    parts = module.split(".")
    levels = len(parts) - 1 + (1 if os.path.basename(file).startswith("__init__.") else 0)
    if levels == 0:
        return None
    folder = os.path.dirname(file)
    for _ in range(levels - 1):
        folder = os.path.dirname(folder)
    return folder if os.path.basename(folder) == parts[0] else None


def _imported_copy(
    dists: Sequence[importlib.metadata.Distribution], file: str | None, module: str
) -> int | None:
    """Which of ``dists`` (copies of one distribution) the code in ``file`` belongs to.

    In order: the one copy whose RECORD lists ``file`` with its hash, and the other
    files of its package with theirs; else the one copy whose RECORD lists it with its
    hash; else the one copy that lists it without a hash (an ``.egg-info``) or is an
    editable install whose project holds it; else the one copy in the directory on
    ``sys.path`` that holds the module. The first kind of evidence that fits any copy
    decides; ``None`` (cannot tell) when it fits several or none.
    """
    if file is None:
        return None
    package_dir = _package_dir(file, module)
    import_root = os.path.dirname(package_dir or file)
    verdicts = [_record_verdict(d, file, package_dir) for d in dists]
    editable = [_editable_root(d) for d in dists]
    sites = [os.path.realpath(os.path.dirname(loc or "")) for loc in map(dist_location, dists)]
    tiers = [
        [i for i, v in enumerate(verdicts) if v == "verified"],
        [i for i, v in enumerate(verdicts) if v in ("verified", "hashed")],
        [
            i
            for i, (v, root) in enumerate(zip(verdicts, editable, strict=True))
            if v == "unhashed" or (root and file.startswith(root + os.sep))
        ],
        [i for i, site in enumerate(sites) if site == import_root],
    ]
    for tier in tiers:  # the strongest evidence decides; two copies it fits: cannot tell
        if tier:
            return tier[0] if len(tier) == 1 else None
    return None


# -- the refusal -------------------------------------------------------------------


def refuse_copies(
    ep: _EntryPoint, dists: Sequence[importlib.metadata.Distribution]
) -> tuple[str, str | None, tuple[InstalledCopy, ...]]:
    """Why plugin ``ep`` is refused when its distribution has several copies ``dists``.

    Args:
        ep: the plugin's entry point (its ``value`` names the module Python imports).
        dists: every copy of its distribution, as :func:`installed_twice` maps it.

    Returns:
        The one-line message (every copy with its version and location, which one's
        code Python imports, and the fix), the imported copy's version (``None`` when
        it cannot be told) and the copies.
    """
    module = str(getattr(ep, "value", "")).partition(":")[0].strip()
    file = _module_file(module) if module else None
    index = _imported_copy(dists, file, module)
    copies = tuple(
        InstalledCopy(ep.name, _dist_name(d), _dist_version(d), dist_location(d), i == index)
        for i, d in enumerate(dists)
    )
    name = next((c.distribution for c in copies if c.distribution), "?")
    listed = " and ".join(
        f"{c.version or '(no version)'} at {c.location or '(unknown location)'}"
        + (f" (Python imports its code: {file})" if c.imported else "")
        for c in copies
    )
    head = (  # names the plugin as the registry's messages do
        f"plugin '{ep.name}' (distribution {name}) is installed {len(copies)} times: "
        f"{listed}, so it was not loaded (rlcore will not guess which version runs)."
    )
    if index is None:
        where = file or f"module '{module}' not found"
        fix = (
            f"rlcore cannot tell which copy the code Python imports ({where}) belongs to: "
            "delete the metadata directories of every copy but the one you want, then "
            f"pip install --force-reinstall --no-deps '{name}==<that version>'"
        )
        return f"{head} Fix: {fix}.", None, copies
    stale = " ".join(
        shlex.quote(c.location) if c.location else c.describe() for c in copies if not c.imported
    )
    fix = (
        f"delete the metadata that does not match that code: rm -r {stale} (pip uninstall "
        f"cannot tell the copies apart); then pip install '{name}==VERSION' to run another version"
    )
    return f"{head} Fix: {fix}.", copies[index].version, copies

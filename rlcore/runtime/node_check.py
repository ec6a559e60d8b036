"""Every node of a joined cluster that a role may land on runs that role's backend as the driver does.

A role's actors import its backend's plugin module on whatever node Ray places them; a
node whose Python lacks the backend (or one of its imports), or has another version of
rlcore or of the backend's distribution than the driver, otherwise fails deep inside the
role's init, or worse, runs a different code than the one the plan was made for. Before any
role starts, :func:`check_nodes` runs one small task on each such node (pinned to it, in the
job's runtime environment, as the role's actors will be) that imports the plugin modules
and reads the distributions' versions there; every difference is one
:class:`~rlcore.errors.ConfigError` line naming the node, the role, the backend, its
distribution and both versions.

The versions are those each node has installed, read without the driver's directories:
Ray puts the driver's working directory and its script's directory first on every
worker's ``sys.path``, so a driver run from a checkout had each node read the checkout's
``rlcore.egg-info`` (where that path exists, as on the driver's own host or a shared
file system) instead of its own install, and a node of another version passed. Both
sides leave these directories out (:func:`driver_dirs`); the imports are tried as the
role's actors will make them, with ``sys.path`` as Ray leaves it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from rlcore.errors import ConfigError

if TYPE_CHECKING:
    from rlcore.setup.prepared import PreparedRun

log = logging.getLogger(__name__)

#: The core's own distribution, compared on every node a role may land on.
CORE_DISTRIBUTION = "rlcore"
#: How long the nodes have to answer, in seconds (a worker process started on each).
NODE_CHECK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Needed:
    """What a role needs on its nodes: its backend's plugin module and distribution."""

    role: str
    backend: str
    module: str
    distribution: str | None
    version: str | None


def needs(prepared: PreparedRun) -> list[Needed]:
    """The plugin module and distribution of each role the run starts (in-process plugins,
    which no other node could have, are left out)."""
    out = []
    for role, info in prepared.backends.items():
        if info.distribution is None:
            continue
        module = getattr(info.plugin, "__name__", None) or type(info.plugin).__module__
        out.append(Needed(role.value, info.name, module, info.distribution, info.version))
    return out


def driver_dirs() -> list[str]:
    """The directories Ray puts first on every worker's ``sys.path`` for this driver: its
    working directory and its script's directory (Ray's job config ``py_driver_sys_path``)."""
    return sorted({os.path.abspath(os.curdir), os.path.dirname(os.path.realpath(sys.argv[0]))})


def installed_versions(distributions: Iterable[str], leave_out: Iterable[str] = ()) -> dict[str, str | None]:
    """Each distribution's version (``None``: not installed) as this process's ``sys.path``
    has it, without the directories ``leave_out`` (and this process's working directory,
    where ``sys.path`` names it as ``''``)."""
    skip = {os.path.realpath(d) for d in leave_out}
    path = [p for p in sys.path if p and os.path.realpath(p) not in skip]
    versions: dict[str, str | None] = {}
    for dist in distributions:
        found = next(iter(metadata.distributions(name=dist, path=path)), None)
        versions[dist] = found.version if found is not None else None
    return versions


def installed(modules: list[str], distributions: list[str], leave_out: list[str] | None = None) -> dict[str, Any]:
    """What this process's Python has (run on each node): each module's import error (or
    ``None``), each distribution's version (or ``None``) read without the directories
    ``leave_out`` (the driver's: :func:`driver_dirs`)."""
    errors: dict[str, str | None] = {}
    for name in modules:
        try:
            importlib.import_module(name)
            errors[name] = None
        except Exception as err:  # any failure to import is the answer
            errors[name] = f"{type(err).__name__}: {err}".splitlines()[0]
    return {"errors": errors, "versions": installed_versions(distributions, leave_out or ())}


def check_nodes(prepared: PreparedRun, where: str, timeout_s: float = NODE_CHECK_TIMEOUT_S) -> None:
    """Ask every alive node a role may land on (:func:`rlcore.config.placement.role_placement`)
    what it has of the roles' backends (module doc).

    Raises:
        ConfigError: one line naming the node, the role, the backend, its distribution and
            both versions, or what failed to import there.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlcore.config.placement import role_placement
    from rlcore.errors import Deadline
    from rlcore.runtime.gate import RAY_GATE
    from rlcore.runtime.waits import ray_get

    wanted = needs(prepared)
    if not wanted:
        return
    with RAY_GATE.call("looking up the cluster's nodes"):
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node: dict[str, list[Needed]] = {}
    for need in wanted:
        placement = role_placement(prepared.config, need.role)
        for n in nodes:
            if placement.matches(n.get("Resources", {}), n.get("Labels", {})):
                per_node.setdefault(n["NodeID"], []).append(need)
    leave_out = driver_dirs()
    here = installed_versions([CORE_DISTRIBUTION, *(n.distribution for n in wanted if n.distribution)], leave_out)
    ask = ray.remote(num_cpus=0, max_retries=0)(installed)
    refs = {}
    with RAY_GATE.call("asking the nodes what they have installed"):
        for node_id, needed in per_node.items():
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            refs[node_id] = ask.options(scheduling_strategy=strategy, name="rlcore-node-check").remote(
                sorted({n.module for n in needed}), sorted(here), leave_out
            )
    deadline = Deadline(timeout_s, "checking the cluster's nodes")
    address = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in nodes}
    for node_id, ref in refs.items():
        node = f"node {node_id[:12]} ({address[node_id]})"
        try:
            answer = ray_get(ref, what=f"asking {node} what it has installed", deadline=deadline)
        except Exception as err:
            first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"{where}: {node} cannot run rlcore ({first}); install rlcore and the backends on every "
                "node (the same image, or the job's runtime environment)",
                key="cluster.address",
            ) from None
        _compare(node, where, per_node[node_id], here, answer)
    log.info("checked %d node(s): each has the backends of its roles at the driver's versions", len(refs))


def _compare(node: str, where: str, needed: list[Needed], here: dict[str, str | None], answer: dict[str, Any]) -> None:
    fix = "install the driver's versions there (the same image, or the job's runtime environment)"
    there = answer["versions"]
    if here.get(CORE_DISTRIBUTION) and there.get(CORE_DISTRIBUTION) != here[CORE_DISTRIBUTION]:
        raise ConfigError(
            f"{where}: {node} has {CORE_DISTRIBUTION} {there.get(CORE_DISTRIBUTION) or '(not installed)'}, the "
            f"driver {here[CORE_DISTRIBUTION]}; {fix}",
            key="cluster.address",
        )
    for need in needed:
        backend = f"{need.role}'s backend {need.backend} (distribution {need.distribution})"
        error = answer["errors"].get(need.module)
        if error is not None:
            raise ConfigError(
                f"{where}: {node}, where {need.role} may run, cannot import {need.module} of {backend}: "
                f"{error}; the driver has {need.distribution} {here.get(need.distribution) or '?'}; {fix}",
                key=f"{need.role}.backend",
            )
        mine, theirs = here.get(need.distribution or ""), there.get(need.distribution or "")
        if mine != theirs:
            raise ConfigError(
                f"{where}: {node}, where {need.role} may run, has {backend} {theirs or '(not installed)'}, the "
                f"driver {mine}; {fix}",
                key=f"{need.role}.backend",
            )

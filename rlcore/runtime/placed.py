"""Where the worker groups this process started run (for the run's ``placement.json``),
and the addresses of the cluster's nodes (which name a rank's node in errors).
"""

from __future__ import annotations

import logging
from typing import Any

from rlcore.runtime.gate import RAY_GATE

log = logging.getLogger(__name__)


#: Every worker group this process started: ``{"group", "role", "nodes"}`` (Ray node id per rank).
_PLACED: list[dict[str, Any]] = []


def placed_groups() -> list[dict[str, Any]]:
    """Where the worker groups started by this process run (for the run's ``placement.json``)."""
    return [dict(p) for p in _PLACED]


def forget_placed(keep: int = 0) -> None:
    """Forget every worker group recorded after the first ``keep``: a run that ended drops
    its own, so the next run in this process (a second ``rlcore.open``) lists only its own."""
    del _PLACED[keep:]


def record_placed(group: str, role: str | None, nodes: list[str]) -> None:
    """Record that worker group ``group`` (of ``role``) started, rank ``i`` on Ray node ``nodes[i]``."""
    _PLACED.append({"group": group, "role": role, "nodes": list(nodes)})


def node_addresses() -> dict[str, str]:
    """Ray node id -> the node's address, for the cluster's alive nodes (names a rank's node)."""
    import ray

    try:
        with RAY_GATE.call("looking up the nodes' addresses"):
            return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    except Exception as err:  # naming the node is a courtesy: never fail a start for it
        log.debug("cannot list the cluster's nodes: %s", err)
        return {}

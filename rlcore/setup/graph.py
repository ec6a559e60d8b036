"""The two graph walks of setup: topological order (graphlib) and reachability.

Graphs are given as ``deps``: node -> the nodes it waits for. The plan, the
planner and the executor all walk their graphs with these two functions.
"""

from __future__ import annotations

import graphlib
from collections.abc import Iterable, Mapping

from rlcore.errors import PlanError


def topological_order(nodes: Iterable[str], deps: Mapping[str, Iterable[str]]) -> list[str]:
    """``nodes`` so that every node comes after the nodes it waits for.

    Raises :class:`PlanError` naming the nodes of a cycle.
    """
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
    for n in nodes:
        sorter.add(n, *deps.get(n, ()))
    try:
        return list(sorter.static_order())
    except graphlib.CycleError as err:
        cycle = err.args[1] if len(err.args) > 1 else []
        raise PlanError(f"the dependencies form a cycle: {' -> '.join(cycle)}") from None


def waits_for(deps: Mapping[str, Iterable[str]], node: str, other: str) -> bool:
    """Whether ``node`` waits, directly or through others, for ``other``."""
    stack, seen = [node], {node}
    while stack:
        for d in deps.get(stack.pop(), ()):
            if d == other:
                return True
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return False

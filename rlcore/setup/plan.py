"""The setup plan as data: tasks, edges with reasons, in-init waits, critical path, and
the loop's schedule.

The planner (:mod:`rlcore.setup.planner`) builds a :class:`Plan`; the executor runs
it; ``rlcore plan`` prints it; tests assert on it directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rlcore.setup.graph import topological_order

if TYPE_CHECKING:
    from rlcore.config.placement import DeviceLayout
    from rlcore.declarations import Role

#: The setup task that makes the first weight sync (step 0).
REFIT_TASK = "refit:initial"
#: What :attr:`Plan.critical_path` is: the longest chain of the plan's graph, every task
#: counted as 1, not timed (a run's measured one: :meth:`Plan.timed_critical_path`).
CRITICAL_PATH_BASIS = "structural, from the declared order"


def init_task(role: Role) -> str:
    """The setup task that starts ``role`` (``init:policy``)."""
    return f"init:{role.value}"


def role_of_task(name: str) -> Role | None:
    """``init:policy`` -> ``Role.POLICY``; ``None`` for tasks that are not inits."""
    from rlcore.declarations import Role

    kind, _, role = name.partition(":")
    if kind != "init":
        return None
    try:
        return Role(role)
    except ValueError:
        return None


@dataclass(frozen=True)
class Task:
    """One unit of setup work: ``init:policy``, ``init:generation``, ``init:env``, ``refit:initial``."""

    name: str
    role: str  # policy | generation | env | refit
    backend: str | None  # the backend it runs; None for core tasks


@dataclass(frozen=True)
class Edge:
    """``dst`` starts only after ``src`` has finished, for ``reason`` (rule ``rule`` of :mod:`rlcore.setup.planner`)."""

    src: str
    dst: str
    reason: str
    rule: int


@dataclass(frozen=True)
class Wait:
    """``task`` starts at once but waits *inside* its init for ``target``, which
    ``producer`` makes available (an atomically published artifact or a core event)."""

    task: str
    target: str
    kind: str  # artifact | event
    producer: str
    reason: str


#: How each landing reads in the schedule line (:meth:`Schedule.describe`).
_LANDS = {
    "between_calls": "refits land between the engine's calls",
    "pause": "refits land while the engine pauses its requests in flight",
    "between_steps": "refits land between two engine steps, requests in flight",
}


@dataclass(frozen=True)
class Schedule:
    """How the training loop overlaps generation with training, decided before start.

    Built from ``grpo.max_staleness`` and the declarations of the policy
    (``max_staleness``) and generation (``inflight_refit``) backends
    (:func:`rlcore.setup.schedule.plan_schedule`); ``rlcore plan`` prints it and the
    loop reads it (``session.plan.schedule``).

    Attributes:
        max_staleness: ``grpo.max_staleness`` (k): the rollouts of up to k steps ahead are
            sampled while a step trains, and no sample more than k versions old is trained
            on. 0: synchronous.
        landing: how a refit reaches the generation (a
            :class:`rlcore.declarations.RefitLanding` value), from its declaration under
            this config.
        token_versions: the generation reports the version of each token.
        policy_max: the most the policy backend declares it trains on (its ``max_staleness``).
        policy: the policy backend's name.
        generation: the generation backend's name.
        reason: why this landing: the declaration entry that applies, or that none does.
        handoff: the colocated roles hand the devices to each other each step
            (``placement.memory_handoff`` and a backend that declares it), so they take
            turns and nothing can overlap (k must be 0).
    """

    max_staleness: int
    landing: str
    token_versions: bool
    policy_max: int
    policy: str
    generation: str
    reason: str = ""
    handoff: bool = False

    @property
    def asynchronous(self) -> bool:
        """Generation runs ahead of training (k > 0)."""
        return self.max_staleness > 0

    def describe(self) -> str:
        """The one line ``rlcore plan`` prints."""
        k = self.max_staleness
        if not self.asynchronous:
            allows = (
                f"; {self.policy} allows grpo.max_staleness up to {self.policy_max}"
                + (" with placement.memory_handoff=false" if self.handoff else "")
                if self.policy_max else ""
            )
            return (
                f"schedule: synchronous (grpo.max_staleness {k}): generation waits through each "
                f"train step and refit{allows}"
            )
        versions = ", per-token versions" if self.token_versions else ""
        return (
            f"schedule: asynchronous, grpo.max_staleness {k} ({self.policy} trains on samples up "
            f"to {self.policy_max} versions old); {_LANDS.get(self.landing, self.landing)} "
            f"({self.generation}{': ' + self.reason if self.reason else ''}){versions}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``rlcore plan --json``'s ``schedule``)."""
        return {
            "max_staleness": self.max_staleness,
            "asynchronous": self.asynchronous,
            "landing": self.landing,
            "token_versions": self.token_versions,
            "policy_max": self.policy_max,
            "policy": self.policy,
            "generation": self.generation,
            "reason": self.reason,
            "handoff": self.handoff,
        }


@dataclass(frozen=True)
class RefitContent:
    """What every refit carries from the policy to the generation, and why.

    Attributes:
        kind: ``weights`` (every weight as the policy trains it), ``merged`` (a policy
            that trains LoRA adapters sends each adapted weight as base + the adapters'
            product, under the base weight's name) or ``adapters`` (the adapters alone, to
            a generation that declares ``takes_adapters``).
        why: the reason, in words (``rlcore plan``).
    """

    kind: str
    why: str

    def describe(self) -> str:
        return f"refit content: {self.kind} ({self.why})"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "why": self.why}


@dataclass(frozen=True)
class Plan:
    tasks: tuple[Task, ...]
    edges: tuple[Edge, ...]
    waits: tuple[Wait, ...] = ()
    #: The longest chain over edges and waits with every task counted as 1
    #: (:data:`CRITICAL_PATH_BASIS`): which tasks the declarations put in a row, not which
    #: take longest (:meth:`timed_critical_path` weighs a chain by measured times).
    critical_path: tuple[str, ...] = ()
    #: task name -> event names the core posts when that task finishes.
    posts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: The refit transport chosen from both declarations and the placement.
    refit_transport: str | None = None
    #: init task -> the artifacts it produces that another selected backend needs under
    #: this config (the init may skip producing the others: ``InitContext.artifact_needed``).
    consumed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: On a cluster with GPUs: which GPU bundle each policy and generation rank gets, and
    #: which ranks share a GPU (:func:`rlcore.config.placement.device_layout`); None on CPUs.
    devices: DeviceLayout | None = None
    #: How the loop overlaps generation with training (``grpo.max_staleness`` and the
    #: declarations); None for a plan built without the run's declarations.
    schedule: Schedule | None = None
    #: What each refit carries (full or merged weights); None for a plan built without
    #: the run's declarations.
    refit_content: RefitContent | None = None

    # Indexes built once per plan (a plan of 1,000 groups is walked task by task).
    @cached_property
    def _by_name(self) -> dict[str, Task]:
        return {t.name: t for t in self.tasks}

    @cached_property
    def _adjacency(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """(predecessors, successors) of every task, over edges."""
        preds: dict[str, list[str]] = {n: [] for n in self.names}
        succs: dict[str, list[str]] = {n: [] for n in self.names}
        for e in self.edges:
            preds[e.dst].append(e.src)
            succs[e.src].append(e.dst)
        return preds, succs

    def task(self, name: str) -> Task:
        return self._by_name[name]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def predecessors(self, name: str) -> list[str]:
        return list(self._adjacency[0].get(name, ()))

    def successors(self, name: str) -> list[str]:
        return list(self._adjacency[1].get(name, ()))

    def deps(self) -> dict[str, list[str]]:
        """Task -> the tasks it starts after (edges only; a wait is not an edge)."""
        return {n: list(d) for n, d in self._adjacency[0].items()}

    @cached_property
    def _position(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    @cached_property
    def _before(self) -> dict[str, int]:
        """Task -> the tasks it starts after, directly or not, as a bitset (bit i: the i-th
        task): built once in topological order, so every reachability question is one bit
        test (``rlcore plan`` lists every overlapping pair, 500,000 of them at 1,000 groups)."""
        bit = {n: 1 << i for n, i in self._position.items()}
        preds = self._adjacency[0]
        out: dict[str, int] = {}
        for n in self.topological_order():
            acc = 0
            for d in preds.get(n, ()):
                acc |= out[d] | bit[d]
            out[n] = acc
        return out

    def has_path(self, src: str, dst: str) -> bool:
        """True if ``dst`` is reachable from ``src`` over edges (``dst`` waits for ``src``)."""
        at = self._position.get(src)
        return at is not None and dst in self._before and bool(self._before[dst] >> at & 1)

    def may_overlap(self, a: str, b: str) -> bool:
        """Two tasks may run at the same time iff neither waits for the other over edges."""
        return a != b and not self.has_path(a, b) and not self.has_path(b, a)

    def overlapping_pairs(self) -> list[tuple[str, str]]:
        names, before = self.names, self._before
        return [
            (a, b)
            for i, a in enumerate(names)
            for j, b in enumerate(names[i + 1 :], i + 1)
            if not (before[b] >> i & 1 or before[a] >> j & 1)
        ]

    def topological_order(self) -> list[str]:
        """Task names, each after the tasks it starts after; :class:`PlanError` on a cycle."""
        return topological_order(self.names, self.deps())

    def timed_critical_path(self, durations: Mapping[str, float]) -> tuple[float, list[str]]:
        """The longest chain over the plan's *edges* weighted by ``durations`` (seconds by
        task; a task without one weighs 0): (its seconds, the chain). A run's
        ``timing/setup/critical_path_s`` and ``rlcore plan --measured RUN_DIR``. In-init
        waits are inside a task's duration, so no wait is an edge here; the structural
        :attr:`critical_path` counts them, each task weighing 1."""
        names = [n for n in self.names if n in durations] or list(durations)
        return longest_path(names, self.deps(), durations)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form printed by ``rlcore plan --json``."""
        return {
            "tasks": [{"name": t.name, "role": t.role, "backend": t.backend} for t in self.tasks],
            "edges": [
                {"from": e.src, "to": e.dst, "reason": e.reason, "rule": e.rule} for e in self.edges
            ],
            "waits": [
                {
                    "task": w.task,
                    "waits_for": w.target,
                    "kind": w.kind,
                    "produced_by": w.producer,
                    "reason": w.reason,
                }
                for w in self.waits
            ],
            "critical_path": list(self.critical_path),
            "critical_path_basis": CRITICAL_PATH_BASIS,
            "refit_transport": self.refit_transport,
            "posts": {k: list(v) for k, v in self.posts.items()},
            "artifacts_needed": {k: list(v) for k, v in self.consumed.items()},
            "overlapping": [list(p) for p in self.overlapping_pairs()],
            "devices": self.devices.to_dict() if self.devices is not None else None,
            "schedule": self.schedule.to_dict() if self.schedule is not None else None,
            "refit_content": self.refit_content.to_dict() if self.refit_content is not None else None,
        }


def longest_path(
    names: Iterable[str],
    deps: Mapping[str, Iterable[str]],
    duration: Mapping[str, float],
) -> tuple[float, list[str]]:
    """Longest chain through ``deps`` (task -> tasks it waits for) weighted by ``duration``.

    Returns (total, chain from first to last). Used for the plan's critical path
    (unit durations) and for the measured ``critical_path_s`` (real durations).
    """
    # Iterative (a chain of 1,000 groups is deeper than Python's recursion limit): each
    # node's best predecessor, in topological order, then the chain read back.
    order = topological_order(list(names), deps)
    best: dict[str, tuple[float, str | None]] = {}
    for n in order:
        prev = max(deps.get(n, ()), key=lambda d: best[d][0], default=None)
        base = best[prev][0] if prev is not None else 0.0
        best[n] = (base + duration.get(n, 0.0), prev)
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return 0.0, []
    last = max(wanted, key=lambda n: best[n][0])
    chain: list[str] = []
    at: str | None = last
    while at is not None:
        chain.append(at)
        at = best[at][1]
    return best[last][0], chain[::-1]

"""Synthetic worker groups and instant tasks: the planner and executor at scale, no backend.

``bench/scale.py`` times them and ``tests/setup/test_setup_scale.py`` checks them. A run of
``n`` groups has one policy that publishes a checkpoint atomically, ``0.6 n``
generation replicas (every second one reads the checkpoint, so it waits for it inside
its init; the others are fed by the first refit), and environments: most need the
generation endpoint, one in 25 is not overlap-safe and must run alone.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from rlcore.config import RunConfig, load_config
from rlcore.declarations import (
    ENDPOINT_EVENT,
    Artifact,
    BackendDeclaration,
    Condition,
    Need,
    OverlapSafety,
    Role,
)
from rlcore.errors import CancelToken
from rlcore.setup.events import EventBoard
from rlcore.setup.executor import ExecutionResult, TaskRun, TaskSpec, execute
from rlcore.setup.plan import Plan
from rlcore.setup.planner import Group, plan_groups, role_view

P, G, E = Role.POLICY, Role.GENERATION, Role.ENV
CHECKPOINT = "synthetic.checkpoint"

POLICY = BackendDeclaration(
    name="sim-policy", roles={P}, produces=(Artifact(CHECKPOINT, atomic=True, role=P),),
    send_transports={"collective"},
)
READER = BackendDeclaration(
    name="sim-reader", roles={G},
    needs=(Need(CHECKPOINT, role=G, when=(Condition("refit_fed", False),)),),
    receive_transports={"collective"}, openai_endpoint=True,
)
FED = BackendDeclaration(name="sim-fed", roles={G}, receive_transports={"collective"}, openai_endpoint=True)
GYM = BackendDeclaration(name="sim-gym", roles={E}, needs=(Need(ENDPOINT_EVENT, kind="event"),))
LONELY = BackendDeclaration(
    name="sim-lonely", roles={E}, overlap=OverlapSafety(non_colocated=False, reason="binds a port")
)


def config(*overrides: str) -> RunConfig:
    """A run config selecting the synthetic backends."""
    return load_config(
        None,
        ["policy.backend=sim-policy", "generation.backend=sim-reader", "env.backend=sim-gym", *overrides],
    )


def groups(cfg: RunConfig, n: int) -> list[Group]:
    """``n`` groups: 1 policy, ``int(0.6 n)`` generation replicas, the rest environments."""
    views = {
        d.name: role_view(cfg, r, d)
        for r, d in ((P, POLICY), (G, READER), (G, FED), (E, GYM), (E, LONELY))
    }
    gens = max(1, int(0.6 * n))
    out = [Group("init:policy", P, POLICY, views[POLICY.name])]
    for i in range(gens):
        decl = READER if i % 2 else FED
        out.append(Group(f"init:generation/{i}", G, decl, views[decl.name]))
    for i in range(n - 1 - gens):
        decl = LONELY if i % 25 == 24 else GYM
        out.append(Group(f"init:env/{i}", E, decl, views[decl.name]))
    return out


def instant_tasks(plan: Plan, board: EventBoard, ran: Counter[str]) -> list[TaskSpec]:
    """One task per plan task, doing no work: it waits (through ``board``, as a real init
    waits) for what the plan says it waits for, counts itself in ``ran``, and posts what
    it produces (the plan's events, and each artifact another group reads)."""
    waits: dict[str, list[str]] = {}
    for w in plan.waits:
        waits.setdefault(w.task, []).append(w.target if w.kind == "event" else f"{w.target}@{w.producer}")
    made = {
        t: [*plan.posts.get(t, ()), *(f"{a}@{t}" for a in plan.consumed.get(t, ()))] for t in plan.names
    }
    lock = threading.Lock()

    def run_of(name: str) -> Any:
        def run(r: TaskRun) -> None:
            for event in waits.get(name, ()):
                board.wait(event, r.deadline, waiter=name)
            with lock:
                ran[name] += 1
            for event in made[name]:
                board.post(event)

        return run

    return [
        TaskSpec(name=n, deps=plan.predecessors(n), run=run_of(n), deadline_s=120) for n in plan.names
    ]


def run_plan(plan: Plan) -> tuple[ExecutionResult, Counter[str]]:
    """Execute ``plan`` with :func:`instant_tasks`; the result and how often each task ran."""
    cancel = CancelToken()
    board = EventBoard(cancel)
    ran: Counter[str] = Counter()
    result = execute(instant_tasks(plan, board, ran), cancel=cancel, on_cancel=lambda _r: board.wake_all())
    return result, ran


def plan(cfg: RunConfig, n: int) -> Plan:
    """The plan of :func:`groups` ``(cfg, n)`` on a CPU host."""
    return plan_groups(cfg, groups(cfg, n), accelerator="cpu")

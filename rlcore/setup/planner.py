"""The setup planner: declarations + config -> a DAG of setup tasks, every edge explained.

Rules (docs/decisions.md, "The plan", says why they are these):

1. X needs artifact A that Y publishes: if Y publishes A atomically, X starts at
   once and waits inside its init for A; otherwise X starts after Y.
2. A backend that is not overlap-safe in this placement runs alone.
3. Colocated policy and generation overlap only if both declare it safe;
   otherwise generation first, then policy.
4. ``refit:initial`` runs as soon as policy and generation are both up; a
   refit-fed generation serves only after it.
5. An env that needs the generation endpoint starts at once and waits for it
   inside its init; it never blocks the refit that makes the endpoint serve.

The rules apply to worker groups: a run from a config has one per role, and
:func:`plan_groups` plans any number (generation replicas, several envs) in time
linear in groups and edges (``bench/scale.py``: 1,000 groups planned and run with
instant tasks well under a second).

The plan also carries the loop's schedule (:func:`rlcore.setup.schedule.plan_schedule`:
``grpo.max_staleness`` against the policy's and generation's declarations).

The planner imports no heavy dependency: ``rlcore plan`` runs anywhere.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcore.config import RunConfig, resolve_options
from rlcore.config.placement import DeviceLayout, device_layout
from rlcore.declarations import ENDPOINT_EVENT, BackendDeclaration, Role, Transport
from rlcore.errors import ConfigError, PlanError
from rlcore.lora import check_lora_request, requested_lora
from rlcore.setup.graph import topological_order
from rlcore.setup.plan import (
    REFIT_TASK,
    Edge,
    Plan,
    RefitContent,
    Task,
    Wait,
    init_task,
    longest_path,
)
from rlcore.setup.schedule import plan_schedule

# When two inits may not overlap, this order decides who goes first: generation
# engines that profile free device memory must measure before policy fills it.
_ROLE_ORDER = {Role.GENERATION: 0, Role.POLICY: 1, Role.ENV: 2}


def selected_roles(config: RunConfig) -> list[Role]:
    """Roles the run starts, in plan order (env only when ``env.backend`` is set)."""
    roles = [Role.POLICY, Role.GENERATION]
    if config.env.backend:
        roles.append(Role.ENV)
    return roles


def role_view(
    config: RunConfig, role: Role, decl: BackendDeclaration | None = None, *, resolved: Any = None
) -> dict[str, Any]:
    """The view of the config that declaration conditions are evaluated against.

    ``resolved``: ``role``'s options already resolved against ``decl``'s options
    dataclass (:func:`rlcore.setup.prepared.prepare`); ``None`` resolves them here.
    """
    section = getattr(config, role.value)
    options: Any = dict(section.options)
    if decl is not None and decl.options is not None:
        if resolved is None:
            resolved = resolve_options(section.options, decl.options, section=role.value, backend=decl.name)
        options = dataclasses.asdict(resolved)
    return {
        "role": role.value,
        "workers": section.workers,
        "colocated": bool(config.placement.colocated) and role in (Role.POLICY, Role.GENERATION),
        "refit_fed": bool(getattr(section, "refit_fed", False)),
        "options": options,
    }


def _conditions(need_or_artifact: Any) -> str:
    when = getattr(need_or_artifact, "when", ())
    if not when:
        return ""
    return " (because " + " and ".join(c.describe() for c in when) + ")"


def detect_accelerator() -> str:
    """``cuda`` if this host has NVIDIA devices, else ``cpu`` (without importing torch)."""
    return "cuda" if os.path.exists("/dev/nvidiactl") else "cpu"


def choose_transport(
    config: RunConfig,
    policy: BackendDeclaration,
    generation: BackendDeclaration,
    *,
    accelerator: str | None = None,
) -> str:
    """The refit transport both sides support and the core runs, best first for the placement.

    Only transports the core implements (:mod:`rlcore.refit.transports`) and that work
    on this host's accelerator are chosen. ``refit.transport`` other than ``auto`` is
    honoured if both sides declare it and the core can run it here; otherwise the
    error says which of the three fails.
    """
    from rlcore.refit import transports

    accelerator = accelerator or detect_accelerator()
    usable = transports.implemented(accelerator)
    common = policy.send_transports & generation.receive_transports
    requested = config.refit.transport
    sides = (
        f"policy backend '{policy.name}' sends over {sorted(map(str, policy.send_transports))}, "
        f"generation backend '{generation.name}' receives over "
        f"{sorted(map(str, generation.receive_transports))}"
    )
    if requested != "auto":
        if Transport(requested) not in common:
            raise ConfigError(
                f"config key 'refit.transport' is '{requested}', but {sides}; pick one both "
                "support or 'auto'",
                key="refit.transport",
            )
        if Transport(requested) not in usable:
            impl = transports.implemented().get(Transport(requested))
            why = (
                f"it needs {impl.accelerator} and this host has {accelerator}"
                if impl is not None
                else "the core does not implement it"
            )
            raise ConfigError(
                f"config key 'refit.transport' is '{requested}', which cannot run here: {why}; "
                f"pick one of {sorted(t.value for t in common if t in usable)} or 'auto'",
                key="refit.transport",
            )
        return requested
    for t in transports.preferred(config.placement.colocated):
        if t in common and t in usable:
            return t.value
    raise PlanError(
        f"no refit transport in common that the core runs here: {sides}; the core runs "
        f"{sorted(t.value for t in usable)} on this host (placement colocated="
        f"{config.placement.colocated}, accelerator={accelerator})"
    )


@dataclass(frozen=True)
class Group:
    """One worker group the setup starts: an init task for one backend in one role.

    A run from a config has one group per selected role (``init:policy``...); a plan
    may hold many (generation replicas, several envs: :func:`groups_for`), each with
    its own declaration and config view.

    Attributes:
        task: the init task's name (``init:generation`` or ``init:generation/3``).
        role: the role it serves.
        declaration: its backend's declaration.
        view: the config view its declaration's conditions read (:func:`role_view`).
    """

    task: str
    role: Role
    declaration: BackendDeclaration
    view: Mapping[str, Any]


def groups_for(
    config: RunConfig,
    declarations: Mapping[Role, BackendDeclaration],
    replicas: Mapping[Role, int] | None = None,
    *,
    options: Mapping[Role, Any] | None = None,
) -> list[Group]:
    """The groups of a run: ``replicas[role]`` groups per selected role (default one).

    One group keeps the role's task name (``init:policy``); several are numbered
    (``init:generation/0``...). Replicas of a role share its declaration and view.
    ``options``: each role's resolved options (resolved here when not given).
    """
    groups = []
    for role in selected_roles(config):
        decl = declarations[role]
        view = role_view(config, role, decl, resolved=(options or {}).get(role))  # once per role
        count = (replicas or {}).get(role, 1)
        base = init_task(role)
        names = [base] if count == 1 else [f"{base}/{i}" for i in range(count)]
        groups += [Group(name, role, decl, view) for name in names]
    return groups


@dataclass
class _Planning:
    """What the rules read (config, the groups) and the graph they add to: edges
    (start after) and waits (start at once, wait inside). ``deps`` is kept up to date
    as edges and waits are added, so no rule rebuilds it (plans of 1,000 groups)."""

    config: RunConfig
    groups: list[Group]
    edges: list[Edge] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    posts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    consumed: dict[str, list[str]] = field(default_factory=dict)
    edge_deps: dict[str, list[str]] = field(default_factory=dict)
    all_deps: dict[str, list[str]] = field(default_factory=dict)
    edge_set: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.position = {g.task: i for i, g in enumerate(self.groups)}
        self.generation = [g for g in self.groups if g.role is Role.GENERATION]
        self.policy = [g for g in self.groups if g.role is Role.POLICY]

    @property
    def gen(self) -> Group:
        return self.generation[0]

    @property
    def refit_fed(self) -> bool:
        return bool(self.config.generation.refit_fed)

    @property
    def endpoint_producer(self) -> str:
        """The task after which the generation endpoint serves real weights: the one
        generation init, or ``refit:initial`` when it is refit-fed or there are several
        replicas (then all of them are up and hold the same weights)."""
        if self.refit_fed or len(self.generation) > 1:
            return REFIT_TASK
        return self.gen.task

    def add_edge(self, edge: Edge) -> None:
        if (edge.src, edge.dst) in self.edge_set:
            return
        self.edge_set.add((edge.src, edge.dst))
        self.edges.append(edge)
        self.edge_deps.setdefault(edge.dst, []).append(edge.src)
        self.all_deps.setdefault(edge.dst, []).append(edge.src)

    def add_wait(self, wait: Wait) -> None:
        self.waits.append(wait)
        self.all_deps.setdefault(wait.task, []).append(wait.producer)


def _check_roles(config: RunConfig, declarations: Mapping[Role, BackendDeclaration]) -> None:
    """Each selected role has a declaration that serves it."""
    for role in selected_roles(config):
        if role not in declarations:
            raise PlanError(f"no declaration given for role '{role}' ({role.value}.backend)")


def _check_groups(config: RunConfig, groups: list[Group]) -> None:
    """Each group's backend serves its role with no more workers than it declares
    (``max_workers``); refit-fed only if every generation declares it; at least one policy
    and one generation group."""
    for role in (Role.POLICY, Role.GENERATION):
        if not any(g.role is role for g in groups):
            raise PlanError(f"no {role.value} group to plan ({role.value}.backend)")
    seen: set[tuple[int, Role]] = set()
    for g in groups:
        if (id(g.declaration), g.role) in seen:
            continue  # replicas of one backend: checked once
        seen.add((id(g.declaration), g.role))
        decl = g.declaration
        if not decl.serves(g.role):
            raise ConfigError(
                f"config key '{g.role.value}.backend' selects '{decl.name}', which does not serve "
                f"role '{g.role}' (it serves {sorted(r.value for r in decl.roles)})",
                key=f"{g.role.value}.backend",
            )
        workers = g.view.get("workers")
        if decl.max_workers is not None and isinstance(workers, int) and workers > decl.max_workers:
            raise ConfigError(
                f"config key '{g.role.value}.workers' is {workers}, but {g.role.value} backend "
                f"'{decl.name}' runs at most {decl.max_workers} worker"
                f"{'s' if decl.max_workers != 1 else ''} (its declared max_workers); set "
                f"{g.role.value}.workers to at most {decl.max_workers}",
                key=f"{g.role.value}.workers",
            )
        if g.role is Role.GENERATION and config.generation.refit_fed and not decl.refit_fed:
            raise ConfigError(
                f"config key 'generation.refit_fed' is true, but generation backend '{decl.name}' "
                "does not declare a refit-fed start; set generation.refit_fed=false",
                key="generation.refit_fed",
            )


def _producers(p: _Planning) -> dict[str, dict[Role, tuple[Group, Any]]]:
    """Artifact name -> role -> the first group of that role producing it, and the artifact
    (built once, so a need is matched in constant time whatever the number of groups)."""
    index: dict[str, dict[Role, tuple[Group, Any]]] = {}
    for g in p.groups:
        for a in g.declaration.produced(g.role, g.view):
            index.setdefault(a.name, {}).setdefault(g.role, (g, a))
    return index


def _rule_1_artifacts(
    p: _Planning, g: Group, need: Any, index: dict[str, dict[Role, tuple[Group, Any]]]
) -> None:
    """Rule 1: an artifact need is a wait when published atomically, else an edge (the
    first group of another role that produces it, in group order)."""
    decl, me = g.declaration, g.task
    producers = [x for role, x in index.get(need.name, {}).items() if role is not g.role]
    if not producers:
        raise PlanError(
            f"{me} ({decl.name}) needs artifact '{need.name}'{_conditions(need)}, but no "
            "selected backend produces it under this config"
        )
    prod, art = min(producers, key=lambda x: p.position[x[0].task])
    them, producer = prod.task, prod.declaration.name
    needed = p.consumed.setdefault(them, [])
    if need.name not in needed:
        needed.append(need.name)
    why = need.reason or f"{decl.name} reads it"
    if art.atomic:
        p.add_wait(Wait(
            me, need.name, "artifact", them,
            f"{me} needs '{need.name}'{_conditions(need)} ({why}); {producer} publishes it "
            f"atomically, so {me} starts at once and waits for it inside its init (rule 1)",
        ))
    else:
        p.add_edge(Edge(
            them, me,
            f"{me} needs '{need.name}'{_conditions(need)} ({why}), which {producer} does not "
            f"publish atomically: {me} starts after {them} (rule 1)",
            1,
        ))


def _check_endpoint(p: _Planning, g: Group) -> None:
    """Rule 5's preconditions: the generation declares an endpoint and serves it under this config."""
    decl, gen = g.declaration, p.gen.declaration
    if not gen.openai_endpoint:
        raise PlanError(
            f"{g.task} ({decl.name}) needs the generation endpoint, but generation backend "
            f"'{gen.name}' declares no OpenAI-compatible endpoint; choose a generation backend "
            "with openai_endpoint=True"
        )
    view = p.gen.view
    if not gen.serves_endpoint(view):
        wanted = " and ".join("generation." + c.describe() for c in gen.openai_endpoint_when)
        raise ConfigError(
            f"{g.task} ({decl.name}) needs the generation endpoint, but generation backend "
            f"'{gen.name}' serves one only when {wanted}; set that in the config",
            key="generation." + next(c.key for c in gen.openai_endpoint_when if not c.holds(view)),
        )


def _rule_5_endpoint(p: _Planning, g: Group) -> None:
    """Rule 5: an init that needs the generation endpoint starts at once and waits for it."""
    _check_endpoint(p, g)
    if p.refit_fed:
        serving = "after refit:initial, since generation is refit-fed"
    elif len(p.generation) > 1:
        serving = "after refit:initial, once all its replicas are up with the same weights"
    else:
        serving = "when init:generation finishes"
    p.add_wait(Wait(
        g.task, ENDPOINT_EVENT, "event", p.endpoint_producer,
        f"{g.declaration.name} talks to the model through the generation endpoint, which "
        f"serves {serving}; {g.task} starts at once and waits for it inside its init, so it "
        "never blocks that refit (rule 5)",
    ))


def _needs(p: _Planning) -> None:
    """Rules 1 and 5: every need in force becomes a wait or an edge."""
    index = _producers(p)
    for g in p.groups:
        for need in g.declaration.needed(g.role, g.view):
            if need.kind == "event":
                if need.name == ENDPOINT_EVENT:
                    _rule_5_endpoint(p, g)
            else:
                _rule_1_artifacts(p, g, need, index)


def _overlap_order(p: _Planning) -> list[Group]:
    """The groups in the order rules 2 and 3 serialize them: role order (generation, policy,
    env), then declaration order, except that a group comes after everything it waits for
    (an edge or an in-init wait, counting the first refit's need of every policy and
    generation group): ordering never deadlocks a wait. Kahn's algorithm with a heap."""
    import heapq

    key = {g.task: (_ROLE_ORDER[g.role], p.position[g.task]) for g in p.groups}
    key[REFIT_TASK] = (len(_ROLE_ORDER), len(p.groups))
    deps = {n: list(d) for n, d in p.all_deps.items()}
    deps.setdefault(REFIT_TASK, []).extend(g.task for g in p.policy + p.generation)
    remaining = {n: len(set(deps.get(n, ()))) for n in key}
    dependents: dict[str, list[str]] = {}
    for n, ds in deps.items():
        for d in set(ds):
            dependents.setdefault(d, []).append(n)
    ready = [(k, n) for n, k in key.items() if not remaining[n]]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for child in dependents.get(n, ()):
            remaining[child] -= 1
            if not remaining[child]:
                heapq.heappush(ready, (key[child], child))
    if len(order) < len(key):  # a cycle: topological_order names it at the end of planning
        order += [n for n in key if n not in set(order)]
    by_task = {g.task: g for g in p.groups}
    return [by_task[n] for n in order if n in by_task]


def _serialize(p: _Planning, first: Group, second: Group, colocated: bool) -> None:
    """Add the edge ``first`` -> ``second`` of rule 2 (or 3, colocated), with its reason."""
    placement = "colocated" if colocated else "non-colocated"
    because = "; ".join(
        f"{d.name} is not overlap-safe under {placement} placement"
        + (f" ({d.overlap.reason})" if d.overlap.reason else "")
        for d in dict.fromkeys((first.declaration, second.declaration))
        if not (d.overlap.colocated if colocated else d.overlap.non_colocated)
    )
    if colocated:
        reason = (f"{because}: colocated {first.task} and {second.task} do not overlap, "
                  f"{first.task} first (rule 3)")
        p.add_edge(Edge(first.task, second.task, reason, 3))
    else:
        reason = f"{because}: it runs alone, {first.task} before {second.task} (rule 2)"
        p.add_edge(Edge(first.task, second.task, reason, 2))


def _chain(p: _Planning, order: list[Group], barrier: Any, colocated: bool) -> None:
    """Serialize every pair with a barrier in it along ``order``, in O(groups) edges: the
    groups since the last barrier all run before the next barrier, which runs before every
    group after it (so a barrier overlaps nothing, and the others still overlap each other)."""
    last: Group | None = None
    since: list[Group] = []
    for g in order:
        if barrier(g):
            for before in since or ([last] if last is not None else []):
                _serialize(p, before, g, colocated)
            last, since = g, []
        else:
            if last is not None:
                _serialize(p, last, g, colocated)
            since.append(g)


def _rules_2_3_overlap(p: _Planning) -> None:
    """Rules 2 and 3: inits that may not overlap are ordered along :func:`_overlap_order`.

    A pair of colocated groups (policy and generation under colocated placement) is
    governed by their colocated safety (rule 3); any other pair by non-colocated safety
    (rule 2). A colocated group that is not non-colocated-safe is ordered against each
    non-colocated group one by one (a rare declaration: it costs groups x envs edges).
    """
    order = _overlap_order(p)
    colocated = [g for g in order if g.view["colocated"]]
    _chain(p, colocated, lambda g: not g.declaration.overlap.colocated, True)
    _chain(
        p, order,
        lambda g: not g.view["colocated"] and not g.declaration.overlap.non_colocated, False,
    )
    lonely = [g for g in colocated if not g.declaration.overlap.non_colocated]
    if lonely:
        at = {g.task: i for i, g in enumerate(order)}
        others = [g for g in order if not g.view["colocated"]]
        for a in lonely:
            for b in others:
                first, second = (a, b) if at[a.task] < at[b.task] else (b, a)
                _serialize(p, first, second, False)


def _rule_4_first_refit(p: _Planning) -> None:
    """Rule 4: the first refit needs every policy and generation group up, and nothing else."""
    for g in p.policy + p.generation:
        if p.refit_fed:
            reason = (
                "generation is refit-fed (generation.refit_fed == True): it holds no weights until "
                f"refit:initial, which needs {g.task} up (rule 4)"
            )
        else:
            reason = f"the first weight sync needs {g.task} up (rule 4)"
        p.add_edge(Edge(g.task, REFIT_TASK, reason, 4))


def _choose_group_transport(p: _Planning, accelerator: str | None) -> str:
    """One transport for the whole run: every (policy, generation) backend pair must agree."""
    chosen = {
        choose_transport(p.config, pol, gen, accelerator=accelerator)
        for pol in {id(g.declaration): g.declaration for g in p.policy}.values()
        for gen in {id(g.declaration): g.declaration for g in p.generation}.values()
    }
    if len(chosen) > 1:
        raise PlanError(
            f"the policy and generation groups would refit over different transports "
            f"({sorted(chosen)}); set refit.transport to one all of them support"
        )
    return chosen.pop()


def build_plan(
    config: RunConfig,
    declarations: Mapping[Role, BackendDeclaration],
    *,
    options: Mapping[Role, Any] | None = None,
    accelerator: str | None = None,
) -> Plan:
    """Turn the config and the selected backends' declarations into a setup plan.

    ``declarations`` maps each role the config selects to its backend's declaration;
    ``options`` each role's resolved options (resolved here when not given).
    Raises :class:`ConfigError` for a config the declarations cannot serve and
    :class:`PlanError` for needs nobody meets.
    """
    _check_roles(config, declarations)
    check_adapters(config, declarations)
    groups = groups_for(config, declarations, options=options)
    return plan_groups(config, groups, accelerator=accelerator)


def plan_groups(
    config: RunConfig, groups: list[Group], *, accelerator: str | None = None
) -> Plan:
    """The setup plan of any number of worker groups (:func:`build_plan` makes one per role).

    Every step is linear in groups + edges (``bench/scale.py`` measures 10 to 1,000
    groups): needs are matched through an index, rules 2 and 3 chain the groups that
    must run alone instead of ordering every pair.
    """
    _check_groups(config, groups)
    if len({g.task for g in groups}) != len(groups):
        raise PlanError("two groups have the same task name")
    p = _Planning(config, groups)
    schedule = plan_schedule(
        config,
        list({id(g.declaration): g.declaration for g in p.policy}.values()),
        [(g.declaration, g.view) for g in p.generation],
    )
    transport = _choose_group_transport(p, accelerator)
    if p.gen.declaration.serves_endpoint(p.gen.view):
        p.posts[p.endpoint_producer] = (ENDPOINT_EVENT,)
    _needs(p)
    _rules_2_3_overlap(p)
    _rule_4_first_refit(p)

    tasks = [Task(g.task, g.role.value, g.declaration.name) for g in groups]
    tasks.append(Task(REFIT_TASK, "refit", None))
    names = [t.name for t in tasks]
    topological_order(names, p.all_deps)  # the waits may not close a cycle with the edges
    _, chain = longest_path(names, p.all_deps, {n: 1.0 for n in names})
    return Plan(
        tasks=tuple(tasks),
        edges=tuple(p.edges),
        waits=tuple(p.waits),
        critical_path=tuple(chain),
        posts=p.posts,
        consumed={task: tuple(names) for task, names in p.consumed.items()},
        refit_transport=transport,
        devices=_devices(config, accelerator),
        schedule=schedule,
        refit_content=_refit_content(p),
    )


def check_adapters(config: RunConfig, declarations: Mapping[Role, BackendDeclaration]) -> None:
    """``policy.options.lora`` only for a policy backend that declares ``trains_adapters``
    (before its options are checked: the refusal says why, not 'unknown option')."""
    policy = declarations.get(Role.POLICY)
    if policy is not None:
        check_lora_request(config.policy.options, backend=policy.name, trains_adapters=policy.trains_adapters)


def _refit_content(p: _Planning) -> RefitContent:
    """Full weights; where the policy trains adapters, the adapters alone if the generation
    takes them in place (contract 2.6) and ``refit.adapters`` allows, else merged weights."""
    adapted = [g for g in p.policy if g.declaration.trains_adapters and requested_lora(g.view["options"])]
    if not adapted:
        return RefitContent("weights", "the policy trains every weight")
    policy, gen = adapted[0].declaration.name, p.gen.declaration
    rank = adapted[0].view["options"]["lora"].get("rank", "?")
    trains = f"policy '{policy}' trains LoRA adapters (rank {rank})"
    if gen.takes_adapters and p.config.refit.adapters == "auto":
        return RefitContent(
            "adapters",
            f"{trains} and generation '{gen.name}' serves them in place: each refit carries the "
            "adapters alone, the engines load the base weights from the checkpoint",
        )
    why = (
        "refit.adapters=merged" if gen.takes_adapters
        else f"generation '{gen.name}' loads full weights (no takes_adapters)"
    )
    return RefitContent(
        "merged", f"{trains} and sends each adapted weight merged, base + adapters, as {why}"
    )


def _devices(config: RunConfig, accelerator: str | None) -> DeviceLayout | None:
    """The GPU bundles of the policy and generation ranks on a cluster with GPUs
    (``cluster.num_gpus``, else this host's accelerator)."""
    gpus = config.cluster.num_gpus
    if gpus == 0 or (gpus is None and (accelerator or detect_accelerator()) != "cuda"):
        return None
    return device_layout(config)

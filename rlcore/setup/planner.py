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

The planner imports no heavy dependency: ``rlcore plan`` runs anywhere.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcore.config import RunConfig, resolve_options
from rlcore.declarations import ENDPOINT_EVENT, BackendDeclaration, Role, Transport
from rlcore.errors import ConfigError, PlanError
from rlcore.setup.graph import topological_order, waits_for
from rlcore.setup.plan import REFIT_TASK, Edge, Plan, Task, Wait, init_task, longest_path

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
    config: RunConfig, role: Role, decl: BackendDeclaration | None = None
) -> dict[str, Any]:
    """The view of the config that declaration conditions are evaluated against."""
    section = getattr(config, role.value)
    options: Any = dict(section.options)
    if decl is not None and decl.options is not None:
        resolved = resolve_options(
            section.options, decl.options, section=role.value, backend=decl.name
        )
        options = dataclasses.asdict(resolved)
    return {
        "role": role.value,
        "workers": section.workers,
        "colocated": bool(config.placement.colocated) and role in (Role.POLICY, Role.GENERATION),
        "refit_fed": bool(getattr(section, "refit_fed", False)),
        "options": options,
    }


def _who(role: Role, decl: BackendDeclaration) -> str:
    return f"{init_task(role)} ({decl.name})"


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
    if config.placement.colocated:
        order = [Transport.CUDA_IPC, Transport.SHARED_MEMORY, Transport.COLLECTIVE, Transport.DISK]
    else:
        order = [Transport.COLLECTIVE, Transport.DISK, Transport.SHARED_MEMORY]
    for t in order:
        if t in common and t in usable:
            return t.value
    raise PlanError(
        f"no refit transport in common that the core runs here: {sides}; the core runs "
        f"{sorted(t.value for t in usable)} on this host (placement colocated="
        f"{config.placement.colocated}, accelerator={accelerator})"
    )


@dataclass
class _Planning:
    """What the rules read (config, declarations, each role's config view) and the
    graph they add to: edges (start after) and waits (start at once, wait inside)."""

    config: RunConfig
    declarations: Mapping[Role, BackendDeclaration]
    roles: list[Role]
    views: dict[Role, dict[str, Any]]
    edges: list[Edge] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    posts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    consumed: dict[str, list[str]] = field(default_factory=dict)

    @property
    def gen(self) -> BackendDeclaration:
        return self.declarations[Role.GENERATION]

    @property
    def refit_fed(self) -> bool:
        return bool(self.config.generation.refit_fed)

    @property
    def endpoint_producer(self) -> str:
        """The task after which the generation endpoint serves real weights."""
        return REFIT_TASK if self.refit_fed else init_task(Role.GENERATION)

    def deps(self, *, waits: bool = True) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for e in self.edges:
            out.setdefault(e.dst, []).append(e.src)
        for w in self.waits if waits else ():
            out.setdefault(w.task, []).append(w.producer)
        return out

    def serialized(self, a: str, b: str) -> bool:
        """One of ``a``/``b`` starts only after the other ended (a wait is not enough:
        a waiting init is running)."""
        deps = self.deps(waits=False)
        return waits_for(deps, b, a) or waits_for(deps, a, b)


def _check_roles(config: RunConfig, declarations: Mapping[Role, BackendDeclaration]) -> None:
    """Each selected role has a declaration that serves it; refit-fed only if declared."""
    for role in selected_roles(config):
        if role not in declarations:
            raise PlanError(f"no declaration given for role '{role}' ({role.value}.backend)")
        decl = declarations[role]
        if not decl.serves(role):
            raise ConfigError(
                f"config key '{role.value}.backend' selects '{decl.name}', which does not serve "
                f"role '{role}' (it serves {sorted(r.value for r in decl.roles)})",
                key=f"{role.value}.backend",
            )
    gen = declarations[Role.GENERATION]
    if config.generation.refit_fed and not gen.refit_fed:
        raise ConfigError(
            f"config key 'generation.refit_fed' is true, but generation backend '{gen.name}' "
            "does not declare a refit-fed start; set generation.refit_fed=false",
            key="generation.refit_fed",
        )


def _rule_1_artifacts(p: _Planning, role: Role, need: Any) -> None:
    """Rule 1: an artifact need is a wait when published atomically, else an edge."""
    decl, me = p.declarations[role], init_task(role)
    producers = [
        (r, a)
        for r in p.roles
        if r != role
        for a in p.declarations[r].produced(r, p.views[r])
        if a.name == need.name
    ]
    if not producers:
        raise PlanError(
            f"{_who(role, decl)} needs artifact '{need.name}'{_conditions(need)}, but no "
            "selected backend produces it under this config"
        )
    prole, art = producers[0]
    them, producer = init_task(prole), p.declarations[prole].name
    needed = p.consumed.setdefault(them, [])
    if need.name not in needed:
        needed.append(need.name)
    why = need.reason or f"{decl.name} reads it"
    if art.atomic:
        p.waits.append(Wait(
            me, need.name, "artifact", them,
            f"{me} needs '{need.name}'{_conditions(need)} ({why}); {producer} publishes it "
            f"atomically, so {me} starts at once and waits for it inside its init (rule 1)",
        ))
    else:
        p.edges.append(Edge(
            them, me,
            f"{me} needs '{need.name}'{_conditions(need)} ({why}), which {producer} does not "
            f"publish atomically: {me} starts after {them} (rule 1)",
            1,
        ))


def _rule_5_endpoint(p: _Planning, role: Role) -> None:
    """Rule 5: an init that needs the generation endpoint starts at once and waits for it."""
    decl, gen, me = p.declarations[role], p.gen, init_task(role)
    if not gen.openai_endpoint:
        raise PlanError(
            f"{_who(role, decl)} needs the generation endpoint, but generation backend "
            f"'{gen.name}' declares no OpenAI-compatible endpoint; choose a generation backend "
            "with openai_endpoint=True"
        )
    view = p.views[Role.GENERATION]
    if not gen.serves_endpoint(view):
        wanted = " and ".join("generation." + c.describe() for c in gen.openai_endpoint_when)
        raise ConfigError(
            f"{_who(role, decl)} needs the generation endpoint, but generation backend "
            f"'{gen.name}' serves one only when {wanted}; set that in the config",
            key="generation." + next(c.key for c in gen.openai_endpoint_when if not c.holds(view)),
        )
    serving = (
        "after refit:initial, since generation is refit-fed"
        if p.refit_fed
        else "when init:generation finishes"
    )
    p.waits.append(Wait(
        me, ENDPOINT_EVENT, "event", p.endpoint_producer,
        f"{decl.name} talks to the model through the generation endpoint, which serves "
        f"{serving}; {me} starts at once and waits for it inside its init, so it never blocks "
        "that refit (rule 5)",
    ))


def _needs(p: _Planning) -> None:
    """Rules 1 and 5: every need in force becomes a wait or an edge."""
    for role in p.roles:
        for need in p.declarations[role].needed(role, p.views[role]):
            if need.kind == "event":
                if need.name == ENDPOINT_EVENT:
                    _rule_5_endpoint(p, role)
            else:
                _rule_1_artifacts(p, role, need)


def _rules_2_3_overlap(p: _Planning) -> None:
    """Rules 2 and 3: inits that may not overlap are ordered, by role order unless one
    already waits for the other's output (never a deadlock)."""
    ordered = sorted(p.roles, key=lambda r: _ROLE_ORDER[r])
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            colocated = bool(p.views[a]["colocated"] and p.views[b]["colocated"])
            da, db = p.declarations[a], p.declarations[b]
            safe_a = da.overlap.colocated if colocated else da.overlap.non_colocated
            safe_b = db.overlap.colocated if colocated else db.overlap.non_colocated
            ta, tb = init_task(a), init_task(b)
            if (safe_a and safe_b) or p.serialized(ta, tb):
                continue
            first, second = (tb, ta) if waits_for(p.deps(), ta, tb) else (ta, tb)
            placement = "colocated" if colocated else "non-colocated"
            because = "; ".join(
                f"{d.name} is not overlap-safe under {placement} placement"
                + (f" ({d.overlap.reason})" if d.overlap.reason else "")
                for d, safe in ((da, safe_a), (db, safe_b))
                if not safe
            )
            if colocated:
                reason = f"{because}: colocated generation and policy do not overlap, generation first (rule 3)"
                p.edges.append(Edge(first, second, reason, 3))
            else:
                p.edges.append(Edge(first, second, f"{because}: it runs alone, {first} before {second} (rule 2)", 2))


def _rule_4_first_refit(p: _Planning) -> None:
    """Rule 4: the first refit needs both sides up, and nothing else."""
    for role in (Role.POLICY, Role.GENERATION):
        if p.refit_fed:
            reason = (
                "generation is refit-fed (generation.refit_fed == True): it holds no weights until "
                f"refit:initial, which needs {init_task(role)} up (rule 4)"
            )
        else:
            reason = f"the first weight sync needs {init_task(role)} up (rule 4)"
        p.edges.append(Edge(init_task(role), REFIT_TASK, reason, 4))


def build_plan(
    config: RunConfig,
    declarations: Mapping[Role, BackendDeclaration],
    *,
    accelerator: str | None = None,
) -> Plan:
    """Turn the config and the selected backends' declarations into a setup plan.

    ``declarations`` maps each role the config selects to its backend's declaration.
    Raises :class:`ConfigError` for a config the declarations cannot serve and
    :class:`PlanError` for needs nobody meets.
    """
    _check_roles(config, declarations)
    roles = selected_roles(config)
    p = _Planning(config, declarations, roles, {r: role_view(config, r, declarations[r]) for r in roles})
    transport = choose_transport(
        config, declarations[Role.POLICY], p.gen, accelerator=accelerator
    )
    if p.gen.serves_endpoint(p.views[Role.GENERATION]):
        p.posts[p.endpoint_producer] = (ENDPOINT_EVENT,)
    _needs(p)
    _rules_2_3_overlap(p)
    _rule_4_first_refit(p)

    tasks = [Task(init_task(r), r.value, declarations[r].name) for r in roles]
    tasks.append(Task(REFIT_TASK, "refit", None))
    names = [t.name for t in tasks]
    _, chain = longest_path(names, p.deps(), {n: 1.0 for n in names})
    plan = Plan(
        tasks=tuple(tasks),
        edges=tuple(p.edges),
        waits=tuple(p.waits),
        critical_path=tuple(chain),
        posts=p.posts,
        consumed={task: tuple(names) for task, names in p.consumed.items()},
        refit_transport=transport,
    )
    topological_order(names, p.deps())  # the waits may not close a cycle with the edges
    return plan

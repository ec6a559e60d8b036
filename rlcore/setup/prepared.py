"""A run prepared once: its backends, their options, its plan, deadlines and transport.

:func:`prepare` is the one place where the config's backends are selected, their
``<role>.options`` resolved against each backend's options dataclass, the plan built
(or a given one checked), ``setup.task_deadline_s`` validated and the refit transport
chosen. The preflight (:func:`rlcore.setup.preflight.check_before_start`) calls it and
returns its :class:`PreparedRun`; ``rlcore plan`` prints that run's plan and the setup
runner (:func:`rlcore.setup.runner.run_prepared`) runs exactly that run, selecting,
resolving and validating nothing again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.config import RunConfig, resolve_options
from rlcore.declarations import BackendDeclaration, Role
from rlcore.errors import ConfigError, PlanError
from rlcore.lora import check_lora_request
from rlcore.setup.loss import check_loss_features
from rlcore.setup.plan import REFIT_TASK, Plan, Task, init_task, role_of_task
from rlcore.setup.planner import build_plan, choose_transport, role_view, selected_roles
from rlcore.setup.schedule import plan_schedule

if TYPE_CHECKING:
    from rlcore.setup.registry import PluginInfo, Registry

__all__ = ["PreparedRun", "check_dtype", "prepare", "prepare_role", "selected_backends"]


@dataclass(frozen=True)
class PreparedRun:
    """Everything setup needs, decided before anything starts.

    Attributes:
        config: the run config (keys, types and ranges checked by
            :func:`rlcore.config.validate_run_config`).
        registry: the loaded plugins, whose hooks setup calls.
        backends: the selected backend of each role the run starts (``env`` only when
            ``env.backend`` is set), in plan order.
        options: each role's ``<role>.options``, resolved against its backend's options
            dataclass (a plain dict for a backend that declares none).
        plan: the setup plan the run executes, with the loop's schedule (``plan.schedule``).
        deadlines: the deadline in seconds of every task of the plan
            (``setup.task_deadline_s`` where it names the task, else ``setup.deadline_s``).
        transport: the refit transport (the plan's, else the one the declarations agree on;
            empty for a run of one role, which does no refit: :func:`prepare_role`).
    """

    config: RunConfig
    registry: Registry
    backends: Mapping[Role, PluginInfo]
    options: Mapping[Role, Any]
    plan: Plan
    deadlines: Mapping[str, float]
    transport: str

    @property
    def declarations(self) -> dict[Role, BackendDeclaration]:
        """The selected backends' declarations, by role."""
        return {r: i.declaration for r, i in self.backends.items() if i.declaration is not None}


def prepare(
    config: RunConfig, registry: Registry, *, plan: Plan | None = None, accelerator: str | None = None
) -> PreparedRun:
    """Select, resolve, plan and validate once; the run setup executes.

    Args:
        config: the loaded config.
        registry: the loaded plugins.
        plan: a plan to run instead of the one the declarations make (checked that setup
            can run it: ``bench/setup_overlap.py`` runs a serial one).
        accelerator: ``cuda`` or ``cpu`` for the plan's device layout; ``None`` detects it.

    Raises:
        BackendNotFoundError: a role's backend is missing (every bad key at once).
        ConfigError: bad options, a ``model.dtype`` the backends do not run, a
            ``grpo.max_staleness`` the backends or the placement cannot give
            (:func:`rlcore.setup.schedule.plan_schedule`), a ``setup.task_deadline_s``
            that names no task of the plan.
        PlanError: the declarations make no plan, or ``plan`` is one setup cannot run.
    """
    backends = selected_backends(registry, config)
    declarations = {r: i.declaration for r, i in backends.items() if i.declaration is not None}
    check_dtype(config, declarations)
    check_loss_features(config, declarations[Role.POLICY])
    check_dynamic_sampling(config, declarations.get(Role.ENV))
    options = {role: _resolved(config, role, d) for role, d in declarations.items()}
    if plan is None:
        plan = build_plan(config, declarations, options=options, accelerator=accelerator)
    elif plan.schedule is None:  # a plan made elsewhere: the loop still needs its schedule
        generation = declarations[Role.GENERATION]
        view = role_view(config, Role.GENERATION, generation, resolved=options[Role.GENERATION])
        schedule = plan_schedule(config, [declarations[Role.POLICY]], [(generation, view)])
        plan = dataclasses.replace(plan, schedule=schedule)
    _check_runnable(plan, list(backends))
    transport = plan.refit_transport or choose_transport(
        config, declarations[Role.POLICY], declarations[Role.GENERATION]
    )
    return PreparedRun(config, registry, backends, options, plan, task_deadlines(config, plan), transport)


def prepare_role(config: RunConfig, registry: Registry, role: Role) -> PreparedRun:
    """A run of ``role``'s backend alone: its plan is the one task ``init:<role>``.

    For the commands that need one backend of a run and none of the others (``rlcore export``
    starts only the policy, to load a checkpoint): the backends of the other roles need not
    be installed. :func:`rlcore.setup.runner.run_prepared` runs it as it runs a whole run
    (the same init context, deadline, cancellation and teardown), and it does no refit.

    Raises:
        BackendNotFoundError: the role's backend is missing.
        ConfigError: bad ``<role>.options``, a ``model.dtype`` the backend does not run.
    """
    info = registry.backend_for(role, getattr(config, role.value).backend)
    decl = info.declaration
    assert decl is not None  # backend_for finds declared backends only
    check_dtype(config, {role: decl})
    task = Task(init_task(role), role.value, decl.name)
    plan = Plan(tasks=(task,), edges=(), critical_path=(task.name,))
    deadline = float(config.setup.task_deadline_s.get(task.name, config.setup.deadline_s))
    return PreparedRun(
        config, registry, {role: info}, {role: _resolved(config, role, decl)}, plan, {task.name: deadline}, ""
    )


def _resolved(config: RunConfig, role: Role, decl: BackendDeclaration) -> Any:
    """``<role>.options`` checked against ``decl``'s options dataclass (``policy.options.lora``
    first against its declaration: :func:`rlcore.lora.check_lora_request`)."""
    if role is Role.POLICY:
        check_lora_request(config.policy.options, backend=decl.name, trains_adapters=decl.trains_adapters)
    return resolve_options(getattr(config, role.value).options, decl.options, section=role.value, backend=decl.name)


def selected_backends(registry: Registry, config: RunConfig) -> dict[Role, PluginInfo]:
    """The backend each role of ``config`` selects (env only when ``env.backend`` is set).

    Raises :class:`BackendNotFoundError` naming the config key of every missing backend.
    """
    from rlcore.errors import BackendNotFoundError

    found: dict[Role, PluginInfo] = {}
    problems: list[str] = []
    for role in selected_roles(config):  # report every bad key at once, not one per run
        try:
            found[role] = registry.backend_for(role, getattr(config, role.value).backend)
        except BackendNotFoundError as err:
            problems.append(str(err))
    if problems:
        raise BackendNotFoundError("\n".join(problems))
    return found


def check_dtype(config: RunConfig, declarations: Mapping[Role, BackendDeclaration]) -> None:
    """``model.dtype`` is one that the policy and generation backends declare (a backend
    that declares no ``dtypes`` accepts any)."""
    want = config.model.dtype
    for role in (Role.POLICY, Role.GENERATION):
        decl = declarations.get(role)
        if decl is None or not decl.dtypes or want in decl.dtypes:
            continue
        runs = ", ".join(sorted(decl.dtypes))
        raise ConfigError(
            f"config key 'model.dtype' is {want}, but {role.value} backend '{decl.name}' runs "
            f"in {runs} only (its declaration's dtypes); set model.dtype to one of them or pick "
            f"another {role.value}.backend",
            key="model.dtype",
        )


def check_dynamic_sampling(config: RunConfig, env: BackendDeclaration | None) -> None:
    """``grpo.dynamic_sampling`` only with an env that declares ``extra_draws``: it asks the
    env for more prompts of a step (``RolloutRequest.draw``)."""
    if not config.grpo.dynamic_sampling:
        return
    key = "grpo.dynamic_sampling"
    if env is None:
        raise ConfigError(f"config key '{key}' draws more prompts from the env: set env.backend", key=key)
    if not env.extra_draws:
        raise ConfigError(
            f"config key '{key}' is true, but env backend '{env.name}' does not declare extra_draws (it "
            "cannot give a step more prompts after groups of equal rewards are dropped); set "
            f"{key}=false or choose an env that declares it",
            key=key,
        )


def task_deadlines(config: RunConfig, plan: Plan) -> dict[str, float]:
    """Every task's deadline; ``setup.task_deadline_s`` may name only tasks of the plan."""
    names = list(plan.names)
    for task in config.setup.task_deadline_s:
        if task not in names:
            raise ConfigError(
                f"config key 'setup.task_deadline_s.{task}' names no task of this run's plan; "
                f"its tasks are {', '.join(names)}",
                key=f"setup.task_deadline_s.{task}",
            )
    per_task = config.setup.task_deadline_s
    return {t: float(per_task.get(t, config.setup.deadline_s)) for t in names}


def _check_runnable(plan: Plan, roles: list[Role]) -> None:
    """Setup runs only the inits of ``roles`` and ``refit:initial`` after both inits."""
    for task in plan.tasks:
        role = role_of_task(task.name)
        if task.name == REFIT_TASK:
            for r in (Role.POLICY, Role.GENERATION):
                init = f"init:{r.value}"
                if not plan.has_path(init, REFIT_TASK):
                    raise PlanError(f"the plan runs {REFIT_TASK} without waiting for {init}")
        elif role is None or role not in roles:
            raise PlanError(
                f"the plan has task '{task.name}', which setup cannot run (it runs "
                f"{', '.join(f'init:{r.value}' for r in roles)} and {REFIT_TASK})"
            )

"""rlcore's setup: the plan's tasks as hook calls, run by the executor.

:func:`run_prepared` runs a :class:`~rlcore.setup.prepared.PreparedRun` (the backends,
their resolved options, the plan, the task deadlines and the refit transport, decided
once by :func:`rlcore.setup.prepared.prepare`) and reads top to bottom:

1. turn each task into an executor task: ``init:<role>`` calls
   ``rlcore_init_<role>`` of the selected backend (plus wrapper plugins and the
   core's own), ``refit:initial`` calls ``rlcore_refit`` for the policy and
   generation backends; after a task, post the core events the plan says it
   makes available (``generation.endpoint``);
2. run them (:func:`rlcore.setup.executor.execute`): each starts the moment its
   dependencies are done; the first failure cancels the rest, started backends
   are shut down in reverse order and :class:`~rlcore.errors.SetupError` names
   the task, backend, role and root cause;
3. measure: ``timing/setup/*`` metrics; the execution's records are in the result, from
   which the app draws the trace (:mod:`rlcore.app.trace`).

:func:`run_setup` prepares and runs in one call (scripts, tests, benches).

Handles a backend returns are captured by a core wrapper innermost in the hook
chain, so a wrapper plugin that fails *after* the backend's init returned (fault
injection, a broken timing plugin) does not leak the started backend: the
executor shuts it down with the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.config import RunConfig, cache_dir
from rlcore.config.placement import DeviceGroup, Network
from rlcore.context import InitContext, RefitContext
from rlcore.declarations import ENDPOINT_EVENT, Role
from rlcore.errors import CancelToken, Deadline, PluginError, RefitError
from rlcore.hookspecs import hookimpl
from rlcore.lora import lora_options
from rlcore.refit.sessions import RefitSessions
from rlcore.setup.events import EventBoard
from rlcore.setup.executor import ExecutionResult, TaskRun, TaskSpec, call_bounded, execute
from rlcore.setup.metrics import PREFIX, setup_metrics
from rlcore.setup.plan import REFIT_TASK, Plan, role_of_task
from rlcore.setup.plan import init_task as init_task_name
from rlcore.setup.prepared import PreparedRun, prepare

if TYPE_CHECKING:
    from rlcore.setup.registry import PluginInfo, Registry

log = logging.getLogger(__name__)

__all__ = ["SetupResult", "refit_context", "run_prepared", "run_setup"]


@dataclass
class SetupResult:
    """A finished setup.

    Attributes:
        plan: the plan that ran.
        handles: started backends by role (``policy``, ``generation``, ``env``).
        execution: per-task records and results (times for metrics and traces:
            :meth:`rlcore.app.trace.TraceRecorder.from_execution`).
        metrics: ``timing/setup/*`` (see :mod:`rlcore.setup.metrics`), plus
            ``weight_sync_time_s`` and ``collective_init_time_s`` of the first refit.
        plugins: the selected backends' plugins by role (for later hook calls).
        transport: the refit transport chosen for the run.
        refit_report: what ``refit:initial`` returned.
        config: the run config.
        registry: the plugins the setup ran with.
        refit_sessions: the run's refit channels (opened by ``refit:initial``).
    """

    plan: Plan
    handles: dict[str, Any]
    execution: ExecutionResult
    metrics: dict[str, float]
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    transport: str | None = None
    refit_report: Any = None
    config: RunConfig | None = None
    registry: Registry | None = None
    refit_sessions: RefitSessions = field(default_factory=RefitSessions)
    _run: _SetupRun | None = field(default=None, repr=False)

    def refit(self, step: int, cancel: CancelToken, deadline: Deadline | None = None) -> Any:
        """Copy the policy's current weights to the generation (after training step ``step``).

        Calls ``rlcore_refit`` for the run's policy and generation backends over the
        run's transport and refit channels; returns the :class:`rlcore.handles.RefitReport`.
        """
        assert self.config is not None and self.registry is not None and self.transport
        return _refit_once(
            self.config,
            self.registry,
            self.plugins,
            self.handles,
            refit_context(
                self.config,
                step=step,
                transport=self.transport,
                cancel=cancel,
                sessions=self.refit_sessions,
                deadline=deadline,
                content=content_of(self.plan),
            ),
        )

    def engine_replaceable(self, rank: int | None) -> bool:
        """Whether engine ``rank`` alone can be started again and refitted: the generation
        handle offers ``replace_engine`` (engines independent of each other, as
        :class:`rlcore.runtime.generation_group.GroupGeneration`'s) and the pair refits
        through the core's channels (a backend's own ``rlcore_refit`` expects its handle)."""
        handle = self.handles.get(Role.GENERATION.value)
        if rank is None or not callable(getattr(handle, "replace_engine", None)) or self.registry is None:
            return False
        pair = [self.plugins[Role.POLICY.value].plugin, self.plugins[Role.GENERATION.value].plugin]
        impls = self.registry.pm.hook.rlcore_refit.get_hookimpls()
        return not any(i.plugin in pair and not (i.wrapper or i.hookwrapper) for i in impls)

    def replace_engine(self, rank: int, step: int, cancel: CancelToken) -> tuple[Any, float, float]:
        """Start generation engine ``rank`` again alone and refit it from the policy's
        current weights, over a channel of its own; the other engines keep running and
        their weights. The generation's channels are dropped first (the lost engine's end
        of each is gone): the next refit opens new ones with every engine. Returns (refit
        report, seconds to start the engine, seconds to refit it)."""
        assert self.config is not None and self.registry is not None and self.transport
        handle = self.handles[Role.GENERATION.value]
        self.refit_sessions.forget_generation(handle)
        t0 = time.monotonic()
        receiver = handle.replace_engine(rank, deadline=Deadline(self.config.setup.deadline_s, "replacing an engine"))
        t1 = time.monotonic()
        # Its own sessions: the one-engine channel is used once, never by the next refit.
        ctx = refit_context(
            self.config, step=step, transport=self.transport, cancel=cancel, sessions=RefitSessions(),
            content=content_of(self.plan),
        )
        report = _refit_once(self.config, self.registry, self.plugins, {**self.handles, Role.GENERATION.value: receiver}, ctx)
        return report, t1 - t0, time.monotonic() - t1

    def restart_generation(self, cancel: CancelToken) -> tuple[Any, float]:
        """Replace the generation after it lost a worker: drop its refit channels, shut
        it down (bounded by ``setup.shutdown_timeout_s``; its dead workers cannot answer)
        and start it again through its backend's ``rlcore_init_generation``, with the
        context ``init:generation`` had. The new handle takes the old one's place in
        :attr:`handles` and in the teardown. It does not refit: call :meth:`refit` next
        (a refit-fed engine serves only after it). Returns (new handle, init seconds).
        """
        assert self._run is not None, "restart_generation needs the setup run (run_setup)"
        role, name = Role.GENERATION, init_task_name(Role.GENERATION)
        old = self.handles[role.value]
        self.refit_sessions.forget_generation(old)
        timeout = self.config.setup.shutdown_timeout_s if self.config else 60.0
        finished, error = call_bounded(lambda: _shutdown_handle(old), timeout, name="rlcore-replace-shutdown")
        if not finished or error is not None:
            log.warning("shutting the lost generation down: %s", error or f"hung for {timeout:g}s (abandoned)")
        t0 = time.monotonic()
        handle = self._run.start_again(role, cancel)
        self.handles[role.value] = handle
        self.execution.replace_started(name, handle)
        return handle, time.monotonic() - t0

    def shutdown(self, timeout_s: float | None = None) -> list[str]:
        """Shut every started backend down, last started first, and drop the refit
        channels. Idempotent.

        Each shutdown is bounded by ``timeout_s`` (default
        ``setup.shutdown_timeout_s``); returns one line per shutdown that raised
        or hung.
        """
        try:
            return self.execution.shutdown(timeout_s)
        finally:
            self.refit_sessions.close()

    def __enter__(self) -> SetupResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def refit_context(
    config: RunConfig,
    *,
    step: int,
    transport: str,
    cancel: CancelToken,
    sessions: RefitSessions,
    deadline: Deadline | None = None,
    content: str = "weights",
) -> RefitContext:
    """The :class:`RefitContext` of one weight sync (``refit:initial`` is step 0).

    Its deadline is the sooner of ``deadline`` and ``refit.timeout_s`` from now;
    ``sessions`` are the refit channels of the run (opened once, reused); ``content`` is
    what it carries (:func:`content_of` the plan).
    """
    base = deadline or Deadline.never(f"refit step {step}")
    return RefitContext(
        step=step,
        transport=transport,
        bucket_bytes=int(config.refit.bucket_mb * 2**20),
        timeout_s=config.refit.timeout_s,
        cancel=cancel,
        deadline=base.sooner(config.refit.timeout_s, f"refit step {step}"),
        config=config,
        cache_dir=cache_dir(config),
        sessions=sessions,
        content=content,
    )


def content_of(plan: Plan) -> str:
    """What the plan's refits carry (:class:`rlcore.setup.plan.RefitContent`'s kind)."""
    return plan.refit_content.kind if plan.refit_content is not None else "weights"


def _refit_once(
    config: RunConfig,
    registry: Registry,
    plugins: dict[str, PluginInfo],
    handles: dict[str, Any],
    ctx: RefitContext,
) -> Any:
    """One ``rlcore_refit`` call for the run's policy and generation; its report."""
    pol, gen = plugins[Role.POLICY.value], plugins[Role.GENERATION.value]
    report = registry.hook("rlcore_refit", [pol, gen])(
        policy=handles[Role.POLICY.value], generation=handles[Role.GENERATION.value], ctx=ctx
    )
    if report is None:
        raise RefitError(
            f"no rlcore_refit implementation synced policy backend "
            f"'{config.policy.backend}' to generation backend "
            f"'{config.generation.backend}' (every implementation returned None)"
        )
    return report


def _shutdown_handle(handle: Any) -> None:
    stop = getattr(handle, "shutdown", None)
    if stop is None:
        raise TypeError(
            f"handle {type(handle).__name__} has no shutdown() (rlcore.handles.BackendHandle)"
        )
    stop()


class _StartedCapture:
    """Core wrapper, innermost in each init hook's chain: tells the executor about a
    handle the moment the backend's init returns it, before any outer wrapper
    can fail and lose it (see :meth:`rlcore.setup.executor.TaskRun.started`)."""

    def __init__(self) -> None:
        self._runs: dict[int, TaskRun] = {}
        self._lock = threading.Lock()

    @contextmanager
    def tracking(self, ctx: InitContext, run: TaskRun) -> Iterator[None]:
        with self._lock:
            self._runs[id(ctx)] = run
        try:
            yield
        finally:
            with self._lock:
                self._runs.pop(id(ctx), None)

    def _capture(self, ctx: InitContext) -> Generator[None, Any, Any]:
        handle = yield
        with self._lock:
            run = self._runs.get(id(ctx))
        if run is not None and handle is not None:
            run.started(handle)
        return handle

    @hookimpl(wrapper=True, trylast=True)
    def rlcore_init_policy(self, ctx: InitContext) -> Generator[None, Any, Any]:
        return (yield from self._capture(ctx))

    @hookimpl(wrapper=True, trylast=True)
    def rlcore_init_generation(self, ctx: InitContext) -> Generator[None, Any, Any]:
        return (yield from self._capture(ctx))

    @hookimpl(wrapper=True, trylast=True)
    def rlcore_init_env(self, ctx: InitContext) -> Generator[None, Any, Any]:
        return (yield from self._capture(ctx))


@contextmanager
def _registered(registry: Registry, plugin: object) -> Iterator[None]:
    name = f"rlcore.setup.runner.capture-{id(plugin):x}"
    registry.pm.register(plugin, name=name)
    try:
        yield
    finally:
        registry.pm.unregister(plugin, name=name)


class _SetupRun:
    """One setup's state: the selected backends, the event board, the handles started so
    far, the run's refit channels; it turns the plan's tasks into executor tasks."""

    def __init__(self, prepared: PreparedRun, run_dir: Path, cancel: CancelToken) -> None:
        # The prepared run's choices, used as they are: nothing is selected or resolved here.
        self.prepared = prepared
        self.config, self.registry, self.run_dir = prepared.config, prepared.registry, Path(run_dir)
        self.infos, self.declarations = prepared.backends, prepared.declarations
        self.options, self.plan = prepared.options, prepared.plan
        self.deadlines, self.transport = prepared.deadlines, prepared.transport
        self.cancel = cancel
        self.network = Network()  # who reaches the run's servers (run_prepared's ``network``)
        self.devices: DeviceGroup | None = None  # the run's GPU bundles (run_prepared's ``devices``)
        self.board = EventBoard(cancel)
        self.handles: dict[str, Any] = {}
        self.capture = _StartedCapture()
        self.sessions = RefitSessions()
        self.plugins = {r.value: i for r, i in self.infos.items()}

    def init_context(self, role: Role, cancel: CancelToken, deadline: Deadline) -> InitContext:
        """The :class:`InitContext` of ``role``'s init hook."""
        info, backend = self.infos[role], self.declarations[role].name
        return InitContext(
            role=role,
            backend=backend,
            config=self.config,
            options=self.options[role],
            cancel=cancel,
            deadline=deadline,
            run_dir=self.run_dir,
            cache_dir=cache_dir(self.config),
            events=self.board,
            publish_hook=self.registry.hook("rlcore_publish", [info]),
            log=logging.getLogger(f"rlcore.backend.{backend}"),
            needed_artifacts=frozenset(self.plan.consumed.get(init_task_name(role), ())),
            network=self.network,
            devices=self.devices,
            adapters=self.adapters() if role is Role.GENERATION else None,
        )

    def adapters(self) -> Any:
        """The policy's :class:`rlcore.lora.LoraOptions` where the refits carry adapters."""
        if content_of(self.plan) != "adapters":
            return None
        return lora_options(self.options[Role.POLICY])

    def call_init(self, role: Role, ctx: InitContext) -> Any:
        """Call the selected backend's init hook for ``role``; its handle."""
        info, hook_name = self.infos[role], f"rlcore_init_{role.value}"
        handle = self.registry.hook(hook_name, [info])(ctx=ctx)
        if handle is None:
            raise PluginError(
                f"{info.origin()} declares backend '{ctx.backend}' for role {role} but "
                f"implements no {hook_name} (the hook returned None); implement it and "
                "return the started backend's handle",
                plugin=info.name,
                distribution=info.distribution,
            )
        self.handles[role.value] = handle
        return handle

    def init_task(self, role: Role) -> Callable[[TaskRun], Any]:
        """``init:<role>``: the selected backend's init hook, with its context."""

        def run(task: TaskRun) -> Any:
            ctx = self.init_context(role, task.cancel, task.deadline)
            with self.capture.tracking(ctx, task):
                return self.call_init(role, ctx)

        return run

    def start_again(self, role: Role, cancel: CancelToken) -> Any:
        """Start ``role``'s backend once more through its init hook, as ``init:<role>``
        did (same context, deadline ``setup.task_deadline_s`` of that task): the
        replacement of a backend that lost a worker. Returns the new handle."""
        name = init_task_name(role)
        ctx = self.init_context(role, cancel, Deadline(self.deadlines[name], f"{name} (again)"))
        return self.call_init(role, ctx)

    def refit_task(self, task: TaskRun) -> Any:
        """``refit:initial``: the first weight sync (step 0) over the run's channels."""
        ctx = refit_context(
            self.config, step=0, transport=self.transport, cancel=task.cancel,
            sessions=self.sessions, deadline=task.deadline, content=content_of(self.plan),
        )
        return _refit_once(self.config, self.registry, self.plugins, self.handles, ctx)

    def post_events(self, task_name: str) -> Callable[[Any], None] | None:
        """After ``task_name``, post the core events the plan says it makes available."""
        events = tuple(self.plan.posts.get(task_name, ()))
        awaited = {w.target for w in self.plan.waits if w.kind == "event"}
        if not events:
            return None

        def on_done(_result: Any) -> None:
            for event in events:
                value = None
                if event == ENDPOINT_EVENT:
                    value = getattr(self.handles.get(Role.GENERATION.value), "endpoint", None)
                    if value is None and event in awaited:
                        gen = self.infos[Role.GENERATION]
                        raise PluginError(
                            f"{gen.origin()}: generation backend "
                            f"'{self.declarations[Role.GENERATION].name}' declares an OpenAI-"
                            "compatible endpoint, but its handle has no 'endpoint' "
                            "(rlcore.handles.Endpoint) for the tasks that wait for it",
                            plugin=gen.name,
                            distribution=gen.distribution,
                        )
                log.debug("%s posts event %s", task_name, event)
                self.board.post(event, value)

        return on_done

    def pair(self) -> str:
        """``policy -> generation`` backends, as errors of a refit name them."""
        return f"{self.declarations[Role.POLICY].name} -> {self.declarations[Role.GENERATION].name}"

    def task_specs(self) -> list[TaskSpec]:
        """The plan's tasks as executor tasks."""
        specs = []
        for task in self.plan.tasks:
            role = role_of_task(task.name)
            specs.append(TaskSpec(
                name=task.name,
                deps=self.plan.predecessors(task.name),
                run=self.refit_task if role is None else self.init_task(role),
                shutdown=None if role is None else _shutdown_handle,
                deadline_s=self.deadlines[task.name],
                on_done=self.post_events(task.name),
                # A refit involves both backends: name them both in errors.
                label={"backend": task.backend or self.pair(), "role": task.role},
            ))
        return specs

    def result(self, execution: ExecutionResult) -> SetupResult:
        """The finished setup, with its metrics (the first refit's time and channel init)."""
        report = execution.results.get(REFIT_TASK)
        metrics = setup_metrics(self.plan, execution)
        for key, attr in (
            ("weight_sync_time_s", "weight_sync_time_s"),
            ("collective_init_time_s", "channel_init_time_s"),
        ):
            value = getattr(report, attr, None)
            if isinstance(value, int | float):
                metrics[f"{PREFIX}{key}"] = float(value)
        return SetupResult(
            plan=self.plan,
            handles=self.handles,
            execution=execution,
            metrics=metrics,
            plugins=self.plugins,
            transport=self.transport,
            refit_report=report,
            config=self.config,
            registry=self.registry,
            refit_sessions=self.sessions,
            _run=self,
        )


def run_prepared(
    prepared: PreparedRun,
    *,
    run_dir: Path,
    cancel: CancelToken | None = None,
    progress: Callable[[str, str], None] | None = None,
    grace_s: float = 5.0,
    network: Network | None = None,
    devices: DeviceGroup | None = None,
) -> SetupResult:
    """Start the prepared run's backends, as its plan allows, and do the first refit.

    Args:
        prepared: the run, prepared once (:func:`rlcore.setup.preflight.check_before_start`
            or :func:`rlcore.setup.prepared.prepare`): its backends, options, plan, task
            deadlines and transport are used as they are.
        run_dir: the run's output directory (passed to backends).
        cancel: the run's cancellation token (e.g. set on Ctrl-C); a new one if omitted.
        progress: ``progress(task, what)`` for each task event (``start``, ``end``,
            ``failed``, ``cancelled``, ``timed_out``, ``not_started``).
        grace_s: how long running tasks get to stop after a failure before they
            are abandoned (their late results are still shut down).
        network: who reaches the run's servers, for every ``InitContext.network``
            (:meth:`rlcore.runtime.cluster.Cluster.network`); omitted: one node.
        devices: the run's GPU bundles, for every ``InitContext.devices``
            (:meth:`rlcore.runtime.cluster.Cluster.reserve_devices`); omitted: none.

    Returns:
        The :class:`SetupResult`; call its ``shutdown()`` when done.

    Raises:
        SetupError: a task failed, timed out or setup was cancelled; started
            backends have been shut down. It carries ``.execution`` and ``.plan``.
    """
    config = prepared.config
    run = _SetupRun(prepared, run_dir, cancel or CancelToken())
    run.network = network or run.network
    run.devices = devices
    run.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _registered(prepared.registry, run.capture):
            execution = execute(
                run.task_specs(),
                cancel=run.cancel,
                deadline=Deadline(config.setup.deadline_s, "setup"),
                grace_s=grace_s,
                shutdown_timeout_s=config.setup.shutdown_timeout_s,
                on_event=progress,
                on_cancel=lambda _reason: run.board.wake_all(),
            )
    except BaseException as err:
        run.sessions.close()
        err.plan = run.plan  # type: ignore[attr-defined]
        raise
    return run.result(execution)


def run_setup(
    config: RunConfig,
    registry: Registry,
    *,
    run_dir: Path,
    plan: Plan | None = None,
    cancel: CancelToken | None = None,
    progress: Callable[[str, str], None] | None = None,
    grace_s: float = 5.0,
) -> SetupResult:
    """Prepare the run (:func:`rlcore.setup.prepared.prepare`, with ``plan`` instead of the
    declarations' own when given) and run it (:func:`run_prepared`): for scripts, tests
    and benches that need no preflight, cluster network or device bundles.

    Raises:
        BackendNotFoundError, ConfigError, PlanError: before anything started.
        SetupError: as :func:`run_prepared`.
    """
    prepared = prepare(config, registry, plan=plan)
    return run_prepared(prepared, run_dir=run_dir, cancel=cancel, progress=progress, grace_s=grace_s)

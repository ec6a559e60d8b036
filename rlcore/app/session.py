"""rlcore as a library: ``rlcore.open(config)`` sets a run up; a loop of any algorithm runs on it.

::

    import rlcore

    with rlcore.open("examples/quickstart.yaml", ["grpo.prompts_per_step=4"]) as s:
        for step in range(1, 11):
            groups = s.rollouts(step)                      # scored samples, from the env
            batch = [(r["prompt_ids"], r["token_ids"]) for g in groups for r in g]
            advantages = ...                               # the algorithm's own
            old = s.policy.logprobs(batch)
            stats = s.train(step, batch, advantages, old)  # one step: {"train/loss": ...}
            s.refit(step)                                  # weights to the engine
            s.check_refit(step)                            # ...and checked there
            s.record({"reward/mean": ..., **stats}, step)  # a line of metrics.jsonl

:func:`open` does what ``rlcore run`` does around its loop, with the same code: every
check that needs no cluster first (a bad input raises :class:`~rlcore.errors.ConfigError`
before anything starts), the run directory (``config.yaml``, ``run.json``, ``metrics.jsonl``
with the setup's line, ``placement.json``), the cluster (embedded, or joined: by
``cluster.address``, or the cluster of the Ray job it runs in; a join is checked before the
run directory is written, :mod:`rlcore.runtime.join`), the overlapped setup and the first refit. Leaving the ``with`` block
(or :meth:`Session.close`) tears it all down as ``rlcore run`` does: backends shut down
last started first, the embedded cluster stopped with every process of it, ``trace.json``,
``setup_timeline.png``, ``reward.png`` (also of a run that failed, up to its last step)
and the reward's trend written, ``run.json`` marked finished or failed; nothing of the run
is left running or registered in the process, so a second :func:`open` (a notebook) starts
afresh. SIGINT or SIGTERM in the main thread stop it
as they stop ``rlcore run`` (:mod:`rlcore.app.interrupts`): the loop is interrupted where
it waits, the teardown is bounded, :class:`~rlcore.app.interrupts.RunInterrupted` says what
was interrupted. A failed refit check leaves the block with the diagnosis of whose bug it is
(:mod:`rlcore.app.diagnose`).

The session's methods are where a loop gets the run's services: the colocated roles' memory
handoff, a lost generation worker replaced and the call run again
(``generation.on_worker_loss: replace``), training health, the refit check, records and
trace spans. ``rlcore run``'s GRPO loop (:func:`rlcore.app.grpo.run_grpo_on`) uses nothing
else.

What a loop trains (``docs/library.md``): :meth:`Session.train` is one step of GRPO's clipped
policy-gradient loss on the loop's own advantages (``docs/grpo.md`` for its options), and
returns its metrics as ``rlcore run`` names them (``train/loss``, ``train/grad_norm``...).
A loop checks its refits (:meth:`Session.check_refit`); a session that refits twice without
ever checking one warns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from rlcore.app import overlap
from rlcore.app.checkpointing import Checkpointer, Contents, Schedule, save_overlaps, save_stages
from rlcore.app.checkpoints import Chosen
from rlcore.app.dynamic_sampling import draw_teaching_groups
from rlcore.app.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.app.health import check_train_health, reward_trend, trend_line
from rlcore.app.interrupts import RunInterrupted, SignalGuard, active_guard, signal_name, signum_of
from rlcore.app.loggers import LoggedWriter
from rlcore.app.mismatch import check_mismatch, mismatch_stats
from rlcore.app.plots import plot_reward, plot_setup_timeline
from rlcore.app.progress import RunPhase, SetupProgress, SlowTasks, setup_display
from rlcore.app.records import read_metrics, write_atomic
from rlcore.app.recovery import GenerationRecovery, retry_on_generation_loss
from rlcore.app.refit_check import check_divergence, probe_batch, token_mult_prob_error
from rlcore.app.resume import checkpoint_root, choose, policy_format, shared_config
from rlcore.app.rundir import (
    RunStatus,
    check_run_dir,
    close_records,
    make_run_dir,
    truncate_metrics,
)
from rlcore.app.samples import due, sample_lines, write_samples
from rlcore.app.stream import RolloutStream
from rlcore.app.trace import TraceRecorder
from rlcore.config import RunConfig, cache_dir, load_config
from rlcore.config.placement import Network
from rlcore.declarations import Role
from rlcore.errors import (
    CancelToken,
    CheckpointError,
    ClusterLost,
    ConfigError,
    Deadline,
    DivergenceError,
    RefitError,
    RunDirError,
)
from rlcore.handles import (
    MemoryHandoff,
    Pair,
    RefitReport,
    Rollout,
    RolloutRequest,
    Sample,
    SamplingParams,
)
from rlcore.runtime.cluster import Cluster
from rlcore.runtime.head_watch import HEAD_WATCH
from rlcore.runtime.join import ClusterChoice, check_join, choose_cluster
from rlcore.runtime.placed import forget_placed, placed_groups
from rlcore.setup.loss import loss_options, requested_features
from rlcore.setup.preflight import check_before_start, check_checkpoints, check_joined_resources
from rlcore.setup.registry import load_registry
from rlcore.setup.runner import SetupResult, run_prepared

if TYPE_CHECKING:
    from rlcore.errors import WorkerLost
    from rlcore.setup.plan import Plan
    from rlcore.setup.prepared import PreparedRun

log = logging.getLogger(__name__)

#: :meth:`Session.train` returns the policy's metrics under this prefix (``train/loss``), the
#: names ``rlcore run`` writes them under.
TRAIN_PREFIX = "train/"

__all__ = ["ConfigLike", "Handoff", "OpenKeywords", "OpenOptions", "OverHandles", "Session", "open"]

#: What :func:`open` takes as the config: a YAML path, a mapping or an OmegaConf config of
#: the same keys, a :class:`~rlcore.config.RunConfig`, or ``None`` (``examples/quickstart.yaml``).
ConfigLike = str | os.PathLike[str] | Mapping[str, Any] | DictConfig | RunConfig | None

#: Bound on each backend's shutdown after an interrupt (the run must end within 10 s).
INTERRUPT_SHUTDOWN_S = 3.0


class Handoff:
    """Colocated policy and generation take turns on the devices (:class:`MemoryHandoff`).

    ``to_generation()`` puts the policy to sleep and wakes the generation (before
    sampling); ``to_policy()`` the reverse (before training). A role whose backend does
    not declare ``memory_handoff`` is ``None`` and skipped; with neither, nothing happens.
    """

    def __init__(self, policy: MemoryHandoff | None = None, generation: MemoryHandoff | None = None) -> None:
        self.policy, self.generation = policy, generation

    def to_generation(self) -> None:
        if self.policy is not None:
            self.policy.sleep()
        if self.generation is not None:
            self.generation.wake()

    def to_policy(self) -> None:
        if self.generation is not None:
            self.generation.sleep()
        if self.policy is not None:
            self.policy.wake()


class OpenKeywords(TypedDict, total=False):
    """:func:`open`'s keyword arguments, for type checkers and editors (documented there;
    :class:`OpenOptions` holds them with their defaults)."""

    out: str | os.PathLike[str] | None
    resume: bool
    needs_env: bool
    console: Console | None
    quiet: bool
    extra_plugins: Sequence[tuple[str, Any]]
    handle_signals: bool


@dataclass(frozen=True)
class OpenOptions:
    """How :func:`open` starts a run: its keyword arguments with their defaults."""

    out: str | os.PathLike[str] | None = None
    resume: bool = False
    needs_env: bool = False
    console: Console | None = None
    quiet: bool = False
    extra_plugins: Sequence[tuple[str, Any]] = ()
    handle_signals: bool = True


def open(
    config: ConfigLike = None, overrides: Sequence[str] | Mapping[str, Any] = (), **options: Unpack[OpenKeywords]
) -> Session:
    """Check, set up and start a run; the :class:`Session` a loop runs on. Use it as a
    context manager (or call :meth:`Session.close`).

    Keyword arguments (``options``, each optional: :class:`OpenOptions`):

    Args:
        config: a YAML path, a mapping or OmegaConf config of the same keys, a
            :class:`~rlcore.config.RunConfig`, or ``None`` for ``examples/quickstart.yaml``.
        overrides: ``key=value`` strings, as after ``rlcore run CONFIG``, or a mapping of
            dotted keys to values (``{"grpo.prompts_per_step": 4}``).
        out: the run directory (``rlcore run --out``); ``None``: a new
            ``<output_dir>/<name>-<time>``. It must be new or empty unless ``resume``.
        resume: append to a non-empty ``out``.
        needs_env: refuse a config without ``env.backend`` before anything starts (a loop
            that calls :meth:`Session.rollouts` or the env).
        console: where setup progress and the run's notices go (a :class:`rich.console.Console`);
            ``None``: standard output, or nowhere with ``quiet``.
        quiet: print nothing (``console=None`` only).
        extra_plugins: ``(name, plugin)`` pairs registered beside the installed plugins
            (wrapper plugins for tracing or fault injection).
        handle_signals: route SIGINT/SIGTERM of the main thread into a clean, bounded stop
            while the session is open, as ``rlcore run`` does (a second signal, or 9 s of
            teardown, kills the process tree and exits: see :class:`SignalGuard`). Leave it
            on for scripts; a notebook that wants Ctrl-C to reach only its own cell passes
            ``False``.

    Raises:
        ConfigError: bad input (unknown key, value out of range, a backend that does not
            serve the role, an ``out`` that cannot be written...), before anything started.
        RunInterrupted: SIGINT/SIGTERM during setup; what had started was torn down.
        RlcoreError: setup failed (a backend's init, the first refit); torn down.
    """
    opts = OpenOptions(**options)  # an unknown keyword is a TypeError, as for any call
    console = opts.console
    if console is None:
        console = Console(quiet=opts.quiet, highlight=False, soft_wrap=True)
    guard = SignalGuard() if opts.handle_signals else None
    if guard is not None:
        guard.__enter__()
    try:
        run = _prepared_run(_load(config, overrides), opts, console, guard)
        session = Session(config=run.config)
        run.start()
        session._attach(run)
        if run.resume_point is not None:
            try:
                session._restore(run.resume_point)
            except BaseException as err:
                session._end(err)
                raise
        return session
    except BaseException:
        if guard is not None:
            guard.__exit__(None, None, None)
        raise


def _prepared_run(config: RunConfig, opts: OpenOptions, console: Console, guard: SignalGuard | None) -> _Run:
    """Every check before anything starts (the run prepared once: the plugins, the
    preflight, ``--out``), then the run directory with its ``run.json`` and ``config.yaml``."""
    registry = load_registry(config.plugins.allow, extra=opts.extra_plugins)
    for f in registry.failures:
        console.print(f"[yellow]skipped plugin {f.name} ({f.distribution}): {f.message}[/yellow]")
    out = None if opts.out is None else os.fspath(opts.out)
    prepared = check_before_start(config, registry, output_dir=out is None)
    if out:
        check_run_dir(Path(out).expanduser(), resume=opts.resume)
    if opts.needs_env and not config.env.backend:
        raise ConfigError("the loop needs an env: set env.backend (e.g. env.backend=arithmetic)", key="env.backend")
    point = _resume_point(prepared, Path(out).expanduser()) if opts.resume and out else None
    choice = choose_cluster(config.cluster)
    console.print(f"cluster: {choice.describe()}")
    cluster = _joined_cluster(prepared, choice) if choice.joined else None
    try:
        run_dir = make_run_dir(config, out, resume=opts.resume)
        steps_before = None if point is None else point.step
        status = RunStatus(run_dir, resume=opts.resume, steps_before=steps_before)  # first: a run's to replace
        if point is not None:
            truncate_metrics(run_dir, point.step)  # its later steps are done again
            truncate_metrics(run_dir, point.step, "samples.jsonl")
        earlier = _earlier_steps(run_dir) if point is not None else []
        write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(config)))
    except BaseException:
        if cluster is not None:
            cluster.shutdown()
        raise
    run = _Run(prepared, run_dir, status, console, guard, choice, cluster, resumed_after=steps_before)
    run.resume_point = point
    run.history = earlier  # the reward's plot and trend cover the whole run, not this process
    return run


def _spans(steps: Sequence[int]) -> str:
    """``1-3, 7`` for ``[1, 2, 3, 7]``."""
    out: list[str] = []
    start = prev = steps[0]
    for s in [*steps[1:], None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if s is not None:
            start = prev = s
    return ", ".join(out)


def _earlier_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The step lines (with a reward) a resumed run's ``metrics.jsonl`` kept."""
    return [
        r for r in read_metrics(run_dir / "metrics.jsonl")
        if isinstance(r.get("step"), int) and r["step"] >= 1 and "reward/mean" in r
    ]


def _missing_steps(history: Sequence[Mapping[str, Any]], step: int) -> list[int]:
    """Steps up to a checkpoint's ``step`` whose lines ``metrics.jsonl`` lacks (lost with the
    disk: written after its last flush)."""
    have = {int(r["step"]) for r in history}
    return [s for s in range(1, step + 1) if s not in have]


def _resume_point(prepared: PreparedRun, run_dir: Path) -> Chosen:
    """The checkpoint a resumed run continues from, chosen before anything starts."""
    check_checkpoints(prepared, resume=True)
    fmt = policy_format(prepared)
    assert fmt is not None  # check_checkpoints refused a policy without checkpoints
    try:
        point = choose(checkpoint_root(prepared.config, run_dir), prepared.config, fmt)
    except CheckpointError as err:  # bad input, found before anything started (exit 2)
        raise ConfigError(str(err), key="--resume") from None
    steps = prepared.config.grpo.steps
    if point.step >= steps:  # said now, not after minutes of setup for no step
        raise ConfigError(
            f"nothing left to do: {point.found.path} is the state after step {point.step} and "
            f"grpo.steps is {steps}; to train on, resume with grpo.steps set above {point.step}",
            key="grpo.steps",
        )
    return point


def _joined_cluster(prepared: PreparedRun, choice: ClusterChoice) -> Cluster:
    """A cluster to join, joined before the run directory is written: a cluster that cannot
    be joined, or whose nodes lack a backend a role needs, leaves ``--out`` untouched.

    Its GCS is asked first (:func:`rlcore.runtime.join.check_join`: seconds, where a failing
    ``ray.init`` takes minutes), then every node a role may land on
    (:func:`rlcore.runtime.node_check.check_nodes`)."""
    from rlcore.runtime.node_check import check_nodes

    if choice.address:
        facts = check_join(choice.address)
        if facts is not None:
            check_joined_resources(prepared.config, facts)
    cluster = Cluster(prepared.config.cluster, choice)
    try:
        cluster.start()
        check_nodes(prepared, cluster.where)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _load(config: ConfigLike, overrides: Sequence[str] | Mapping[str, Any]) -> RunConfig:
    """The run's config, checked (:func:`rlcore.config.load_config`) from any :data:`ConfigLike`."""
    if isinstance(overrides, Mapping):
        # JSON is YAML: strings stay strings, None is null, dicts and lists are flow style.
        overrides = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    overrides = list(overrides)
    if config is None:
        from rlcore.config import DEFAULT_EXAMPLE, default_config_path

        config = default_config_path()
        if config is None:
            raise ConfigError(f"no config given and examples/{DEFAULT_EXAMPLE} not found; pass a config")
    if isinstance(config, RunConfig):
        config = OmegaConf.structured(config)
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
    if isinstance(config, Mapping):
        return load_config(None, overrides, base=dict(config))
    return load_config(os.fspath(config), overrides)


@dataclass(frozen=True)
class OverHandles:
    """What a :class:`Session` made over handles started otherwise works with (its
    constructor's keyword arguments; each one left out is built from a run, or absent).

    Attributes:
        policy, generation, env: the checked handles.
        tokenizer: the run's tokenizer.
        probe: the probe batch of the refit check.
        refit: ``refit(step)`` copies the weights and returns a :class:`~rlcore.handles.RefitReport`.
        handoff: the colocated roles' memory handoff.
        on_generation_loss: ``(error, step, phase)`` replaces a lost generation
            (:class:`rlcore.app.recovery.GenerationRecovery`).
        record: ``record(metrics, step)`` for :meth:`Session.record`.
        span: ``span(name, start, end, step)`` for :meth:`Session.span`.
        cancelled: whether the run is being stopped.
    """

    policy: GuardedPolicy | None = None
    generation: GuardedGeneration | None = None
    env: GuardedEnv | None = None
    tokenizer: Any = None
    probe: Sequence[Pair] | None = None
    refit: Callable[[int], RefitReport] | None = None
    handoff: Handoff | None = None
    on_generation_loss: Callable[[WorkerLost, int, str], None] | None = None
    record: Callable[[dict[str, Any], int], None] | None = None
    span: Callable[[str, float, float, int | None], None] | None = None
    cancelled: Callable[[], bool] | None = None


class Session:
    """A started run: its handles and the services a training loop needs (module doc).

    Made by :func:`open`. It can also be made over handles started otherwise (keyword
    arguments: :class:`OverHandles`; no cluster, no run directory, ``close`` does nothing):
    how the GRPO loop's own tests drive it with scripted handles. That constructor is provisional; what
    is stable is :func:`open` and the attributes and methods documented here.

    Attributes:
        config: the run's :class:`~rlcore.config.RunConfig` (``config.grpo`` holds the
            sampling and optimiser settings a loop may use).
        plan: the setup plan that ran (``None`` over handles started otherwise).
        setup_metrics: the setup's ``timing/setup/*`` metrics, as in ``metrics.jsonl``.
        run_dir: the run directory (``None`` over handles started otherwise).
        transport: the refit transport (``collective``, ``disk``, ``shared_memory``, ...).
        policy: the policy (:class:`~rlcore.app.guards.GuardedPolicy`: ``logprobs(batch)``,
            ``train_step(...)``; every result checked, naming the backend).
        generation: the generation (:class:`~rlcore.app.guards.GuardedGeneration`:
            ``generate(...)``, ``logprobs(batch)``).
        env: the env (:class:`~rlcore.app.guards.GuardedEnv`: ``collect_rollouts(request)``,
            and for a prompt-and-score env ``sample_prompts(n, step)`` and
            ``score(prompts, texts)``), or ``None`` without ``env.backend``.
        tokenizer: the run's tokenizer (``tokenizer(text).input_ids``, ``encode``,
            ``decode``, ``eos_token_id``: :func:`rlcore.models.tokenizer.load`).
        probe: the fixed batch a probe refit check compares (``refit.probe_prompts`` pairs).
        first_step: the loop's first step: 1, or the step after the checkpoint a resumed
            run loaded (:func:`open` with ``resume``); :meth:`checkpoint` saves the state
            after a step (``checkpoint.every_steps``).
    """

    def __init__(self, *, config: RunConfig, **over_handles: Any) -> None:
        given = OverHandles(**over_handles)  # an unknown keyword is a TypeError
        self.config = config
        self.plan: Plan | None = None
        self.setup_metrics: dict[str, float] = {}
        self.run_dir: Path | None = None
        self.transport: str | None = None
        self._run: _Run | None = None
        self._closed = False
        self._phase = RunPhase()
        self._handoff = given.handoff or Handoff()
        self._holder: str | None = None  # which role the handoff last gave the devices to
        #: The generation's weight version: train steps in its weights (0: the initial ones);
        #: :meth:`refit` of step t makes it t.
        self.weight_version = 0
        #: The loop's first step: 1, or the step after the checkpoint a resumed run loaded.
        self.first_step = 1
        self._checkpointer: Checkpointer | None = None
        self._deferring: SignalGuard | None = None  # holds SIGTERM back for a last checkpoint
        self._generation_epoch = 0  # generation recoveries so far (a rollout stream's losses are told apart by it)
        self._sampling: dict[int, dict[str, float]] = {}  # step -> its dynamic sampling's figures
        self._checked = False  # check_refit was called (else the second refit warns, once)
        self._unchecked: list[int] = []  # the first two refits' steps while nothing is checked
        self._refit, self._record, self._span, self._cancelled = given.refit, given.record, given.span, given.cancelled
        # Given handles take the place of the cached properties that build them from a run.
        handles = {
            "policy": given.policy, "generation": given.generation, "tokenizer": given.tokenizer, "probe": given.probe,
        }
        self.__dict__.update({name: value for name, value in handles.items() if value is not None})
        self.__dict__.update(env=given.env, _recovery=given.on_generation_loss)

    def _attach(self, run: _Run) -> None:
        """Take a started run's state (:func:`open`): the handles are built on first use."""
        assert run.setup is not None
        self._run, self._phase = run, run.phase
        for name in ("env", "_recovery"):  # built from the run, not given
            self.__dict__.pop(name, None)
        self.plan, self.run_dir = run.plan, run.run_dir
        self.setup_metrics = dict(run.setup_metrics)
        self.transport = getattr(run.setup, "transport", None)
        self._handoff = _handoff(self.config, run.setup)
        if self.config.checkpoint.every_steps > 0:
            self._checkpointer = self._make_checkpointer(run)
            guard = active_guard()
            if guard is not None and self.config.checkpoint.on_sigterm:
                guard.defer(signal.SIGTERM, self.config.checkpoint.sigterm_grace_s)
                self._deferring = guard

    # ---------------------------------------------------------------- handles

    def _handles(self) -> dict[str, Any]:
        if self._run is None or self._run.setup is None:
            raise RuntimeError("this session was made over handles; it has no setup to take them from")
        return self._run.setup.handles

    @cached_property
    def tokenizer(self) -> Any:
        self._handles()
        return overlap.tokenizer(self.config.model, cache_dir(self.config))

    @cached_property
    def policy(self) -> GuardedPolicy:
        return GuardedPolicy(self._handles()["policy"], self.config.policy.backend, before=self.wait_checkpoint)

    @cached_property
    def generation(self) -> GuardedGeneration:
        return GuardedGeneration(
            self._handles()["generation"], self.config.generation.backend,
            eos_ids={self.tokenizer.eos_token_id},
        )

    @cached_property
    def env(self) -> GuardedEnv | None:
        handle = self._handles().get("env")
        return None if handle is None else GuardedEnv(handle, str(self.config.env.backend))

    @cached_property
    def probe(self) -> list[Pair]:
        return probe_batch(self.tokenizer, self.config.refit.probe_prompts)

    @cached_property
    def _recovery(self) -> Callable[[WorkerLost, int, str], None] | None:
        """``generation.on_worker_loss: replace``: what replaces a lost generation."""
        run = self._run
        if run is None or run.setup is None or self.config.generation.on_worker_loss != "replace":
            return None
        limit = self.config.refit.max_mult_prob_error
        return GenerationRecovery(
            run.setup, self.generation, run.cancel,
            probe_error=lambda: token_mult_prob_error(self.generation.logprobs(self.probe), self.policy.logprobs(self.probe)),
            check=lambda err, step: check_divergence(
                err, limit, step=step, policy=self.config.policy.backend, generation=self.config.generation.backend
            ),
            record=run.record_loss,
            handoff=self._handoff,
            init_time_s=run.setup.metrics.get("timing/setup/init:generation_time_s"),
        )

    # ---------------------------------------------------------------- what the run does

    @property
    def now(self) -> str:
        """What the run is doing, in the words an interrupt's message uses (``step 3``);
        :meth:`rollouts` and :meth:`generate` set it, a loop may set its own."""
        return self._phase.now

    @now.setter
    def now(self, what: str) -> None:
        self._phase.now = what

    @property
    def cancelled(self) -> bool:
        """Whether the run is being stopped (a loop checks it between steps)."""
        if self._run is not None:
            return self._run.cancel.cancelled
        return bool(self._cancelled and self._cancelled())

    def _retry(self, fn: Callable[[], Any], step: int, phase: str) -> Any:
        """``fn()``; a lost generation worker replaced and ``fn()`` run again when the run
        replaces (:func:`rlcore.app.recovery.retry_on_generation_loss`)."""
        recovery = self._recovery
        if recovery is None:
            return retry_on_generation_loss(fn, None, phase)

        def recover(err: WorkerLost, name: str) -> None:
            recovery(err, step, name)
            self._generation_epoch += 1

        return retry_on_generation_loss(fn, recover, phase)

    # ---------------------------------------------------------------- devices

    def to_generation(self) -> None:
        """Colocated roles that declare ``memory_handoff``: the generation gets the devices
        (the policy sleeps). Nothing otherwise. :meth:`rollouts`, :meth:`generate` and the
        probe check do it themselves when the policy had them."""
        self._handoff.to_generation()
        self._holder = "generation"

    def to_policy(self) -> None:
        """The policy gets the devices back (the generation sleeps); :meth:`train` does it
        itself when the generation had them."""
        self._handoff.to_policy()
        self._holder = "policy"

    def _turn(self, role: str) -> None:
        if self._holder != role:
            (self.to_generation if role == "generation" else self.to_policy)()

    # ---------------------------------------------------------------- sampling

    def rollouts(
        self,
        step: int,
        *,
        prompts: int | None = None,
        samples_per_prompt: int | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> list[list[Rollout]]:
        """The env's scored samples for ``step``: ``prompts`` groups of ``samples_per_prompt``
        :class:`~rlcore.handles.Rollout` (each with ``prompt_ids``, ``token_ids``, the
        generation's ``logprobs`` at temperature 1, ``reward``).

        Each argument left out is ``config.grpo``'s (``seed``: derived from ``grpo.seed``
        and ``step``). The generation gets the devices first; a lost generation worker is
        replaced and the rollout run again with the same request (``on_worker_loss:
        replace``).
        """
        self.now = f"step {step}"
        given = {
            "prompts": prompts, "samples_per_prompt": samples_per_prompt, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed,
        }
        request = dataclasses.replace(
            self._default_request(step), **{k: v for k, v in given.items() if v is not None}
        )
        self._turn("generation")
        return self._retry(lambda: self._collect(request), step, "rollout")  # type: ignore[no-any-return]

    def record_samples(self, step: int, groups: Sequence[Sequence[Rollout]], version: int | None = None) -> None:
        """Write a few of ``step``'s samples, decoded, to the run directory's ``samples.jsonl``
        (every ``logging.samples_every`` steps, ``logging.samples_per_step`` of them;
        :mod:`rlcore.app.samples`) and to the loggers that show text (``logging.*``);
        ``version``: the weights they were sampled with (default:
        the generation's now). Nothing without a run directory.

        Raises:
            RunDirError: the disk could not take the lines (the file ends at a whole line).
        """
        logging_cfg = self.config.logging
        if self.run_dir is None or not due(step, logging_cfg.samples_every):
            return
        version = self.weight_version if version is None else version
        lines = sample_lines(step, groups, self.tokenizer, version, logging_cfg.samples_per_step)
        write_samples(self.run_dir, lines)
        if self._run is not None:
            self._run.writer.samples(lines, step)  # and to the loggers that show text

    def sampling_metrics(self, step: int) -> dict[str, float]:
        """What dynamic sampling did for ``step``'s rollouts (``sampling/dropped_groups``,
        ``sampling/extra_draws``, ``sampling/short_groups``); empty without
        ``grpo.dynamic_sampling``. Each step's figures are given once."""
        return self._sampling.pop(step, {})

    def _collect(self, request: RolloutRequest) -> list[list[Rollout]]:
        """The env's groups for ``request``; with ``grpo.dynamic_sampling``, the groups that
        teach, drawn until ``request.prompts`` of them (:mod:`rlcore.app.dynamic_sampling`)."""
        env, g = self._needed_env(), self.config.grpo
        if not g.dynamic_sampling:
            return env.collect_rollouts(request)
        drawn = draw_teaching_groups(
            lambda draw: env.collect_rollouts(dataclasses.replace(request, draw=draw)),
            request.prompts, g.dynamic_sampling_max_draws,
        )
        self._sampling[request.step] = drawn.metrics()
        return drawn.groups

    def _needed_env(self) -> GuardedEnv:
        env = self.env
        if env is None:
            raise ConfigError("rollouts need an env: set env.backend (e.g. env.backend=arithmetic)", key="env.backend")
        return env

    def _default_request(self, step: int) -> RolloutRequest:
        """The request :meth:`rollouts` makes for ``step`` with every argument left out."""
        g = self.config.grpo
        return RolloutRequest(
            step=step, prompts=g.prompts_per_step, samples_per_prompt=g.samples_per_prompt,
            max_new_tokens=g.max_new_tokens, temperature=g.temperature, seed=g.seed * 1_000_003 + step,
            generation=self.generation, tokenizer=self.tokenizer,
        )

    @contextlib.contextmanager
    def rollout_stream(self, max_staleness: int | None = None) -> Iterator[RolloutStream]:
        """Rollouts generated ahead of the train step, up to ``max_staleness`` (k, default
        ``grpo.max_staleness``, >= 1) weight versions ahead (:mod:`rlcore.app.stream`)::

            with s.rollout_stream() as stream:
                for step in range(1, n + 1):
                    got = stream.next(step)      # StepRollouts: groups, version, timing
                    ...train(step)...; s.refit(step); s.check_refit(step)
                    stream.release(step)         # step + 1 + k may now be generated

        The producer thread asks the env for each step's rollouts as :meth:`rollouts` does
        (same request and seed), once the refit of step - 1 - k has been released. A
        generation worker it loses is replaced on the caller's thread, inside ``next``,
        and the step generated again (``on_worker_loss: replace``); any other failure of
        the producer is raised by ``next`` of its step. Leaving the block stops the
        producer. Needs an env and roles that do not take turns on the devices.
        """
        self._needed_env()
        g = self.config.grpo
        self._default_request(0)  # the handles built here, not first on the producer's thread
        with RolloutStream(
            lambda step: self._collect(self._default_request(step)),
            version=lambda: self.weight_version,
            epoch=lambda: self._generation_epoch,
            cancelled=lambda: self.cancelled,
            max_staleness=g.max_staleness if max_staleness is None else max_staleness,
            last_step=g.steps,
            span=lambda name, t0, t1, step: self.span(name, t0, t1, step=step, lane="rollouts"),
            retry=lambda fn, step: self._retry(fn, step, "rollout"),
        ) as stream:
            yield stream

    def generate(
        self, step: int, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[list[Sample]]:
        """Samples of each prompt (:meth:`rlcore.handles.GenerationHandle.generate` with
        ``params``), for a loop that builds its prompts itself (multi-turn). ``params`` None:
        one sample, with ``max_tokens``, ``temperature`` and ``seed`` as in :meth:`rollouts`.
        The generation gets the devices first, and a lost worker is replaced and the call
        run again."""
        g = self.config.grpo
        if params is None:
            params = SamplingParams(1, g.max_new_tokens, g.temperature, g.seed * 1_000_003 + step)
        self.now = f"step {step}"
        self._turn("generation")
        return self._retry(  # type: ignore[no-any-return]
            lambda: self.generation.generate(prompt_ids, params), step, "generate"
        )

    # ---------------------------------------------------------------- training

    def train(
        self,
        step: int,
        batch: Sequence[Pair],
        advantages: Sequence[float],
        old_logprobs: Sequence[Sequence[float]] | None = None,
        *,
        clip_eps: float | None = None,
        lr: float | None = None,
        engine_logprobs: Sequence[Sequence[float]] | None = None,
    ) -> dict[str, float]:
        """One optimiser step of the policy (:meth:`rlcore.handles.PolicyHandle.train_step`:
        one advantage per pair, ``old_logprobs`` the policy's before the step, ``None`` for
        on-policy); ``clip_eps`` and ``lr`` default to ``config.grpo``'s.

        The loss is GRPO's clipped policy gradient, whatever the loop's algorithm (its
        advantages are its own): ``-1/N * sum over the batch's N completion tokens of
        min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)``, ``ratio =
        exp(logprob - old_logprob)`` (1 without ``old_logprobs``: the REINFORCE gradient),
        ``A`` the advantage of the token's pair; no KL or entropy term, then one AdamW step
        at ``lr`` with the gradient clipped to the policy's ``max_grad_norm``
        (``docs/library.md``; ``docs/grpo.md`` for the options). Where the config asks for
        more than this plain loss (``grpo.clip_eps_high``, ``grpo.loss_aggregation``,
        ``grpo.rollout_correction``), the policy gets them as ``loss=``
        (:class:`rlcore.handles.LossOptions`); ``engine_logprobs``, the generation's sampling
        logprobs of the batch, are what a rollout correction weighs against (required then).
        The policy gets the devices first.

        Returns the step's metrics under the names ``rlcore run`` writes them to
        ``metrics.jsonl``: each of the policy's (at least ``loss``, ``grad_norm``,
        ``clip_fraction``, ``tokens``, ``lr``) as ``train/<name>``: ``train/loss``,
        ``train/grad_norm``...

        Raises:
            TrainingHealthError: a non-finite loss or gradient norm, naming the policy
                backend and ``step``: the weights after it must not be refitted.
        """
        g = self.config.grpo
        shaped = {}
        if requested_features(g):
            if g.rollout_correction != "none" and engine_logprobs is None:
                raise ValueError(
                    f"grpo.rollout_correction={g.rollout_correction} weighs each token by the generation's "
                    "sampling logprobs: pass engine_logprobs (the samples' 'logprobs') to Session.train"
                )
            shaped["loss"] = loss_options(g, engine_logprobs or ())
        self._turn("policy")
        out = self.policy.train_step(
            batch, advantages, old_logprobs,
            clip_eps=g.clip_eps if clip_eps is None else clip_eps,
            lr=g.learning_rate if lr is None else lr,
            **shaped,
        )
        check_train_health(out, backend=self.policy.backend, step=step)
        return {f"{TRAIN_PREFIX}{name}": value for name, value in out.items()}

    def check_mismatch(
        self,
        step: int,
        generation_logprobs: Sequence[Sequence[float]],
        policy_logprobs: Sequence[Sequence[float]],
    ) -> dict[str, float]:
        """The sampler/trainer mismatch of ``step``'s own samples: the generation's sampling
        logprobs against the policy's of the same tokens, before the step trains
        (:mod:`rlcore.app.mismatch`). Returns the ``mismatch/*`` figures for the step's line.
        Above ``grpo.max_mismatch`` it warns once for the step (``grpo.on_mismatch: warn``)
        or raises.

        Raises:
            MismatchError: above ``grpo.max_mismatch`` with ``grpo.on_mismatch: stop``,
                naming the step, both backends and the figures; the step must not train.
        """
        g = self.config.grpo
        stats = mismatch_stats(generation_logprobs, policy_logprobs)
        line = check_mismatch(
            stats, g.max_mismatch, g.on_mismatch, step=step, policy=self.policy.backend,
            generation=self.generation.backend,
        )
        if line is not None:
            self.warn(line)
        return stats

    def warn(self, line: str) -> None:
        """A notice for the run's operator (a mismatch above the bound, steps without any
        gradient): logged as a warning and, in a run of :func:`open`, printed on its console
        as one ``warning:`` line."""
        log.warning("%s", line)
        if self._run is not None:
            self._run.console.print(f"[yellow]warning: {escape(line)}[/yellow]")

    # ---------------------------------------------------------------- weights

    def refit(self, step: int) -> RefitReport:
        """Copy the policy's current weights to the generation (after the train step of
        ``step``) over the run's transport; the :class:`~rlcore.handles.RefitReport`
        (``weight_sync_time_s``, ``bytes``, ``transport``...). A generation worker lost
        during it is replaced and the refit run again. :attr:`weight_version` is then
        ``step``. Check each refit (:meth:`check_refit`): a session whose second refit
        comes while it never called :meth:`check_refit` warns (``UserWarning``, once)."""
        self.wait_checkpoint()  # the policy's ranks take one call at a time
        report = self._retry(lambda: self._refit_once(step), step, "refit")
        self._check_versions(step)
        self.weight_version = step
        self._warn_unchecked(step)
        return report  # type: ignore[no-any-return]

    def _warn_unchecked(self, step: int) -> None:
        """Warn once per session at the second refit when :meth:`check_refit` was never
        called: nothing then tells a refit that left the engine on other weights from one
        that did not (the loop would train on, its rewards flat)."""
        if self._checked or len(self._unchecked) >= 2:
            return
        self._unchecked.append(step)
        if len(self._unchecked) < 2:
            return
        warnings.warn(
            f"this session refitted the weights of steps {self._unchecked[0]} and {step} and never checked a "
            "refit: one that did not reach the generation, or reached it wrong, goes unnoticed. Call "
            "Session.check_refit(step) after each refit (the probe batch), or check the last refit with the "
            "next step's samples: check_refit(step - 1, generation_logprobs=..., policy_logprobs=...)",
            UserWarning,
            stacklevel=3,
        )

    def _check_versions(self, step: int) -> None:
        """Every engine says it holds the weights of ``step`` (where the generation can say:
        :class:`~rlcore.handles.WeightVersioned`); a refit that reported success but left an
        engine on other weights is named before any sample or check relies on it."""
        versions = self.generation.weight_versions()
        wrong = [(i, v) for i, v in enumerate(versions or []) if v != step]
        if wrong:
            engines = ", ".join(f"engine {i} holds version {v}" for i, v in wrong)
            raise RefitError(
                f"after the refit of step {step}, generation backend '{self.generation.backend}' "
                f"reports {engines}, not {step}: the refit did not reach it"
            )

    def _refit_once(self, step: int) -> RefitReport:
        run = self._run
        if run is not None and run.setup is not None:
            return run.setup.refit(step, run.cancel)  # type: ignore[no-any-return]
        if self._refit is None:
            raise RuntimeError("this session was made without a refit")
        return self._refit(step)

    def check_refit(
        self,
        step: int,
        *,
        generation_logprobs: Sequence[Sequence[float]] | None = None,
        policy_logprobs: Sequence[Sequence[float]] | None = None,
        sampled_by: int | None = None,
    ) -> float:
        """Check the refit of ``step``: the generation's and the policy's logprobs of the
        same tokens compared; returns ``refit/token_mult_prob_error`` (1.0: identical).

        Without logprobs, the :attr:`probe` batch goes through both (the generation gets
        the devices first; a lost worker is replaced and the probe run again). With them
        (``refit.check: sampled``'s way, no engine call), they are the generation's
        sampling logprobs of the next step's rollouts and the policy's of the same tokens,
        before its train step; ``sampled_by`` names that step in the error.

        Raises:
            DivergenceError: above ``refit.max_mult_prob_error``, naming both backends and
                the step (``mult_prob_error`` and ``step`` as attributes). Leaving
                :func:`open`'s block with it adds whose bug it is.
        """
        if (generation_logprobs is None) != (policy_logprobs is None):
            raise ValueError("check_refit takes both generation_logprobs and policy_logprobs, or neither")
        self._checked = True
        if generation_logprobs is None or policy_logprobs is None:
            self._turn("generation")
            err = self._retry(self._probe_error, step, "probe")
        else:
            err = token_mult_prob_error(generation_logprobs, policy_logprobs)
        check_divergence(
            err, self.config.refit.max_mult_prob_error, step=step, policy=self.policy.backend,
            generation=self.generation.backend, sampled_by=sampled_by,
        )
        return float(err)

    def _probe_error(self) -> float:
        """``token_mult_prob_error`` of the probe batch, generation against policy, both at
        once (logprobs work on a sleeping handle: :class:`~rlcore.handles.MemoryHandoff`)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="rlcore-probe")
        try:  # not waited for on an interrupt: the teardown ends the call
            policy_lp = pool.submit(self.policy.logprobs, self.probe)
            return token_mult_prob_error(self.generation.logprobs(self.probe), policy_lp.result())
        finally:
            pool.shutdown(wait=False)

    # ---------------------------------------------------------------- checkpoints

    def checkpoint(self, step: int, *, force: bool = False) -> None:
        """Save the training state after ``step`` (policy, env position, step) when
        ``checkpoint.every_steps`` says so, or with ``force`` (:mod:`rlcore.app.checkpointing`);
        in the background where the policy allows, joined before the policy's next call."""
        c = self._checkpointer
        if c is not None and (force or c.due(step)):
            c.save(step)

    @property
    def checkpointing(self) -> bool:
        """The run saves checkpoints (``checkpoint.every_steps`` > 0)."""
        return self._checkpointer is not None

    def stop_if_preempted(self, step: int) -> None:
        """At the end of ``step``: a SIGTERM held back for a last checkpoint
        (``checkpoint.on_sigterm``, within ``checkpoint.sigterm_grace_s``) saves the state
        after ``step`` now, then stops the run as the signal would have (exit 143)."""
        guard = self._deferring
        if guard is None or guard.pending is None:
            return
        self.now = f"the checkpoint of step {step} ({signal_name(guard.pending.signum)} held for it)"
        self.checkpoint(step, force=True)
        self.finish_checkpoint()
        raise guard.take_pending()

    def wait_checkpoint(self) -> None:
        """Before a call on the policy: wait for a save in flight that reads its state (a
        staged save goes on writing); raises a failed save's :class:`~rlcore.errors.CheckpointError`."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def finish_checkpoint(self) -> None:
        """Wait until the save in flight, staged or not, is published (raises its failure)."""
        if self._checkpointer is not None:
            self._checkpointer.finish()

    def _make_checkpointer(self, run: _Run) -> Checkpointer:
        config, prepared = self.config, run.prepared
        fmt = policy_format(prepared)
        assert fmt is not None and fmt.backend == config.policy.backend  # the preflight checked
        decl = prepared.declarations[Role.POLICY]
        assert decl.checkpoint is not None
        publish = prepared.registry.hook("rlcore_publish", [prepared.backends[Role.POLICY]])
        deadline_s = config.setup.deadline_s
        env = self.env
        state = getattr(env.handle, "state", None) if env is not None else None
        return Checkpointer(
            checkpoint_root(config, run.run_dir),
            policy=self.policy.handle,
            publish=lambda dest, write: publish(
                destination=dest, write=write, cancel=run.cancel, deadline=Deadline(deadline_s, f"publish of {dest}")
            ),
            contents=Contents(
                manifest={"policy": dataclasses.asdict(fmt), "config": shared_config(config)},
                config_yaml=OmegaConf.to_yaml(OmegaConf.structured(config)),
                env_state=(lambda step: state(after_step=step)) if callable(state) else (lambda step: None),
            ),
            schedule=Schedule(
                every=config.checkpoint.every_steps, last_step=config.grpo.steps, keep=config.checkpoint.keep,
                keep_every=config.checkpoint.keep_every,
                overlap=save_overlaps(config, decl), staged=save_stages(config, decl),
            ),
            record=self._saved,
            flush=run.writer.sync,
            cancel=run.cancel,
            write_timeout_s=deadline_s,
        )

    def _saved(self, m: dict[str, Any], step: int) -> None:
        """A save's line in ``metrics.jsonl`` and on the console."""
        self.record(m, step, step_done=False)
        if self._run is not None:
            self._run.console.print(
                f"checkpoint of step {step}: {m['checkpoint/path']} "
                f"({m['checkpoint/bytes'] / 2**20:.1f} MiB in {m['checkpoint/save_time_s']:.1f}s)"
            )

    def _restore(self, point: Chosen) -> None:
        """Load the checkpoint a resumed run continues from, then refit the generation from
        the restored policy (checked as every refit is, by the loop); the loop starts at
        the step after it."""
        from rlcore.app.checkpoints import POLICY_DIR

        self.now = f"loading the checkpoint of step {point.step}"
        t0 = time.monotonic()
        self.policy.handle.load_checkpoint(str(point.found.path / POLICY_DIR))
        env = self.env
        saved_env = point.manifest.get("env")
        if env is not None and saved_env is not None:
            load_state = getattr(env.handle, "load_state", None)
            if not callable(load_state):
                raise CheckpointError(
                    f"the checkpoint {point.found.path} holds the state of env '{self.config.env.backend}', "
                    "whose handle has no load_state()"
                )
            load_state(saved_env)
        load_s = time.monotonic() - t0
        self.now = f"the refit of the restored step {point.step}"
        report = self.refit(point.step)
        self.first_step = point.step + 1
        if self._checkpointer is not None:
            self._checkpointer.last_saved = point.step
        missing = _missing_steps(self._run.history, point.step) if self._run is not None else []
        self.record({
            "checkpoint/resumed_from": point.step, "checkpoint/path": str(point.found.path),
            "checkpoint/load_time_s": load_s, "checkpoint/skipped": point.skipped,
            "checkpoint/cleaned": point.cleaned, "checkpoint/metrics_missing_steps": missing,
            "refit/weight_sync_time_s": report.weight_sync_time_s,
        }, point.step, step_done=False)
        console = self._run.console if self._run is not None else None
        if console is not None:
            skipped = f"; skipped {', '.join(point.skipped)}" if point.skipped else ""
            cleaned = f"; removed {', '.join(point.cleaned)}" if point.cleaned else ""
            console.print(
                f"resumed from {point.found.path} (step {point.step}, loaded in {load_s:.1f}s){skipped}{cleaned}"
            )
            if missing:
                console.print(
                    f"[yellow]warning: metrics.jsonl lacks the lines of {len(missing)} step(s) up to the "
                    f"checkpoint ({_spans(missing)}): written after its last flush to the disk, they were "
                    "lost; the run goes on from the checkpoint[/yellow]"
                )

    # ---------------------------------------------------------------- records

    def record(self, metrics: Mapping[str, Any], step: int, *, step_done: bool = True) -> None:
        """Append ``{"step": step, **metrics}`` to ``metrics.jsonl`` (one whole line).

        ``step_done`` (the default): the line is step ``step``'s result (``step`` >= 1), so
        the step counts as done in ``run.json`` (a rerun into the directory is then
        refused) and its ``reward/mean`` goes into ``reward.png`` and the reward's trend
        at the end. Pass ``False`` for a line about a step that did not complete.

        Raises:
            RunDirError: the disk could not take the line (the file ends at a whole line).
        """
        if self._run is not None:
            self._run.record(metrics, step, step_done)
        elif self._record is not None:
            self._record(dict(metrics), step)

    def span(self, name: str, start: float, end: float, *, step: int | None = None, lane: str = "loop") -> None:
        """A span in ``trace.json`` (``start`` and ``end`` from :func:`time.monotonic`)."""
        if self._run is not None:
            args = None if step is None else {"step": step}
            self._run.trace.add_span(name, start, end, cat="step", lane=lane, args=args)
        elif self._span is not None:
            self._span(name, start, end, step)

    # ---------------------------------------------------------------- the end

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._end(exc)

    def close(self) -> None:
        """Tear the run down and write its records (the end of a ``with`` block that
        raised nothing); a second call does nothing."""
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        """The run's end after ``exc`` (``None``: the loop finished): what ``rlcore run``
        does after its loop, raising what the run ends with when it is not ``exc``."""
        if self._closed:
            return
        self._closed = True
        if self._deferring is not None:
            self._deferring.undefer()
        run = self._run
        if run is None:
            return
        failure: BaseException | None = exc
        # A failure while the GCS is gone (the workers may die with the head's node before
        # the watch has given up on it) is the head's loss, said as such.
        failed = exc is not None and not isinstance(exc, KeyboardInterrupt)
        lost = HEAD_WATCH.error(self.now, check=True) if failed else None
        if lost is not None and not isinstance(exc, ClusterLost):
            failure = lost
            failure.__cause__ = exc
        try:
            try:
                if isinstance(exc, DivergenceError) and failure is exc:
                    self.now = "the diagnosis of the failed refit check"
                    failure = DivergenceError(
                        f"{exc} {self._diagnosis()}", mult_prob_error=exc.mult_prob_error, step=exc.step
                    )
                    failure.__cause__ = exc
                elif exc is None:
                    self.finish_checkpoint()
                    run.report()
                    self.now = "teardown"
            except BaseException as err:
                failure = err
            if exc is not None and not isinstance(exc, KeyboardInterrupt):
                run.plot_failed()  # the steps before the failure: reward.png, as a finished run has
            if isinstance(failure, KeyboardInterrupt) and not isinstance(failure, RunInterrupted):
                failure = run.stop_interrupted(failure)
                failure.__suppress_context__ = True
        finally:
            run.finish(failure)
        if failure is not exc:
            raise failure

    def _diagnosis(self) -> str:
        """Whose bug a failed refit check is (:mod:`rlcore.app.diagnose`), in one sentence."""
        from rlcore.app.diagnose import FailedCheck, diagnose_divergence
        from rlcore.models.tiny import ensure_model
        from rlcore.refit.capture import file_transport_first
        from rlcore.refit.sessions import RefitSessions
        from rlcore.setup.planner import detect_accelerator
        from rlcore.setup.runner import refit_context

        run = self._run
        assert run is not None and run.setup is not None
        config, setup = self.config, run.setup
        decl = setup.plugins["policy"].declaration
        check = FailedCheck(
            probe=self.probe,
            policy_logprobs=self.policy.logprobs,
            generation_logprobs=self.generation.logprobs,
            limit=config.refit.max_mult_prob_error or 1.05,
            names=(config.policy.backend, config.generation.backend),
        )
        return diagnose_divergence(
            check,
            policy=setup.handles["policy"],
            make_context=lambda transport: refit_context(
                config, step=0, transport=transport, cancel=run.cancel, sessions=RefitSessions()
            ),
            transport=file_transport_first(decl.send_transports if decl else (), detect_accelerator()),
            model_dir=str(ensure_model(config.model, cache_dir(config))),
        )


def _handoff(config: RunConfig, setup: SetupResult) -> Handoff:
    """Colocated: the device handed between the roles that declare ``memory_handoff``
    (unless ``placement.memory_handoff`` is false); otherwise one that does nothing."""
    if not (config.placement.colocated and config.placement.memory_handoff):
        return Handoff()
    sleeper = {
        role: setup.handles[role]
        for role in ("policy", "generation")
        if (d := setup.plugins[role].declaration) is not None and d.memory_handoff
    }
    return Handoff(sleeper.get("policy"), sleeper.get("generation"))


class _Run:
    """What :func:`open` started and the session's end stops: the records, the cluster,
    the setup. ``start`` and ``finish`` are ``rlcore run``'s before and after its loop."""

    def __init__(
        self,
        prepared: PreparedRun,
        run_dir: Path,
        status: RunStatus,
        console: Console,
        guard: SignalGuard | None,
        choice: ClusterChoice | None = None,
        cluster: Cluster | None = None,
        resumed_after: int | None = None,
    ) -> None:
        config = prepared.config
        self.prepared, self.config, self.plan, self.run_dir = prepared, config, prepared.plan, run_dir
        self.status, self.console, self.guard = status, console, guard
        self.trace = TraceRecorder()
        self.writer = LoggedWriter(run_dir / "metrics.jsonl", config, resumed_after=resumed_after)  # and to logging.*
        self.cluster = cluster if cluster is not None else Cluster(config.cluster, choice)
        self.cancel = CancelToken()
        self.phase = RunPhase()
        self.setup: SetupResult | None = None
        self.setup_metrics: dict[str, Any] = {}
        self.plot: overlap.Background | None = None
        self.groups_before = len(placed_groups())
        self.done: set[int] = set()  # steps recorded as done (run.json)
        self.resume_point: Chosen | None = None  # the checkpoint a resumed run loads
        self.history: list[dict[str, Any]] = []  # their lines with a reward, for the plot
        # The model and its tokenizer get ready while Ray starts.
        overlap.prefetch_tokenizer(config.model, cache_dir(config), self.cancel)

    def start(self) -> None:
        """Cluster, setup (with its table), the setup's metrics line and ``placement.json``;
        on any failure the run is torn down and its records written before the error."""
        config, console = self.config, self.console
        try:
            with console.status("starting Ray cluster"):
                t0 = time.monotonic()
                self.cluster.start()
                devices = self.cluster.reserve_devices(config)
                self.trace.add_span("cluster start", t0, time.monotonic(), cat="setup", lane="cluster")
            progress = SetupProgress([t.name for t in self.plan.tasks])
            slow = SlowTasks(
                config.setup.slow_task_warn_s, lambda line: console.print(f"[yellow]setup: {escape(line)}[/yellow]")
            )

            def shown(task: str, what: str) -> None:
                progress(task, what)
                slow(task, what)

            with setup_display(progress, console), slow.watching():
                self.setup = run_prepared(
                    self.prepared, run_dir=self.run_dir, cancel=self.cancel,
                    progress=self.phase.watch(shown, None if console.is_terminal else console.print),
                    network=self.cluster.network(config),
                    devices=devices,
                )
            self.trace.add_execution(self.setup.execution, self.setup.plan)
            self._record_setup(self.setup)
            # Drawn once the first step is done: it needs no cluster, and the first step does.
            self.plot = overlap.Background("setup plot", _plot_setup, self.setup, self.run_dir, config, defer=True)
            _write_placement(self.run_dir, self.setup, self.cluster.network(config), self.groups_before)
        except BaseException as err:
            failure: BaseException = err
            try:
                if isinstance(err, KeyboardInterrupt):
                    # SIGINT/SIGTERM (SignalGuard) or Ctrl-C: a bounded teardown, the records
                    # written first, then one error that says what was interrupted.
                    failure = self.stop_interrupted(err)
            finally:
                self.finish(failure)
            if failure is not err:
                raise failure from None
            raise

    def _record_setup(self, setup: SetupResult) -> None:
        """The setup's metrics (with Ray's start) as the run's first line, and one line on the console."""
        record = dict(setup.metrics)
        record["timing/setup/cluster_start_time_s"] = self.cluster.start_time_s or 0.0
        self.setup_metrics = record
        self.writer.write(record, step=0)
        m = setup.metrics
        self.console.print(
            f"setup: total {m['timing/setup/total_setup_time_s']:.2f}s, "
            f"critical path {m['timing/setup/critical_path_s']:.2f}s, "
            f"serial sum {m['timing/setup/serial_sum_s']:.2f}s"
        )

    def record(self, metrics: Mapping[str, Any], step: int, step_done: bool) -> None:
        """One ``metrics.jsonl`` line; a step's first line done marks it in ``run.json``
        first (a disk filling between the two leaves a run that blocks its ``--out``)."""
        done = step_done and step >= 1
        if done and step not in self.done:
            self.done.add(step)
            self.status.step_done()
        self.writer.write(metrics, step=step)
        if done:
            if "reward/mean" in metrics:
                self.history.append({"step": step, "time": time.time(), **metrics})
            if self.plot is not None:
                self.plot.start()

    def record_loss(self, m: dict[str, Any], step: int) -> None:
        """One metrics line per replaced generation, and one line on the console."""
        self.writer.write(m, step=step)
        self.console.print(
            f"[yellow]step {step:>3}  lost {m['generation/lost_worker']} ({m['generation/lost_cause']}) during "
            f"{m['generation/lost_during']}; replaced {m['generation/replaced']}, serving in "
            f"{m['generation/replace_time_s']:.1f}s "
            f"(init {m['generation/replace_init_time_s']:.1f}s, mult_prob_err "
            f"{m['generation/replace_mult_prob_error']:.4f})[/yellow]"
        )

    def report(self) -> None:
        """After a loop that finished: ``reward.png`` and the reward's trend (of the steps
        recorded with a reward), then the setup timeline joined."""
        if self.history:
            self._plot_reward()
            trend = reward_trend(self.history)
            if trend is not None:
                self.writer.write(trend, step=self.history[-1]["step"])
                self.console.print(trend_line(trend))
        if self.plot is not None:
            self.plot.result()

    def plot_failed(self) -> None:
        """After a loop that failed (not one interrupted: its teardown is bounded):
        ``reward.png`` of the steps it recorded, if any. A plot that cannot be written is
        logged, never raised: the run's own failure is what it ends with."""
        if not self.history:
            return
        try:
            self._plot_reward(failed=True)
        except Exception as err:  # noqa: BLE001 - reported, the failure it follows is raised
            log.warning("reward.png of the failed run not written: %s", err)

    def _plot_reward(self, *, failed: bool = False) -> None:
        last = self.history[-1]["step"]
        title = f"{self.config.name}: reward" + (f" (failed after step {last})" if failed else "")
        plot_reward(self.history, self.run_dir / "reward.png", title=title)

    def finish(self, failure: BaseException | None) -> None:
        """Shut everything down and close the records, whatever the run ended with; the
        process is left as before :func:`open` (no cluster, worker or signal handler)."""
        self.writer.close_loggers(failure)  # they close during the teardown; close_records waits (bounded)
        try:
            if self.plot is not None:  # the timeline of a setup that finished, whatever came after
                self.plot.start()
                self.plot.join(30.0)
            if self.setup is not None:
                for line in self.setup.shutdown():
                    self.console.print(f"[yellow]shutdown: {line}[/yellow]")
            self.cluster.shutdown()
            forget_placed(self.groups_before)
            overlap.discard_tokenizer(self.config.model, cache_dir(self.config))
            close_records(self.run_dir, self.writer, self.trace, self.status, failure)
        finally:
            if self.guard is not None:
                self.guard.__exit__(None, None, None)
                self.guard = None

    def stop_interrupted(self, err: KeyboardInterrupt) -> RunInterrupted:
        """Tear a run down after a signal: cancel, record, shut down (bounded), report."""
        during = self.phase.now
        signum = signum_of(err)
        t_signal = getattr(err, "at", time.monotonic())
        reason = f"interrupted ({signal_name(signum)}) during {during}"
        self.cancel.cancel(reason)
        setup, trace, writer = self.setup, self.trace, self.writer
        # Setup interrupted: the executor has shut down what had started; its records are here.
        execution = setup.execution if setup is not None else getattr(err, "execution", None)
        if setup is None and execution is not None:
            trace.add_execution(execution, self.plan)
        problems: list[str] = []
        # A write that fails (a full disk) is one of the teardown's problems: the signal is
        # what the run ends with.
        _try_write(problems, writer.write, {
            "run/interrupted_by": signal_name(signum), "run/interrupted_during": during,
        })
        trace.add_instant(reason, t_signal, cat="run", lane="run")
        # Written before the teardown, in case it is cut short.
        _try_write(problems, trace.write, self.run_dir / "trace.json")

        t0 = time.monotonic()
        if setup is not None:
            problems += setup.shutdown(INTERRUPT_SHUTDOWN_S)
        shut_down = list(execution.shut_down) if execution is not None else []
        if execution is not None:  # stopped on the token (their threads kill what they started)
            shut_down += [
                f"{name} cancelled" for name, rec in execution.records.items() if rec.status == "cancelled"
            ]
        had_cluster = self.cluster.owned
        killed = self.cluster.shutdown(reason)
        if had_cluster:
            shut_down.append("Ray cluster")
        problems += [f"SIGKILLed {k}" for k in killed]
        if setup is None and execution is not None:
            problems += execution.shutdown_errors
        t1 = time.monotonic()
        trace.add_span("teardown after interrupt", t0, t1, cat="run", lane="run", args={"problems": problems})
        seconds = t1 - t_signal
        _try_write(problems, writer.write, {
            "run/interrupt_teardown_s": seconds, "run/shut_down": shut_down,
            "run/shutdown_problems": problems,
        })
        return RunInterrupted(signum, during, shut_down, problems, self.run_dir, seconds)


def _try_write(problems: list[str], write: Callable[..., Any], *args: Any) -> None:
    """``write(*args)``; a :class:`RunDirError` is added to ``problems`` (once)."""
    try:
        write(*args)
    except RunDirError as err:
        if str(err) not in problems:
            problems.append(str(err))


def _write_placement(run_dir: Path, setup: SetupResult, network: Network, skip: int) -> None:
    """``placement.json``: where each worker group's ranks run (Ray node ids, as the workers
    report them), where the refit channel meets, and whether servers bound beyond loopback."""
    spec, handles = None, setup.handles
    if setup.plan.refit_transport and "policy" in handles and "generation" in handles:
        spec = setup.refit_sessions.spec_for(handles["policy"], handles["generation"], setup.plan.refit_transport)
    record = {
        "groups": placed_groups()[skip:],
        "readers_elsewhere": network.readers_elsewhere,
        "refit": None if spec is None else {"transport": spec.transport, "addr": spec.addr, "port": spec.port},
    }
    write_atomic(run_dir / "placement.json", json.dumps(record, indent=2) + "\n")


def _plot_setup(setup: SetupResult, run_dir: Path, config: RunConfig) -> None:
    ex = setup.execution
    spans = [
        (name, rec.start - ex.start, rec.end - ex.start, rec.status)
        for name, rec in ex.records.items()
        if rec.start is not None and rec.end is not None
    ]
    m = setup.metrics
    plot_setup_timeline(
        spans,
        run_dir / "setup_timeline.png",
        title=f"{config.name}: setup ({config.policy.backend} + {config.generation.backend})",
        annotations={
            "total": m["timing/setup/total_setup_time_s"],
            "critical path": m["timing/setup/critical_path_s"],
            "serial sum": m["timing/setup/serial_sum_s"],
        },
    )

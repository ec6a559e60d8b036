"""``rlcore run``: set up -> GRPO loop -> report, into a run directory.

Reads top to bottom: load config and plugins, start the cluster, run the setup
plan with progress shown, run the loop (rollout, reward, train step, refit,
refit check), write ``metrics.jsonl``, ``trace.json`` and the plots, tear everything
down (also on failure or Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rlcore.app import overlap
from rlcore.app.grpo import Handoff, check_divergence, probe_batch, run_grpo, token_mult_prob_error
from rlcore.app.health import reward_trend, trend_line
from rlcore.app.interrupts import RunInterrupted, signal_name, signum_of
from rlcore.app.plots import plot_reward, plot_setup_timeline
from rlcore.app.recovery import GenerationRecovery
from rlcore.config import RunConfig, cache_dir, load_config
from rlcore.errors import ConfigError, DivergenceError, RunDirError
from rlcore.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.placement import Network
from rlcore.runtime.cluster import Cluster
from rlcore.runtime.workers import placed_groups
from rlcore.setup.metrics import MetricsWriter, write_atomic
from rlcore.setup.preflight import (
    RUN_STATUS_FILE,
    check_before_start,
    no_step_leftovers,
    read_run_status,
    run_dir_for,
)
from rlcore.setup.registry import load_registry
from rlcore.setup.runner import SetupResult, run_setup
from rlcore.setup.trace import TraceRecorder
from rlcore.waiting import CancelToken

log = logging.getLogger(__name__)


def make_run_dir(config: RunConfig, out: str | None, *, resume: bool = False) -> Path:
    """Create the run directory (``out``, else a new ``<output_dir>/<name>-<time>[-k]``).

    :func:`rlcore.setup.preflight.check_before_start` has checked that it can be written and
    that ``out`` is empty unless the run resumes, or holds only what a run that completed no
    step left: those files are removed here, so the new run starts from an empty directory.

    Raises:
        RunDirError: the directory or a leftover could not be created or removed.
    """
    path = base = run_dir_for(config, out)
    k = 1
    while not out and path.exists():  # two runs started in the same second
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        for old in [] if resume else no_step_leftovers(path) or []:
            if old.is_dir():  # a write check's directory, left by a kill
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)
    except OSError as err:
        raise RunDirError.from_os_error(err.filename or path, err) from err
    return path


class RunStatus:
    """The run's ``run.json``: how far it got, written whole at its start (``setting-up``),
    before the first step's metrics line (``running``) and at its end (``finished``,
    ``failed`` or ``interrupted``, with the error). ``steps_done`` is exact once the run has
    ended; while it runs (or if it was killed) it says only that steps were done. A rerun into
    the same ``--out`` reads it (:func:`rlcore.setup.preflight.check_run_dir`): a run that
    completed no step (failed, interrupted or killed in setup) does not block it.

    A resumed run counts on from the ``steps_done`` of the run it appends to (unknown, and
    so never replaced, when that run left no ``run.json``).
    """

    def __init__(self, run_dir: Path, *, resume: bool) -> None:
        self.path = run_dir / RUN_STATUS_FILE
        self.before: int | None = 0
        if resume:
            prev = read_run_status(run_dir)
            steps = prev.get("steps_done") if prev is not None else None
            has_files = any(p.name != RUN_STATUS_FILE for p in run_dir.iterdir())
            self.before = steps if isinstance(steps, int) else (None if has_files else 0)
        self.steps = 0
        self.record: dict[str, Any] = {
            "status": "setting-up",
            "steps_done": self.before,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": datetime.now().isoformat(timespec="seconds"),
        }
        self._write()

    def _write(self) -> None:
        if self.before is not None:
            self.record["steps_done"] = self.before + self.steps
        self.record["updated_at"] = datetime.now().isoformat(timespec="seconds")
        write_atomic(self.path, json.dumps(self.record, indent=2) + "\n")

    def step_done(self) -> None:
        """A step has run; called before its ``metrics.jsonl`` line is written, so that a disk
        filling between the two leaves a run that blocks its ``--out`` rather than one a rerun
        replaces. Only the first step is written (the count is written at the end)."""
        self.steps += 1
        if self.steps == 1:
            self.record["status"] = "running"
            self._write()

    def end(self, failure: BaseException | None) -> None:
        """``finished``, or ``failed`` / ``interrupted`` with the error's line."""
        if failure is None:
            self.record["status"] = "finished"
        else:
            interrupted = isinstance(failure, KeyboardInterrupt)
            self.record["status"] = "interrupted" if interrupted else "failed"
            self.record["error"] = f"{type(failure).__name__}: {' '.join(str(failure).split())}"
        self._write()


class SetupProgress:
    """A live table of setup tasks: waiting / running / done, with elapsed times."""

    def __init__(self, names: Sequence[str]) -> None:
        self.state = {n: ("waiting", None, None) for n in names}
        self.t0 = time.monotonic()

    def __call__(self, task: str, what: str) -> None:
        _, start, _ = self.state.get(task, ("waiting", None, None))
        now = time.monotonic()
        if what == "start":
            self.state[task] = ("running", now, None)
        else:
            self.state[task] = (what, start, now)

    def __rich__(self) -> Table:
        table = Table(title="setup", expand=False)
        table.add_column("task")
        table.add_column("state")
        table.add_column("time", justify="right")
        now = time.monotonic()
        style = {"running": "yellow", "end": "green", "ok": "green", "failed": "red"}
        for name, (state, start, end) in self.state.items():
            elapsed = "" if start is None else f"{(end or now) - start:.1f}s"
            label = "done" if state in ("end", "ok") else state
            table.add_row(name, f"[{style.get(state, 'white')}]{label}[/]", elapsed)
        return table


def run_job(
    config_path: str | None,
    overrides: Sequence[str] = (),
    *,
    out: str | None = None,
    console: Console | None = None,
    setup_only: bool = False,
    extra_plugins: Sequence[tuple[str, Any]] = (),
    resume: bool = False,
) -> Path:
    """Run the main job; returns the run directory. Raises RlcoreError subclasses on failure.

    ``extra_plugins`` are (name, plugin) pairs registered beside the installed ones
    (wrapper plugins for tracing or fault injection when embedding rlcore).
    Every check that needs no cluster runs first (:mod:`rlcore.setup.preflight`): a bad
    input raises :class:`~rlcore.errors.ConfigError` before any process starts.
    ``resume`` lets ``out`` be a non-empty run directory (metrics are appended).
    """
    console = console or Console()
    config = load_config(config_path, overrides)
    registry = load_registry(config.plugins.allow, extra=extra_plugins)
    for f in registry.failures:
        console.print(f"[yellow]skipped plugin {f.name} ({f.distribution}): {f.message}[/yellow]")
    plan = check_before_start(config, registry, out=out, resume=resume)
    if not setup_only and not config.env.backend:
        raise ConfigError(
            "rlcore run's GRPO loop needs an env: set env.backend (e.g. env.backend=arithmetic)",
            key="env.backend",
        )
    run_dir = make_run_dir(config, out, resume=resume)
    status = RunStatus(run_dir, resume=resume)  # first: what follows is a run's to replace
    write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(config)))

    trace = TraceRecorder()
    metrics_writer = MetricsWriter(run_dir / "metrics.jsonl")
    cluster = Cluster(config.cluster)
    cancel = CancelToken()
    if not setup_only:  # the model and its tokenizer get ready while Ray starts
        overlap.prefetch_tokenizer(config.model, cache_dir(config), cancel)
    phase = RunPhase()
    setup: SetupResult | None = None
    plot: overlap.Background | None = None
    failure: BaseException | None = None
    try:
        groups_before = len(placed_groups())
        with console.status("starting Ray cluster"):
            t0 = time.monotonic()
            cluster.start()
            devices = cluster.reserve_devices(config)
            trace.add_span("cluster start", t0, time.monotonic(), cat="setup", lane="cluster")
        progress = SetupProgress([t.name for t in plan.tasks])
        with _setup_display(progress, console):
            setup = run_setup(
                config, registry, run_dir=run_dir, plan=plan, cancel=cancel,
                progress=phase.watch(progress, None if console.is_terminal else console.print),
                network=cluster.network(config),
                devices=devices,
            )
        trace.add_execution(setup.execution, setup.plan)
        _record_setup(setup, cluster, metrics_writer, console)
        # Drawn once the first step is done: it needs no cluster, and the first step does.
        plot = overlap.Background("setup plot", _plot_setup, setup, run_dir, config, defer=True)
        _write_placement(run_dir, setup, cluster.network(config), groups_before)
        if not setup_only:
            try:
                _train(
                    config, setup, cancel, trace, metrics_writer, run_dir, console, phase,
                    plot.start, status.step_done,
                )
            except DivergenceError as err:
                phase.now = "the diagnosis of the failed refit check"
                raise DivergenceError(f"{err} {_diagnosis(config, setup, cancel)}") from err
        plot.result()
        phase.now = "teardown"
        return run_dir
    except KeyboardInterrupt as err:
        # SIGINT/SIGTERM (rlcore.app.interrupts.SignalGuard) or Ctrl-C: a bounded teardown,
        # the records written first, then one error that says what was interrupted.
        failure = err
        failure = _stop_interrupted(
            err, phase.now, cancel, setup, cluster, trace, metrics_writer, run_dir, plan
        )
        raise failure from None
    except BaseException as err:
        failure = err
        raise
    finally:
        if plot is not None:  # the timeline of a setup that finished, whatever came after
            plot.start()
            plot.join(30.0)
        if setup is not None:
            for line in setup.shutdown():
                console.print(f"[yellow]shutdown: {line}[/yellow]")
        cluster.shutdown()
        _close_records(run_dir, metrics_writer, trace, status, failure)


def _close_records(
    run_dir: Path,
    writer: MetricsWriter,
    trace: TraceRecorder,
    status: RunStatus,
    failure: BaseException | None,
) -> None:
    """Close ``metrics.jsonl``, write ``trace.json``, then the final ``run.json``, each tried
    whatever the others did. A write that fails (a full disk) raises the first
    :class:`RunDirError` when the run had not failed already; otherwise the run's own error
    is the one to report (not a chained traceback), and this one is logged."""
    first: RunDirError | None = None
    writes = (
        writer.close,
        lambda: trace.write(run_dir / "trace.json"),
        lambda: status.end(failure or first),
    )
    for write in writes:
        try:
            write()
        except RunDirError as err:
            if failure is None and first is None:
                first = err
            elif isinstance(failure or first, RunDirError):
                log.debug("%s", err)  # the same disk: the error reported already says so
            else:
                log.warning("%s", err)
    if first is not None:
        raise first


def _record_setup(setup: SetupResult, cluster: Cluster, writer: MetricsWriter, console: Console) -> None:
    """The setup's metrics (with Ray's start) as the run's first line, and one line on the console."""
    record = dict(setup.metrics)
    record["timing/setup/cluster_start_time_s"] = cluster.start_time_s or 0.0
    writer.write(record, step=0)
    m = setup.metrics
    console.print(
        f"setup: total {m['timing/setup/total_setup_time_s']:.2f}s, "
        f"critical path {m['timing/setup/critical_path_s']:.2f}s, "
        f"serial sum {m['timing/setup/serial_sum_s']:.2f}s"
    )


@contextlib.contextmanager
def _setup_display(progress: SetupProgress, console: Console) -> Iterator[None]:
    """The live setup table on a terminal; elsewhere (a log) the table once at the end."""
    if console.is_terminal:
        with Live(progress, console=console, refresh_per_second=4, transient=False):
            yield
        return
    try:
        yield
    finally:
        console.print(progress)


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


class RunPhase:
    """What a run is doing now, in the words of an interrupt's message: ``cluster start``,
    the setup tasks running (``init:policy, init:generation``), ``step 3``, ``teardown``."""

    def __init__(self) -> None:
        self.now = "cluster start"
        self._running: list[str] = []
        self._lock = threading.Lock()

    def watch(
        self, progress: Callable[[str, str], None], say: Callable[[str], None] | None = None
    ) -> Callable[[str, str], None]:
        """``progress`` (a setup event callback) that also keeps :attr:`now` up to date and,
        with ``say``, reports each event as a line (``setup: init:policy running``): the
        live table is drawn only on a terminal, a log needs the lines."""

        def event(task: str, what: str) -> None:
            if say is not None:
                say(f"setup: {task} {_EVENT_WORDS.get(what, what)}")
            with self._lock:
                # Only starts and successful ends move the phase: the events a cancellation
                # sends (cancelled, not_started) must not hide what it interrupted.
                if what == "start":
                    self._running.append(task)
                elif what == "end" and task in self._running:
                    self._running.remove(task)
                if what in ("start", "end"):
                    self.now = ", ".join(self._running) or f"setup (after {task})"
            progress(task, what)

        return event


_EVENT_WORDS = {"start": "running", "end": "done"}

#: Bound on each backend's shutdown after an interrupt (the run must end within 10 s).
INTERRUPT_SHUTDOWN_S = 3.0


def _stop_interrupted(
    err: KeyboardInterrupt,
    during: str,
    cancel: CancelToken,
    setup: SetupResult | None,
    cluster: Cluster,
    trace: TraceRecorder,
    writer: MetricsWriter,
    run_dir: Path,
    plan: Any,
) -> RunInterrupted:
    """Tear a run down after a signal: cancel, record, shut down (bounded), report."""
    signum = signum_of(err)
    t_signal = getattr(err, "at", time.monotonic())
    reason = f"interrupted ({signal_name(signum)}) during {during}"
    cancel.cancel(reason)
    # Setup interrupted: the executor has shut down what had started; its records are here.
    execution = setup.execution if setup is not None else getattr(err, "execution", None)
    if setup is None and execution is not None:
        trace.add_execution(execution, plan)
    problems: list[str] = []
    # A write that fails (a full disk) is one of the teardown's problems: the signal is what
    # the run ends with.
    _try_write(problems, writer.write, {
        "run/interrupted_by": signal_name(signum), "run/interrupted_during": during,
    })
    trace.add_instant(reason, t_signal, cat="run", lane="run")
    # Written before the teardown, in case it is cut short.
    _try_write(problems, trace.write, run_dir / "trace.json")

    t0 = time.monotonic()
    if setup is not None:
        problems += setup.shutdown(INTERRUPT_SHUTDOWN_S)
    shut_down = list(execution.shut_down) if execution is not None else []
    if execution is not None:  # stopped on the token (their threads kill what they started)
        shut_down += [
            f"{name} cancelled" for name, rec in execution.records.items() if rec.status == "cancelled"
        ]
    had_cluster = cluster.owned
    killed = cluster.shutdown(reason)
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
    return RunInterrupted(signum, during, shut_down, problems, run_dir, seconds)


def _try_write(problems: list[str], write: Callable[..., Any], *args: Any) -> None:
    """``write(*args)``; a :class:`RunDirError` is added to ``problems`` (once)."""
    try:
        write(*args)
    except RunDirError as err:
        if str(err) not in problems:
            problems.append(str(err))


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


def _diagnosis(config: RunConfig, setup: SetupResult, cancel: CancelToken) -> str:
    """Whose bug a failed refit check is (:mod:`rlcore.app.diagnose`), in one sentence."""
    from rlcore.app.diagnose import diagnose_divergence
    from rlcore.refit.capture import file_transport_first
    from rlcore.refit.sessions import RefitSessions
    from rlcore.setup.planner import detect_accelerator
    from rlcore.setup.runner import refit_context
    from rlcore.tinymodel import ensure_model

    tokenizer = overlap.tokenizer(config.model, cache_dir(config))
    names = (config.policy.backend, config.generation.backend)
    decl = setup.plugins["policy"].declaration
    return diagnose_divergence(
        policy=setup.handles["policy"],
        policy_logprobs=GuardedPolicy(setup.handles["policy"], names[0]).logprobs,
        generation_logprobs=GuardedGeneration(
            setup.handles["generation"], names[1], eos_ids={tokenizer.eos_token_id}
        ).logprobs,
        make_context=lambda transport: refit_context(
            config, step=0, transport=transport, cancel=cancel, sessions=RefitSessions()
        ),
        transport=file_transport_first(decl.send_transports if decl else (), detect_accelerator()),
        model_dir=str(ensure_model(config.model, cache_dir(config))),
        probe=probe_batch(tokenizer, config.refit.probe_prompts),
        limit=config.refit.max_mult_prob_error or 1.05,
        names=names,
    )


def _train(
    config: RunConfig,
    setup: SetupResult,
    cancel: CancelToken,
    trace: TraceRecorder,
    writer: MetricsWriter,
    run_dir: Path,
    console: Console,
    phase: RunPhase,
    after_first_step: Callable[[], None] = lambda: None,
    step_done: Callable[[], None] = lambda: None,
) -> None:
    how = config.refit.check
    phase.now = "the first refit's check" if how == "probe" else "step 1"
    tokenizer = overlap.tokenizer(config.model, cache_dir(config))
    # Every call goes through the contract's checks, naming the backend that broke it.
    policy = GuardedPolicy(setup.handles["policy"], config.policy.backend)
    generation = GuardedGeneration(
        setup.handles["generation"], config.generation.backend, eos_ids={tokenizer.eos_token_id}
    )
    env = GuardedEnv(setup.handles["env"], str(config.env.backend))
    probe = probe_batch(tokenizer, config.refit.probe_prompts)
    limit = config.refit.max_mult_prob_error

    # The first refit (refit:initial) already ran during setup. With refit.check=sampled
    # step 1's samples check it (its line carries refit/checked_step 0); with probe, now.
    if how == "probe":
        err0 = token_mult_prob_error(
            *overlap.concurrently(lambda: generation.logprobs(probe), lambda: policy.logprobs(probe))
        )
        writer.write({
            "refit/token_mult_prob_error": err0, "refit/check": how, "refit/checked_step": 0,
            "refit/transport": setup.transport,
        }, step=0)
        check_divergence(
            err0, limit, step=0, policy=config.policy.backend, generation=config.generation.backend
        )
    else:
        writer.write({"refit/check": how, "refit/transport": setup.transport}, step=0)

    def refit(step: int) -> Any:
        return setup.refit(step, cancel)

    handoff = _handoff(config, setup)

    recovery = None
    if config.generation.on_worker_loss == "replace":
        recovery = GenerationRecovery(
            setup, generation, cancel,
            probe_error=lambda: token_mult_prob_error(generation.logprobs(probe), policy.logprobs(probe)),
            check=lambda err, step: check_divergence(
                err, limit, step=step, policy=config.policy.backend, generation=config.generation.backend
            ),
            record=lambda m, step: _record_loss(m, step, writer, console),
            handoff=handoff,
            init_time_s=setup.metrics.get("timing/setup/init:generation_time_s"),
        )

    def on_step(m: dict[str, Any]) -> None:
        last = m["step"] >= config.grpo.steps
        phase.now = "the last refit's check" if last and how == "sampled" else f"step {m['step'] + 1}"
        step_done()  # run.json (first step only): a rerun may no longer replace this run
        writer.write(m, step=m["step"])
        console.print(
            f"step {m['step']:>3}  reward {m['reward/mean']:.3f}  exact {m['reward/exact']:.2f}  "
            f"refit {m['refit/weight_sync_time_s'] * 1e3:.0f} ms  "
            f"mult_prob_err {m['refit/token_mult_prob_error']:.4f} (refit {m['refit/checked_step']})  "
            f"({m['timing/step_time_s']:.1f}s: generate {m['timing/generate_time_s']:.1f}, "
            f"train {m['timing/train_time_s']:.1f}, refit {m['timing/refit_time_s']:.2f}, "
            f"handoff {m['timing/handoff_time_s']:.2f}, check {m['timing/refit_check_share']:.1%})"
        )
        after_first_step()

    def on_check(m: dict[str, Any]) -> None:
        """A refit check no step line carries (refit.check=sampled): the last refit's probe,
        or a failed check (written before the DivergenceError)."""
        writer.write(m, step=m["step"])
        console.print(
            f"refit of step {m['refit/checked_step']} checked ({m['refit/check']}): "
            f"mult_prob_err {m['refit/token_mult_prob_error']:.4f}"
            f"  ({m['timing/refit_check_time_s']:.2f}s)"
        )

    phase.now = "step 1"
    history = run_grpo(
        cfg=config.grpo,
        tokenizer=tokenizer,
        policy=policy,
        generation=generation,
        env=env,
        refit=refit,
        probe=probe,
        on_step=on_step,
        max_mult_prob_error=limit,
        handoff=handoff,
        trace=lambda name, t0, t1, step: trace.add_span(name, t0, t1, cat="step", lane="grpo", args={"step": step}),
        cancelled=lambda: cancel.cancelled,
        on_generation_loss=recovery,
        refit_check=how,
        on_check=on_check,
    )
    if history:
        plot_reward(history, run_dir / "reward.png", title=f"{config.name}: reward per step")
        trend = reward_trend(history)
        if trend is not None:
            writer.write(trend, step=history[-1]["step"])
            console.print(trend_line(trend))


def _handoff(config: RunConfig, setup: SetupResult) -> Handoff | None:
    """Colocated: the device handed between the roles that declare ``memory_handoff``
    (unless ``placement.memory_handoff`` is false)."""
    if not (config.placement.colocated and config.placement.memory_handoff):
        return None
    sleeper = {
        role: setup.handles[role]
        for role in ("policy", "generation")
        if (d := setup.plugins[role].declaration) is not None and d.memory_handoff
    }
    return Handoff(sleeper.get("policy"), sleeper.get("generation"))


def _record_loss(m: dict[str, Any], step: int, writer: MetricsWriter, console: Console) -> None:
    """One metrics line per replaced generation, and one line on the console."""
    writer.write(m, step=step)
    console.print(
        f"[yellow]step {step:>3}  lost {m['generation/lost_worker']} ({m['generation/lost_cause']}) during "
        f"{m['generation/lost_during']}; replaced {m['generation/replaced']}, serving in "
        f"{m['generation/replace_time_s']:.1f}s "
        f"(init {m['generation/replace_init_time_s']:.1f}s, mult_prob_err "
        f"{m['generation/replace_mult_prob_error']:.4f})[/yellow]"
    )

"""Setup through pluggy: fake backends, faults injected only by a wrapper plugin.

The fake backends start a real child process each, so a leaked backend shows up
as a live child; every test checks that no thread or child process is left.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from rlcore.app.trace import TraceRecorder
from rlcore.config import GenerationConfig, RefitConfig, RoleConfig, RunConfig, SetupConfig
from rlcore.context import InitContext
from rlcore.declarations import Artifact, BackendDeclaration, Condition, Need
from rlcore.errors import (
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    PluginError,
    SetupError,
)
from rlcore.handles import Endpoint, RefitReport
from rlcore.hookspecs import hookimpl
from rlcore.setup.planner import role_view
from rlcore.setup.prepared import prepare
from rlcore.setup.registry import load_registry
from rlcore.setup.runner import SetupResult, run_prepared, run_setup

# -- fake backends ----------------------------------------------------------------


class Journal:
    """What the fakes did, in order, thread-safe."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()

    def add(self, what: str, role: str) -> None:
        with self._lock:
            self.entries.append((what, role, time.monotonic()))

    def roles(self, what: str) -> list[str]:
        with self._lock:
            return [r for w, r, _ in self.entries if w == what]

    def at(self, what: str, role: str) -> float:
        with self._lock:
            return next(t for w, r, t in self.entries if w == what and r == role)


class FakeHandle:
    def __init__(self, role: str, journal: Journal, proc: subprocess.Popen[bytes]) -> None:
        self.role = role
        self.journal = journal
        self.proc = proc
        self.shutdowns = 0
        self.endpoint: Endpoint | None = None
        self.got_endpoint: Any = None
        self.artifact: str | None = None

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.journal.add("shutdown", self.role)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


@dataclass
class FakeOptions:
    init_s: float = 0.0
    port: int = 8000


class FakeBackend:
    """One fake backend plugin: starts a child process, sleeps ``init_s`` (cancellable),
    then returns a handle. The env waits for the generation endpoint."""

    def __init__(self, decl: BackendDeclaration, journal: Journal) -> None:
        self.decl = decl
        self.journal = journal
        self.handles: list[FakeHandle] = []
        self.refits: list[Any] = []

    @hookimpl
    def rlcore_declare_backend(self) -> BackendDeclaration:
        return self.decl

    def _start(self, ctx: InitContext) -> FakeHandle:
        role = ctx.role.value
        self.journal.add("start", role)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            if ctx.cancel.sleep(ctx.options.init_s):
                ctx.cancel.raise_if_cancelled(ctx.task)
            handle = FakeHandle(role, self.journal, proc)
            if role == "generation":
                handle.endpoint = Endpoint(f"http://127.0.0.1:{ctx.options.port}/v1", "tiny")
            if role == "env":
                handle.got_endpoint = ctx.wait_event("generation.endpoint")
                self.journal.add("got_endpoint", role)
            view = role_view(ctx.config, ctx.role, self.decl)
            for need in self.decl.needed(ctx.role, view):
                if need.kind == "artifact":
                    path = ctx.wait_artifact(need.name, "k")
                    handle.artifact = (path / "weights.txt").read_text()
                    self.journal.add("got_artifact", role)
            for art in self.decl.produces:
                if not ctx.artifact_needed(art.name):
                    self.journal.add("skipped", role)
                    continue
                ctx.publish(art.name, "k", lambda d: (d / "weights.txt").write_text("w"))
                self.journal.add("published", role)
        except BaseException:
            proc.kill()  # a failing init releases what it started
            proc.wait(5)
            self.journal.add("released", role)
            raise
        self.handles.append(handle)
        self.journal.add("ready", role)
        return handle

    @hookimpl
    def rlcore_init_policy(self, ctx: InitContext) -> FakeHandle:
        return self._start(ctx)

    @hookimpl
    def rlcore_init_generation(self, ctx: InitContext) -> FakeHandle:
        return self._start(ctx)

    @hookimpl
    def rlcore_init_env(self, ctx: InitContext) -> FakeHandle:
        return self._start(ctx)

    @hookimpl
    def rlcore_refit(self, policy: Any, generation: Any, ctx: Any) -> RefitReport | None:
        if not isinstance(generation, FakeHandle) or "generation" not in self.decl.roles:
            return None
        self.refits.append(ctx)
        ctx.cancel.sleep(0.05)
        ctx.cancel.raise_if_cancelled("fake refit")
        self.journal.add("refit", "refit")
        return RefitReport(
            step=ctx.step, transport=ctx.transport, bytes=1024, tensors=2, weight_sync_time_s=0.05
        )


class Fault:
    """Wrapper plugin: raises in ``hook`` before or after the wrapped call."""

    def __init__(self, hook: str, when: str) -> None:
        self.hook = hook
        self.when = when

    def _wrap(self, hook: str) -> Generator[None, Any, Any]:
        if hook == self.hook and self.when == "before":
            raise Injected(f"injected before {hook}")
        result = yield
        if hook == self.hook and self.when == "after":
            raise Injected(f"injected after {hook}")
        return result

    @hookimpl(wrapper=True)
    def rlcore_init_policy(self, ctx: Any) -> Generator[None, Any, Any]:
        return (yield from self._wrap("rlcore_init_policy"))

    @hookimpl(wrapper=True)
    def rlcore_init_generation(self, ctx: Any) -> Generator[None, Any, Any]:
        return (yield from self._wrap("rlcore_init_generation"))

    @hookimpl(wrapper=True)
    def rlcore_init_env(self, ctx: Any) -> Generator[None, Any, Any]:
        return (yield from self._wrap("rlcore_init_env"))

    @hookimpl(wrapper=True)
    def rlcore_refit(self, policy: Any, generation: Any, ctx: Any) -> Generator[None, Any, Any]:
        return (yield from self._wrap("rlcore_refit"))


class Injected(RuntimeError):
    pass


TRANSPORTS = {"disk", "collective"}


def fakes(journal: Journal) -> dict[str, FakeBackend]:
    return {
        "fake-policy": FakeBackend(
            BackendDeclaration(
                "fake-policy", {"policy"}, send_transports=TRANSPORTS, options=FakeOptions
            ),
            journal,
        ),
        "fake-gen": FakeBackend(
            BackendDeclaration(
                "fake-gen",
                {"generation"},
                receive_transports=TRANSPORTS,
                refit_fed=True,
                openai_endpoint=True,
                options=FakeOptions,
            ),
            journal,
        ),
        "fake-env": FakeBackend(
            BackendDeclaration(
                "fake-env",
                {"env"},
                needs=(Need("generation.endpoint", kind="event", reason="scores through it"),),
                options=FakeOptions,
            ),
            journal,
        ),
    }


def make_config(
    tmp_path: Path,
    *,
    policy_s: float = 0.15,
    gen_s: float = 0.05,
    env_s: float = 0.0,
    refit_fed: bool = False,
    task_deadline_s: dict[str, float] | None = None,
    env: bool = True,
) -> RunConfig:
    return RunConfig(
        policy=RoleConfig(backend="fake-policy", options={"init_s": policy_s}),
        generation=GenerationConfig(
            backend="fake-gen", options={"init_s": gen_s, "port": 8123}, refit_fed=refit_fed
        ),
        env=RoleConfig(backend="fake-env" if env else None, options={"init_s": env_s}),
        setup=SetupConfig(
            deadline_s=30.0,
            task_deadline_s=dict(task_deadline_s or {}),
            shutdown_timeout_s=5.0,
            cache_dir=str(tmp_path / "cache"),
        ),
        refit=RefitConfig(bucket_mb=1.0, timeout_s=10.0),
    )


def registry_with(journal: Journal, *wrappers: object) -> tuple[Any, dict[str, FakeBackend]]:
    backends = fakes(journal)
    extra: list[tuple[str, object]] = list(backends.items())
    extra += [(f"wrapper-{i}", w) for i, w in enumerate(wrappers)]
    registry = load_registry(entry_points=False, extra=extra)
    assert not registry.failures, registry.failures
    return registry, backends


def all_handles(backends: dict[str, FakeBackend]) -> list[FakeHandle]:
    return [h for b in backends.values() for h in b.handles]


# -- success ----------------------------------------------------------------------


def test_setup_starts_everything_posts_the_endpoint_and_shuts_down_in_reverse(
    tmp_path: Path, leaks
) -> None:
    journal = Journal()
    registry, backends = registry_with(journal)
    events: list[tuple[str, str]] = []
    result = run_setup(
        make_config(tmp_path),
        registry,
        run_dir=tmp_path / "run",
        progress=lambda task, what: events.append((task, what)),
    )
    assert isinstance(result, SetupResult)
    assert set(result.handles) == {"policy", "generation", "env"}
    gen, env = result.handles["generation"], result.handles["env"]
    assert env.got_endpoint == gen.endpoint == Endpoint("http://127.0.0.1:8123/v1", "tiny")
    # All three inits may start together (no edges between them; the spread of their
    # starts is a timing claim: test_setup_timing_claims, perf).
    assert not any(e.dst.startswith("init:") for e in result.plan.edges)
    assert set(journal.roles("start")) == {"policy", "generation", "env"}
    # refit:initial ran with the plan's transport and the configured bucket size.
    ctx = backends["fake-gen"].refits[0]
    assert ctx.step == 0 and ctx.transport == result.transport == "collective"
    assert ctx.bucket_bytes == 2**20 and ctx.timeout_s == 10.0
    assert result.refit_report.bytes == 1024
    m = result.metrics
    for task in ("init:policy", "init:generation", "init:env", "refit:initial"):
        assert m[f"timing/setup/{task}_time_s"] > 0
    assert m["timing/setup/weight_sync_time_s"] == pytest.approx(0.05)
    assert 0 < m["timing/setup/critical_path_s"] <= m["timing/setup/total_setup_time_s"]
    trace = TraceRecorder.from_execution(result.execution, result.plan).events
    assert len([e for e in trace if e.get("cat") == "setup.task"]) == 4
    assert ("refit:initial", "end") in events and ("init:env", "start") in events
    assert (tmp_path / "run").is_dir()

    ready = journal.roles("ready")
    result.shutdown()
    result.shutdown()  # idempotent
    assert journal.roles("shutdown") == list(reversed(ready))
    assert all(h.shutdowns == 1 for h in all_handles(backends))
    leaks.assert_clean()


def test_refit_fed_generation_posts_the_endpoint_only_after_refit(tmp_path: Path, leaks) -> None:
    journal = Journal()
    registry, _ = registry_with(journal)
    with run_setup(
        make_config(tmp_path, refit_fed=True), registry, run_dir=tmp_path / "run"
    ) as result:
        assert result.plan.posts == {"refit:initial": ("generation.endpoint",)}
        refit_end = result.execution.records["refit:initial"].end
        got = journal.at("got_endpoint", "env")
        assert journal.at("refit", "refit") < got
        assert result.execution.records["init:env"].end >= refit_end
        assert result.handles["env"].got_endpoint == result.handles["generation"].endpoint
    assert sorted(journal.roles("shutdown")) == ["env", "generation", "policy"]


def test_atomic_artifact_is_published_through_the_hook_and_awaited(tmp_path: Path, leaks) -> None:
    journal = Journal()
    backends = fakes(journal)
    pol, gen = backends["fake-policy"], backends["fake-gen"]
    pol.decl = replace(pol.decl, produces=(Artifact("fake.ckpt", atomic=True),))
    gen.decl = replace(gen.decl, needs=(Need("fake.ckpt"),))
    registry = load_registry(entry_points=False, extra=list(backends.items()))
    with run_setup(make_config(tmp_path, env=False), registry, run_dir=tmp_path) as result:
        assert [(w.task, w.target) for w in result.plan.waits] == [("init:generation", "fake.ckpt")]
        assert result.handles["generation"].artifact == "w"
        assert journal.at("start", "generation") < journal.at("published", "policy")
        assert journal.at("published", "policy") < journal.at("got_artifact", "generation")
        assert (tmp_path / "cache" / "fake.ckpt" / "k" / "weights.txt").read_text() == "w"


def test_an_artifact_no_reader_needs_is_not_produced(tmp_path: Path, leaks) -> None:
    """The generation needs the checkpoint only when it is not refit-fed: in a refit-fed
    run the core tells the policy's init that nobody needs it."""
    journal = Journal()
    backends = fakes(journal)
    pol, gen = backends["fake-policy"], backends["fake-gen"]
    pol.decl = replace(pol.decl, produces=(Artifact("fake.ckpt", atomic=True),))
    gen.decl = replace(gen.decl, needs=(Need("fake.ckpt", when=(Condition("refit_fed", False),)),))
    registry = load_registry(entry_points=False, extra=list(backends.items()))
    config = make_config(tmp_path, env=False, refit_fed=True)
    with run_setup(config, registry, run_dir=tmp_path) as result:
        assert result.plan.consumed == {}
        assert journal.roles("skipped") == ["policy"] and journal.roles("published") == []
    assert not (tmp_path / "cache" / "fake.ckpt").exists()


def test_setup_without_env(tmp_path: Path, leaks) -> None:
    journal = Journal()
    registry, _ = registry_with(journal)
    with run_setup(make_config(tmp_path, env=False), registry, run_dir=tmp_path) as result:
        assert set(result.handles) == {"policy", "generation"}
        assert "init:env" not in result.plan.names


# -- failures injected by a wrapper plugin -------------------------------------------

TASK_HOOKS = {
    "init:policy": ("rlcore_init_policy", "policy", "fake-policy"),
    "init:generation": ("rlcore_init_generation", "generation", "fake-gen"),
    "init:env": ("rlcore_init_env", "env", "fake-env"),
    "refit:initial": ("rlcore_refit", "refit", "fake-policy -> fake-gen"),
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("task", list(TASK_HOOKS))
def test_fault_in_any_task_fails_cleanly(tmp_path: Path, leaks, task: str, when: str) -> None:
    hook, role, backend = TASK_HOOKS[task]
    journal = Journal()
    registry, backends = registry_with(journal, Fault(hook, when))
    with pytest.raises(SetupError) as info:
        run_setup(make_config(tmp_path), registry, run_dir=tmp_path / "run", grace_s=2.0)
    err = info.value
    assert err.task == task and err.role == role and err.backend == backend
    assert isinstance(err.cause, Injected) and f"injected {when} {hook}" in str(err)
    assert f"setup failed in task '{task}'" in str(err)
    assert task not in err.aborted
    assert err.shutdown_errors == []
    # Every backend whose init returned was shut down exactly once, last ready first...
    ready = journal.roles("ready")
    assert journal.roles("shutdown") == list(reversed(ready))
    assert all(h.shutdowns == 1 for h in all_handles(backends))
    # ...including the one whose handle an outer wrapper lost by failing after its init.
    if when == "after" and role != "refit":
        assert role in journal.roles("shutdown")
    # Every init that had not finished was cancelled and released what it started.
    # (refit:initial, cancelled when it was running, started no backend of its own.)
    for name, rec in err.execution.records.items():
        if rec.status == "cancelled":
            assert _describe(name, rec.label) in err.aborted
            if name.startswith("init:"):
                assert name.split(":")[1] in journal.roles("released")
    leaks.assert_clean()


def _describe(name: str, label: Any) -> str:
    return f"{name} ({label['backend']})" if label.get("backend") else name


def test_refit_fails_while_env_waits_for_the_endpoint(tmp_path: Path, leaks) -> None:
    journal = Journal()
    registry, backends = registry_with(journal, Fault("rlcore_refit", "before"))
    with pytest.raises(SetupError) as info:
        run_setup(
            make_config(tmp_path, refit_fed=True), registry, run_dir=tmp_path / "run", grace_s=5.0
        )
    err = info.value
    assert err.task == "refit:initial" and err.role == "refit"
    recs = err.execution.records
    env = recs["init:env"]
    assert env.status == "cancelled" and not env.abandoned
    assert isinstance(env.error, Cancelled) and "generation.endpoint" in str(env.error)
    assert env.end >= recs["refit:initial"].end  # woken by the failure (latency: perf)
    assert err.aborted == ["init:env (fake-env)"]
    assert sorted(journal.roles("shutdown")) == ["generation", "policy"]
    assert journal.roles("released") == ["env"]
    assert all(h.shutdowns == 1 for h in all_handles(backends))
    leaks.assert_clean()


def test_task_deadline_names_the_task(tmp_path: Path, leaks) -> None:
    journal = Journal()
    registry, _ = registry_with(journal)
    config = make_config(tmp_path, policy_s=10.0, task_deadline_s={"init:policy": 0.3})
    with pytest.raises(SetupError) as info:
        run_setup(config, registry, run_dir=tmp_path / "run")
    err = info.value
    assert err.task == "init:policy" and err.backend == "fake-policy" and err.role == "policy"
    assert isinstance(err.cause, DeadlineExceeded)
    assert "init:policy" in str(err.cause) and "0.3s" in str(err.cause)
    assert err.execution.records["init:policy"].status == "timed_out"
    assert "refit:initial (fake-policy -> fake-gen)" in err.aborted
    assert sorted(journal.roles("shutdown")) == ["env", "generation"]
    leaks.assert_clean()


def test_env_that_never_gets_its_endpoint_times_out_in_its_wait(tmp_path: Path, leaks) -> None:
    # Generation is slow; env's own deadline passes inside ctx.wait_event.
    journal = Journal()
    registry, _ = registry_with(journal)
    config = make_config(tmp_path, gen_s=10.0, task_deadline_s={"init:env": 0.2})
    with pytest.raises(SetupError) as info:
        run_setup(config, registry, run_dir=tmp_path / "run")
    err = info.value
    assert err.task == "init:env"
    assert isinstance(err.cause, DeadlineExceeded) and "generation.endpoint" in str(err.cause)
    leaks.assert_clean()


def test_external_cancel_stops_setup(tmp_path: Path, leaks) -> None:
    from rlcore.errors import CancelToken

    journal = Journal()
    registry, _ = registry_with(journal)
    cancel = CancelToken()
    threading.Timer(0.1, cancel.cancel, args=("interrupted by the user",)).start()
    with pytest.raises(SetupError) as info:
        run_setup(
            make_config(tmp_path, policy_s=10.0), registry, run_dir=tmp_path / "r", cancel=cancel
        )
    assert "interrupted by the user" in str(info.value)
    leaks.assert_clean()


# -- errors before anything starts ---------------------------------------------------


class NoInit:
    """A backend that declares env but implements no rlcore_init_env."""

    @hookimpl
    def rlcore_declare_backend(self) -> BackendDeclaration:
        return BackendDeclaration("no-init", {"env"})


def test_backend_without_init_hook_is_named(tmp_path: Path, leaks) -> None:
    journal = Journal()
    backends = fakes(journal)
    registry = load_registry(entry_points=False, extra=[*backends.items(), ("no-init", NoInit())])
    config = make_config(tmp_path)
    config.env.backend = "no-init"
    config.env.options = {}
    with pytest.raises(SetupError) as info:
        run_setup(config, registry, run_dir=tmp_path)
    err = info.value
    assert err.task == "init:env" and err.backend == "no-init"
    assert isinstance(err.cause, PluginError)
    assert "implements no rlcore_init_env" in str(err.cause)
    leaks.assert_clean()


def test_bad_backend_option_is_a_config_error(tmp_path: Path) -> None:
    journal = Journal()
    registry, _ = registry_with(journal)
    config = make_config(tmp_path)
    config.policy.options = {"inti_s": 1.0}
    with pytest.raises(ConfigError, match="policy.options.init_s"):
        run_setup(config, registry, run_dir=tmp_path)
    assert journal.entries == []


def test_deadline_for_unknown_task_is_a_config_error(tmp_path: Path) -> None:
    journal = Journal()
    registry, _ = registry_with(journal)
    config = make_config(tmp_path, task_deadline_s={"init:polcy": 1.0})
    with pytest.raises(ConfigError, match="init:polcy"):
        run_setup(config, registry, run_dir=tmp_path)
    assert journal.entries == []


def test_the_runner_runs_the_prepared_run_and_prepares_nothing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leaks
) -> None:
    """Backends are selected, options resolved, the plan built and the deadlines validated
    once, by ``prepare``; the runner takes only the prepared run and calls none of them."""
    import rlcore.setup.planner as planner_module
    import rlcore.setup.prepared as prepared_module
    import rlcore.setup.runner as runner_module

    journal = Journal()
    registry, _ = registry_with(journal)
    prepared = prepare(make_config(tmp_path, task_deadline_s={"init:env": 7.0}), registry)

    def again(*_: Any, **__: Any) -> Any:
        raise AssertionError("the run was prepared a second time")

    monkeypatch.setattr(registry, "backend_for", again)
    for module in (prepared_module, planner_module, runner_module):
        # (The fake backends resolve their own options in their init: planner.role_view.)
        for name in ("prepare", "selected_backends", "resolve_options", "task_deadlines", "build_plan",
                     "choose_transport", "check_dtype"):
            if hasattr(module, name) and not (module is planner_module and name == "resolve_options"):
                monkeypatch.setattr(module, name, again)
    with run_prepared(prepared, run_dir=tmp_path / "run") as result:
        assert result.plan is prepared.plan and result.transport == prepared.transport
        assert set(result.handles) == {"policy", "generation", "env"}
    assert prepared.deadlines["init:env"] == 7.0 and prepared.deadlines["init:policy"] == 30.0
    assert list(inspect.signature(run_prepared).parameters)[0] == "prepared"
    assert not {"config", "registry", "plan"} & set(inspect.signature(run_prepared).parameters)


def test_setup_leaves_no_capture_plugin_behind(tmp_path: Path, leaks) -> None:
    journal = Journal()
    registry, _ = registry_with(journal)
    before = set(registry.pm.list_name_plugin())
    run_setup(make_config(tmp_path, policy_s=0.0), registry, run_dir=tmp_path).shutdown()
    with pytest.raises(SetupError):
        run_setup(
            make_config(tmp_path, task_deadline_s={"init:policy": 0.01}, policy_s=1.0),
            registry,
            run_dir=tmp_path,
        )
    assert set(registry.pm.list_name_plugin()) == before


# -- timing claims (perf: not in the default suite; `pytest -m perf`) ------------------


@pytest.mark.perf
def test_setup_timing_claims(tmp_path: Path) -> None:
    """Overlap pays, the executor adds little, a failure wakes a waiter at once."""
    journal = Journal()
    registry, _ = registry_with(journal)
    result = run_setup(make_config(tmp_path), registry, run_dir=tmp_path / "run")
    try:
        starts = [journal.at("start", r) for r in ("policy", "generation", "env")]
        assert max(starts) - min(starts) < 0.1
        m = result.metrics
        assert m["timing/setup/total_setup_time_s"] < m["timing/setup/serial_sum_s"]
        assert m["timing/setup/executor_overhead_s"] < 0.05
    finally:
        result.shutdown()
    registry, _ = registry_with(Journal(), Fault("rlcore_refit", "before"))
    t0 = time.monotonic()
    with pytest.raises(SetupError) as info:
        run_setup(make_config(tmp_path, refit_fed=True), registry, run_dir=tmp_path / "r2", grace_s=5.0)
    assert time.monotonic() - t0 < 2.0
    recs = info.value.execution.records
    assert recs["init:env"].end - recs["refit:initial"].end < 0.1  # woken at once, not polled


@pytest.mark.perf
@pytest.mark.parametrize("task", list(TASK_HOOKS))
def test_a_fault_ends_setup_within_3s(tmp_path: Path, task: str) -> None:
    registry, _ = registry_with(Journal(), Fault(TASK_HOOKS[task][0], "before"))
    t0 = time.monotonic()
    with pytest.raises(SetupError):
        run_setup(make_config(tmp_path), registry, run_dir=tmp_path / "run", grace_s=2.0)
    assert time.monotonic() - t0 < 3.0


@pytest.mark.perf
def test_a_task_deadline_ends_setup_within_2s(tmp_path: Path) -> None:
    registry, _ = registry_with(Journal())
    config = make_config(tmp_path, policy_s=10.0, task_deadline_s={"init:policy": 0.3})
    t0 = time.monotonic()
    with pytest.raises(SetupError):
        run_setup(config, registry, run_dir=tmp_path / "run")
    assert time.monotonic() - t0 < 2.0


def test_a_role_prepared_alone_starts_only_its_backend_with_a_runs_context_and_no_refit(tmp_path: Path) -> None:
    """``prepare_role`` (``rlcore export``): the policy alone, though the generation backend
    the config names is not installed; its handle is shut down with the setup."""
    from rlcore.declarations import Role
    from rlcore.setup.prepared import prepare_role

    journal = Journal()
    policy = fakes(journal)["fake-policy"]
    registry = load_registry(entry_points=False, extra=[("fake-policy", policy)])
    config = replace(make_config(tmp_path, policy_s=0.0, task_deadline_s={"init:policy": 7.0}),
                     generation=GenerationConfig(backend="not-installed"))
    prepared = prepare_role(config, registry, Role.POLICY)
    assert prepared.plan.names == ["init:policy"] and prepared.deadlines == {"init:policy": 7.0}
    assert prepared.options[Role.POLICY] == FakeOptions(init_s=0.0)
    with run_prepared(prepared, run_dir=tmp_path / "run") as setup:
        assert list(setup.handles) == ["policy"] and setup.refit_report is None
        assert journal.roles("ready") == ["policy"] and policy.refits == []
    assert journal.roles("shutdown") == ["policy"]

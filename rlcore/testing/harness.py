"""The machinery under the conformance suite: start a backend the way the core does.

Nothing here imports pytest: :class:`Harness` can drive a backend from a script
or a notebook too. :mod:`rlcore.testing.suite` turns it into test classes.

A :class:`Harness` owns one registry (the plugin under test, an optional peer
plugin and a spy wrapper on ``rlcore_publish``), one run config, one
cancellation token and one event board, exactly as :func:`rlcore.setup.runner.run_setup`
would build them, and tracks every handle it started so that a failing test
still shuts everything down.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcore.config import RunConfig, load_config, resolve_options
from rlcore.context import InitContext
from rlcore.declarations import BackendDeclaration, Role
from rlcore.errors import CancelToken, Deadline
from rlcore.hookspecs import hookimpl
from rlcore.setup.events import EventBoard
from rlcore.setup.planner import role_view
from rlcore.setup.registry import PluginInfo, Registry, load_registry

log = logging.getLogger(__name__)

#: Modules a plugin must not import at module level or in ``rlcore_declare_backend``.
HEAVY_MODULES: tuple[str, ...] = ("torch", "ray", "vllm", "megatron", "transformers", "sglang")
#: Config value of ``<role>.backend`` for a role that no plugin of the test serves
#: (``validate_run_config`` wants policy and generation set; nothing starts them).
UNUSED_BACKEND = "conformance-unused"
#: Registration name of the spy wrapper plugin.
SPY_NAME = "rlcore.testing.publish-spy"


class NotApplicable(Exception):  # noqa: N818 - a signal, not an error: the suite turns it into a skip
    """The backend does not claim what a check needs; the check does not apply."""


class ConformanceFailure(AssertionError):
    """A backend broke a claim of its declaration or a rule of the hook contract."""


# -- plugins ----------------------------------------------------------------------


@dataclass(frozen=True)
class PluginRef:
    """A plugin as the suite found it.

    Attributes:
        obj: the module or object to register.
        module: the importable module that defines it (for the import check in a
            fresh interpreter), or ``None`` if it cannot be imported by name.
        attr: the attribute of ``module`` that holds it (``None``: the module itself).
    """

    obj: object
    module: str | None
    attr: str | None = None

    def describe(self) -> str:
        if self.module is None:
            return repr(self.obj)
        return self.module + (f":{self.attr}" if self.attr else "")


def resolve_plugin(ref: object) -> PluginRef:
    """Turn ``"pkg.module"``, ``"pkg.module:attr"``, a module or an object into a :class:`PluginRef`."""
    if isinstance(ref, str):
        mod_name, _, attr = ref.partition(":")
        module = importlib.import_module(mod_name)
        if not attr:
            return PluginRef(module, mod_name)
        return PluginRef(getattr(module, attr), mod_name, attr)
    if isinstance(ref, types.ModuleType):
        return PluginRef(ref, ref.__name__)
    mod_name = getattr(type(ref), "__module__", None)
    module = sys.modules.get(mod_name or "")
    if module is not None and mod_name != "__main__":
        for name, value in vars(module).items():
            if value is ref:
                return PluginRef(ref, mod_name, name)
    return PluginRef(ref, None)


def declare(plugin: object) -> object:
    """Call a plugin's own ``rlcore_declare_backend`` directly (``None`` if it has none)."""
    fn = getattr(plugin, "rlcore_declare_backend", None)
    return None if fn is None else fn()


def registration_name(ref: PluginRef, explicit: str | None) -> str:
    """The name a plugin is registered under: ``explicit``, else its declared backend name."""
    if explicit:
        return explicit
    try:
        name = getattr(declare(ref.obj), "name", None)
    except Exception:  # noqa: BLE001 - the registration test reports it properly
        name = None
    return str(name) if name else ref.describe()


# -- import lightness (fresh interpreter) -----------------------------------------

_LIGHTNESS_SCRIPT = r"""
import importlib, json, sys, threading, time
mod_name, attr, reg_name = sys.argv[1], sys.argv[2] or None, sys.argv[3]
import rlcore.setup.registry
from rlcore.setup.registry import load_registry
before = set(sys.modules)
threads_before = threading.active_count()
t0 = time.monotonic()
module = importlib.import_module(mod_name)
import_s = time.monotonic() - t0
plugin = getattr(module, attr) if attr else module
after_import = set(sys.modules)
t0 = time.monotonic()
registry = load_registry(entry_points=False, extra=[(reg_name, plugin)])
declare_s = time.monotonic() - t0
children = 0
try:
    import psutil
    children = len(psutil.Process().children(recursive=True))
except ImportError:
    pass
json.dump({
    "import_modules": sorted(after_import - before),
    "declare_modules": sorted(set(sys.modules) - after_import),
    "import_s": import_s,
    "declare_s": declare_s,
    "new_threads": threading.active_count() - threads_before,
    "children": children,
    "failures": [f.message for f in registry.failures],
}, sys.stdout)
"""


def import_footprint(ref: PluginRef, reg_name: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Import the plugin and register it in a fresh interpreter; report what that cost.

    Returns ``import_modules`` / ``declare_modules`` (modules newly imported by the
    plugin's import and by its registration, which calls ``rlcore_declare_backend``),
    their times, threads and child processes left running, and registry failures.
    """
    if ref.module is None:
        raise NotApplicable(
            f"plugin {ref.describe()} is not importable by name; give `plugin` as "
            "'package.module' or 'package.module:attr' to check its import"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.pop("RLCORE_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-c", _LIGHTNESS_SCRIPT, ref.module, ref.attr or "", reg_name],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise ConformanceFailure(
            f"importing plugin {ref.describe()} in a fresh interpreter failed "
            f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return dict(json.loads(proc.stdout))


def heavy(modules: Iterable[str], heavy_roots: Sequence[str] = HEAVY_MODULES) -> list[str]:
    """The top-level heavy packages among ``modules``."""
    roots = set(heavy_roots)
    return sorted({m.split(".")[0] for m in modules if m.split(".")[0] in roots})


# -- leaks ------------------------------------------------------------------------


class LeakCheck:
    """Child processes, threads and Ray actors alive at creation, to compare against later.

    ``ignore_processes`` are prefixes of process names or command lines that are
    not the backend's (Ray's pooled ``ray::IDLE`` workers come and go by themselves).
    Ray actors are read from Ray's own actor table (the GCS), not the process table: Ray
    runs an actor in a worker process it started before (a prestarted idle worker), so
    an actor left alive need not be a new process.
    """

    def __init__(
        self,
        *,
        ignore_threads: Sequence[str] = (),
        ignore_processes: Sequence[str] = ("ray::IDLE",),
    ) -> None:
        import psutil

        self._proc = psutil.Process()
        self._ignore_threads = tuple(ignore_threads)
        self._ignore_processes = tuple(ignore_processes)
        self.threads = {t.ident for t in threading.enumerate()}
        self.children = {p.pid: self._create_time(p) for p in self._proc.children(recursive=True)}
        self.actors = set(_alive_actors())

    @staticmethod
    def _create_time(p: Any) -> float | None:
        try:
            return float(p.create_time())
        except Exception:  # noqa: BLE001 - a process that vanished has no start time
            return None

    def new_threads(self) -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t.ident not in self.threads
            and t.is_alive()
            and not t.name.startswith(self._ignore_threads)
        ]

    def new_children(self) -> list[str]:
        import psutil

        out = []
        for p in self._proc.children(recursive=True):
            try:
                if p.pid in self.children and self.children[p.pid] == self._create_time(p):
                    continue
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                name = p.name()
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if self._ignore_processes and (
                name.startswith(self._ignore_processes) or cmd.startswith(self._ignore_processes)
            ):
                continue
            out.append(f"pid {p.pid} ({cmd.strip()[:120] or name})")
        return out

    def new_actors(self) -> list[str]:
        """Ray actors of this driver's job alive now that were not at creation."""
        return [line for actor_id, line in _alive_actors().items() if actor_id not in self.actors]

    def problems(self, settle_s: float = 5.0) -> list[str]:
        """What is still alive that was not at creation, after waiting up to ``settle_s``."""
        end = time.monotonic() + settle_s
        while True:
            threads, children, actors = self.new_threads(), self.new_children(), self.new_actors()
            if (not threads and not children and not actors) or time.monotonic() >= end:
                break
            time.sleep(0.05)
        out = [f"thread {t.name!r} (daemon={t.daemon})" for t in threads]
        out += [f"child process {c}" for c in children]
        out += [f"Ray actor {a}" for a in actors]
        return out


def _alive_actors() -> dict[str, str]:
    """Actor id -> ``ClassName (actor id, pid N)`` of every ALIVE (or starting) actor of this
    driver's Ray job, from Ray's actor table; empty when Ray is not initialised here."""
    ray = sys.modules.get("ray")  # never import Ray for a check that has no cluster
    if ray is None or not ray.is_initialized():
        return {}
    try:
        from ray._private import state  # the GCS actor table: no dashboard needed

        job = ray.get_runtime_context().get_job_id()
        table = state.actors()
    except Exception as err:  # noqa: BLE001 - a check that cannot read the table says so
        log.warning("leak check: Ray's actor table could not be read (%s)", err)
        return {}
    out = {}
    for actor_id, info in table.items():
        if info.get("State") in ("DEAD",) or str(info.get("JobID")) != str(job):
            continue
        out[actor_id] = f"{info.get('ActorClassName', '?')} ({actor_id[:12]}, pid {info.get('Pid')}, {info.get('State')})"
    return out


# -- running things with a bound ---------------------------------------------------


@dataclass
class Outcome:
    """What a bounded call did: returned ``value``, raised ``error``, or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0


def call_bounded(
    fn: Callable[[], Any], timeout_s: float, name: str = "conformance-call"
) -> Outcome:
    """Run ``fn`` in a daemon thread; wait at most ``timeout_s``.

    A call that does not return in time is abandoned (its thread is a daemon),
    never waited on forever.
    """
    out = Outcome()
    t0 = time.monotonic()

    def run() -> None:
        try:
            out.value = fn()
        except BaseException as err:  # noqa: BLE001 - reported to the caller
            out.error = err

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    out.seconds = time.monotonic() - t0
    out.timed_out = thread.is_alive()
    return out


# -- the publish spy -----------------------------------------------------------------


class PublishSpy:
    """A wrapper plugin that records every destination published through ``rlcore_publish``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.published: list[Path] = []

    @hookimpl(wrapper=True)
    def rlcore_publish(self, destination: Path) -> Any:
        result = yield
        with self._lock:
            self.published.append(Path(result if result is not None else destination))
        return result

    def under(self, directory: Path) -> list[Path]:
        with self._lock:
            return [p for p in self.published if Path(p).parent == Path(directory)]


# -- the harness ------------------------------------------------------------------------


@dataclass
class Started:
    role: Role
    handle: Any
    provider: bool = False


@dataclass
class Harness:
    """Starts roles of the plugin under test (and its peer) like ``rlcore.setup.runner`` does.

    Attributes:
        plugin: the plugin under test.
        peer: an optional plugin serving the refit side the plugin under test lacks.
        work_dir: this test's directory (run directory lives here).
        cache_dir: the artifact cache (shared by the tests of one class).
        overrides: config overrides (``key=value``) applied after the harness's own.
        events: core event values posted before an init that waits for them.
        init_timeout_s: bound on one init; ``shutdown_timeout_s``: on one shutdown.
        provide_artifact: called as ``provide_artifact(name, ctx)`` for an artifact a
            role needs that no started backend produces; raises NotApplicable if it can't.
    """

    plugin: PluginRef
    peer: PluginRef | None
    work_dir: Path
    cache_dir: Path
    plugin_name: str | None = None
    peer_name: str | None = None
    overrides: Sequence[str] = ()
    events: Mapping[str, Any] = field(default_factory=dict)
    init_timeout_s: float = 120.0
    shutdown_timeout_s: float = 60.0
    provide_artifact: Callable[[str, InitContext], None] | None = None

    def __post_init__(self) -> None:
        self.name = registration_name(self.plugin, self.plugin_name)
        extra: list[tuple[str, object]] = [(self.name, self.plugin.obj)]
        if self.peer is not None:
            self.peer_reg_name = registration_name(self.peer, self.peer_name)
            extra.append((self.peer_reg_name, self.peer.obj))
        self.spy = PublishSpy()
        extra.append((SPY_NAME, self.spy))
        self.registry: Registry = load_registry(entry_points=False, extra=extra)
        self.cancel = CancelToken()
        self.board = EventBoard(self.cancel)
        self.started: list[Started] = []
        self._lock = threading.Lock()
        from rlcore.refit.sessions import RefitSessions

        #: The refit channels of this harness's run (as a run owns them).
        self.refit_sessions = RefitSessions()

    # -- who serves what --------------------------------------------------------------

    @property
    def info(self) -> PluginInfo:
        """The plugin under test as registered; raises ConformanceFailure if it failed."""
        for info in self.registry.backends.values():
            if info.plugin is self.plugin.obj:
                return info
        msgs = "; ".join(f.message for f in self.registry.failures) or "no declaration"
        raise ConformanceFailure(f"plugin {self.plugin.describe()} did not register: {msgs}")

    @property
    def declaration(self) -> BackendDeclaration:
        decl = self.info.declaration
        assert decl is not None
        return decl

    def peer_info(self) -> PluginInfo | None:
        if self.peer is None:
            return None
        for info in self.registry.backends.values():
            if info.plugin is self.peer.obj:
                return info
        msgs = "; ".join(f.message for f in self.registry.failures)
        raise ConformanceFailure(f"peer plugin {self.peer.describe()} did not register: {msgs}")

    def serving(self, role: Role) -> PluginInfo | None:
        """The plugin that serves ``role`` in this test: the one under test first, then the peer."""
        if role in self.declaration.roles:
            return self.info
        peer = self.peer_info()
        if peer is not None and peer.declaration is not None and role in peer.declaration.roles:
            return peer
        return None

    def decl_for(self, role: Role) -> BackendDeclaration:
        info = self.serving(role)
        if info is None or info.declaration is None:
            raise NotApplicable(f"no plugin of this test serves role '{role}'")
        return info.declaration

    def own_impl(self, info: PluginInfo, hook_name: str) -> bool:
        """Whether ``info``'s plugin has a plain (non-wrapper) implementation of ``hook_name``."""
        caller = getattr(self.registry.pm.hook, hook_name)
        return any(
            i.plugin is info.plugin and not (i.wrapper or i.hookwrapper)
            for i in caller.get_hookimpls()
        )

    # -- config and context -----------------------------------------------------------

    def config(self, *extra: str) -> RunConfig:
        """The run config: each role set to the plugin that serves it, cache and output in tmp."""
        own: list[str] = []
        for role in Role:
            info = self.serving(role)
            if info is not None and info.declaration is not None:
                own.append(f"{role.value}.backend={info.declaration.name}")
            elif role is not Role.ENV:
                own.append(f"{role.value}.backend={UNUSED_BACKEND}")
        own += [
            f"setup.cache_dir={self.cache_dir}",
            f"output_dir={self.work_dir / 'runs'}",
            f"setup.deadline_s={self.init_timeout_s}",
            f"setup.shutdown_timeout_s={self.shutdown_timeout_s}",
        ]
        return load_config(None, [*own, *self.overrides, *extra])

    def context(
        self,
        role: Role,
        config: RunConfig,
        *,
        cancel: CancelToken | None = None,
        deadline: Deadline | None = None,
        board: EventBoard | None = None,
        adapters: Any = None,
    ) -> InitContext:
        """An InitContext built as ``rlcore.setup.runner.run_setup`` builds it (``adapters``:
        its :attr:`~rlcore.context.InitContext.adapters`)."""
        info = self.serving(role)
        if info is None or info.declaration is None:
            raise NotApplicable(f"no plugin of this test serves role '{role}'")
        decl = info.declaration
        section = getattr(config, role.value)
        cancel = cancel or self.cancel
        run_dir = self.work_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        return InitContext(
            role=role,
            backend=decl.name,
            config=config,
            options=resolve_options(
                section.options, decl.options, section=role.value, backend=decl.name
            ),
            cancel=cancel,
            deadline=deadline or Deadline(self.init_timeout_s, f"init:{role.value} (conformance)"),
            run_dir=run_dir,
            cache_dir=Path(self.cache_dir),
            events=board or (self.board if cancel is self.cancel else EventBoard(cancel)),
            publish_hook=self.registry.hook("rlcore_publish", [info]),
            log=logging.getLogger(f"rlcore.backend.{decl.name}"),
            adapters=adapters,
        )

    # -- needs --------------------------------------------------------------------------

    def producers(self, artifact: str, config: RunConfig) -> list[Role]:
        """Roles of this test whose backend produces ``artifact`` under ``config``."""
        out = []
        for role in Role:
            info = self.serving(role)
            if info is None or info.declaration is None:
                continue
            decl = info.declaration
            view = role_view(config, role, decl)
            if any(a.name == artifact for a in decl.produced(role, view)):
                out.append(role)
        return out

    def satisfy_needs(
        self, role: Role, config: RunConfig, *, board: EventBoard, starting: Iterable[Role] = ()
    ) -> None:
        """Make what ``role`` waits for available: post events, start producing roles.

        A needed artifact that a role in ``starting`` publishes atomically is left to
        it (the consumer waits inside its init, as in a real setup); one produced by
        another role of the test is made by starting that role first, as a provider;
        anything else goes to ``provide_artifact``. Raises NotApplicable if it cannot.
        """
        decl = self.decl_for(role)
        view = role_view(config, role, decl)
        starting = set(starting)
        running = {s.role for s in self.started}
        for need in decl.needed(role, view):
            if need.kind == "event":
                if board.posted(need.name):
                    continue
                if need.name not in self.events:
                    raise NotApplicable(
                        f"init:{role.value} waits for event '{need.name}'; give its value in "
                        "conformance_events()"
                    )
                board.post(need.name, self.events[need.name])
                continue
            producers = [r for r in self.producers(need.name, config) if r is not role]
            if any(r in running for r in producers):
                continue
            atomic_in_batch = [
                r
                for r in producers
                if r in starting
                and any(
                    a.name == need.name and a.atomic
                    for a in self.decl_for(r).produced(r, role_view(config, r, self.decl_for(r)))
                )
            ]
            if atomic_in_batch:
                continue
            if producers:
                self.start(producers[0], config, provider=True)
                continue
            if self.provide_artifact is None:
                raise NotApplicable(
                    f"init:{role.value} needs artifact '{need.name}', which no backend of this "
                    "test produces; override provide_artifact() to publish it"
                )
            self.provide_artifact(need.name, self.context(role, config))

    # -- init and shutdown -----------------------------------------------------------------

    def init(self, role: Role, config: RunConfig, ctx: InitContext | None = None) -> Any:
        """Call ``rlcore_init_<role>`` through the registry, as setup does; return the handle.

        The handle is tracked, so :meth:`close` shuts it down if the test does not.
        Raises ConformanceFailure if the hook returns None (no implementation).
        """
        info = self.serving(role)
        if info is None:
            raise NotApplicable(f"no plugin of this test serves role '{role}'")
        ctx = ctx or self.context(role, config)
        hook_name = f"rlcore_init_{role.value}"
        handle = self.registry.hook(hook_name, [info])(ctx=ctx)
        if handle is None:
            raise ConformanceFailure(
                f"{info.origin()} declares role '{role}' but {hook_name} returned None: "
                "implement it and return the started backend's handle"
            )
        with self._lock:
            self.started.append(Started(role, handle))
        return handle

    def start(self, role: Role, config: RunConfig, *, provider: bool = False, adapters: Any = None) -> Any:
        """:meth:`init` with needs satisfied first, bounded by ``init_timeout_s`` (``adapters``:
        the context's :attr:`~rlcore.context.InitContext.adapters`)."""
        self.satisfy_needs(role, config, board=self.board)
        ctx = self.context(role, config, adapters=adapters) if adapters is not None else None
        outcome = call_bounded(
            lambda: self.init(role, config, ctx), self.init_timeout_s, f"init:{role.value}"
        )
        if outcome.timed_out:
            raise ConformanceFailure(
                f"init:{role.value} did not return within {self.init_timeout_s:g}s "
                "(raise init_timeout_s if the backend is just slow)"
            )
        if outcome.error is not None:
            raise outcome.error
        if provider:
            with self._lock:
                for s in self.started:
                    if s.handle is outcome.value:
                        s.provider = True
        return outcome.value

    def shutdown(self, handle: Any, *, what: str = "handle") -> None:
        """Shut ``handle`` down, bounded by ``shutdown_timeout_s``; stop tracking it."""
        with self._lock:
            self.started = [s for s in self.started if s.handle is not handle]
        stop = getattr(handle, "shutdown", None)
        if not callable(stop):
            raise ConformanceFailure(
                f"{what} {type(handle).__name__} has no shutdown() (rlcore.handles.BackendHandle)"
            )
        outcome = call_bounded(stop, self.shutdown_timeout_s, f"shutdown {what}")
        if outcome.timed_out:
            raise ConformanceFailure(
                f"{what}.shutdown() did not return within {self.shutdown_timeout_s:g}s"
            )
        if outcome.error is not None:
            raise ConformanceFailure(
                f"{what}.shutdown() raised {type(outcome.error).__name__}: {outcome.error}"
            ) from outcome.error

    def close(self) -> list[str]:
        """Shut down everything still tracked (last started first); return the errors."""
        errors = []
        with self._lock:
            todo = list(reversed(self.started))
        for s in todo:
            try:
                self.shutdown(s.handle, what=f"{s.role.value} handle")
            except Exception as err:  # noqa: BLE001 - collect, report at the end
                errors.append(str(err))
        self.cancel.cancel("conformance test finished")
        self.board.wake_all()
        self.refit_sessions.close()
        return errors


# -- comparing weights ------------------------------------------------------------------


def same_tensor(a: Any, b: Any) -> bool:
    """Exact equality of two tensors or arrays (shape, dtype and values)."""
    if hasattr(a, "detach") and hasattr(b, "detach"):
        import torch

        a, b = a.detach().cpu(), b.detach().cpu()
        return bool(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return bool(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))


def weight_differences(
    policy: Mapping[str, Any], generation: Mapping[str, Any], limit: int = 5
) -> list[str]:
    """Names whose tensors differ, are missing or extra (empty: identical)."""
    out = [f"{n}: missing in generation" for n in policy if n not in generation]
    out += [f"{n}: only in generation" for n in generation if n not in policy]
    out += [
        f"{n}: values differ"
        for n in policy
        if n in generation and not same_tensor(policy[n], generation[n])
    ]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])

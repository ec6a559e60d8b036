"""The conformance suite: a backend's declaration is its requirements object.

A backend author subclasses :class:`BackendConformance` in the plugin's own
tests; pytest then runs every check below against the plugin. Each claim of the
declaration (roles, overlap safety, atomic artifacts, refit-fed start, refit
transports, OpenAI endpoint) has a test that fails if the claim is false, and a
test for a feature the backend does not claim is skipped with the reason::

    from rlcore.testing import BackendConformance

    class TestFoo(BackendConformance):
        plugin = "rlcore_foo.plugin"                      # module, "module:attr" or object
        config_overrides = ["model.tiny.hidden_size=64"]  # a cheap config for this backend

Every init goes through the real hook, with an :class:`~rlcore.context.InitContext`
built as :func:`rlcore.setup.run_setup` builds it, so wrapper plugins, the
publish hook and option checking behave as in a real run.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rlcore.context import InitContext
from rlcore.declarations import Role, Transport, validate_declaration
from rlcore.errors import RlcoreError
from rlcore.events import EventBoard
from rlcore.handles import BackendHandle, Endpoint, RefitReceiver, RefitReport, RefitSender
from rlcore.planner import detect_accelerator, role_view
from rlcore.publish import STAGING_PREFIX, TRASH_PREFIX, is_complete
from rlcore.registry import load_registry
from rlcore.testing.harness import (
    HEAVY_MODULES,
    ConformanceFailure,
    Harness,
    LeakCheck,
    NotApplicable,
    call_bounded,
    declare,
    heavy,
    import_footprint,
    registration_name,
    resolve_plugin,
    weight_differences,
)
from rlcore.waiting import CancelToken, Deadline

ROLES = [r.value for r in Role]


def _fail(message: str) -> None:
    pytest.fail(message, pytrace=False)


class BackendConformance:
    """Subclass as ``Test<Backend>`` and set :attr:`plugin`; pytest does the rest.

    Class attributes (all optional but ``plugin``):

    * ``plugin``: the plugin under test, as registered under ``rlcore.backends``:
      ``"pkg.module"``, ``"pkg.module:attr"``, a module or an object.
    * ``plugin_name``: its registration name (default: the declared backend name).
    * ``peer_plugin``: a plugin serving the refit side this backend lacks (a
      generation backend for a policy backend, and vice versa); enables the refit
      round trip for single-role backends.
    * ``config_overrides``: ``key=value`` overrides for a cheap config of this backend.
    * ``needs_ray``: start an embedded Ray cluster for the class (``ray_num_cpus`` CPUs).
    * ``init_timeout_s`` / ``shutdown_timeout_s``: bounds on one init / one shutdown.
    * ``settle_s``: how long threads and child processes get to end after shutdown.
    * ``heavy_modules``: modules the plugin must not import at import/declare time.
    * ``probe_batch``: ``(prompt_ids, completion_ids)`` pairs for logprob comparison.
    * ``max_token_mult_prob_error``: bound on generation-vs-policy logprobs after refit.
    * ``probe_endpoint``: GET ``<endpoint>/models`` to check a claimed endpoint serves.
    * ``leak_ignore_threads`` / ``leak_ignore_processes``: name prefixes that are not
      the backend's (a library's own long-lived pool, Ray's idle workers).

    Methods an author may override: :meth:`conformance_events` (values of core
    events an init waits for) and :meth:`provide_artifact` (publish an artifact
    a role needs that no backend of the test produces).
    """

    plugin: ClassVar[object] = None
    plugin_name: ClassVar[str | None] = None
    peer_plugin: ClassVar[object] = None
    peer_plugin_name: ClassVar[str | None] = None
    config_overrides: ClassVar[Sequence[str]] = ()
    needs_ray: ClassVar[bool] = False
    ray_num_cpus: ClassVar[int] = 2
    init_timeout_s: ClassVar[float] = 120.0
    shutdown_timeout_s: ClassVar[float] = 60.0
    settle_s: ClassVar[float] = 5.0
    declare_budget_s: ClassVar[float] = 1.0
    heavy_modules: ClassVar[Sequence[str]] = HEAVY_MODULES
    probe_batch: ClassVar[Sequence[tuple[Sequence[int], Sequence[int]]]] = (
        ((2, 5, 6, 7), (8, 9, 10, 3)),
        ((2, 11, 12), (13, 14, 3)),
        ((2, 20, 21, 22, 23), (24, 3)),
    )
    max_token_mult_prob_error: ClassVar[float] = 1.001
    probe_endpoint: ClassVar[bool] = True
    leak_ignore_threads: ClassVar[Sequence[str]] = ()
    leak_ignore_processes: ClassVar[Sequence[str]] = ("ray::IDLE",)

    # -- hooks for authors -----------------------------------------------------------

    def conformance_events(self) -> dict[str, Any]:
        """Values of core events posted before an init that waits for them."""
        return {"generation.endpoint": Endpoint("http://127.0.0.1:9/v1", "conformance-model")}

    def provide_artifact(self, name: str, ctx: InitContext) -> None:
        """Publish artifact ``name`` (with ``ctx.publish``) for an init that needs it."""
        raise NotApplicable(
            f"artifact '{name}' is needed but no backend of this test produces it; "
            "override provide_artifact() (or set peer_plugin) to test this role"
        )

    # -- fixtures ----------------------------------------------------------------------

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def cluster(cls) -> Iterator[Any]:
        """An embedded Ray cluster for the class when ``needs_ray`` is set, else ``None``."""
        if not cls.needs_ray:
            yield None
            return
        from rlcore.cluster import Cluster
        from rlcore.config import ClusterConfig

        cluster = Cluster(ClusterConfig(num_cpus=cls.ray_num_cpus)).start()
        try:
            yield cluster
        finally:
            cluster.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_cache(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The artifact cache shared by the tests of the class (as a real cache is)."""
        return tmp_path_factory.mktemp("rlcore-cache")

    def _harness(self, work_dir: Path, cache_dir: Path) -> Harness:
        """A harness whose plugin registered (the test fails, clearly, if it did not)."""
        if self.plugin is None:
            raise pytest.UsageError(f"{type(self).__name__}: set `plugin` to the plugin under test")
        h = Harness(
            plugin=resolve_plugin(self.plugin),
            peer=resolve_plugin(self.peer_plugin) if self.peer_plugin is not None else None,
            plugin_name=self.plugin_name,
            peer_name=self.peer_plugin_name,
            work_dir=work_dir,
            cache_dir=cache_dir,
            overrides=list(self.config_overrides),
            events=self.conformance_events(),
            init_timeout_s=self.init_timeout_s,
            shutdown_timeout_s=self.shutdown_timeout_s,
            provide_artifact=self.provide_artifact,
        )
        try:
            h.info  # noqa: B018 - raises if the plugin did not register
        except ConformanceFailure as err:
            h.close()
            _fail(str(err))
        return h

    @pytest.fixture
    def harness(self, tmp_path: Path, conformance_cache: Path) -> Iterator[Harness]:
        """A :class:`Harness` for one test; whatever it started is shut down afterwards."""
        h = self._harness(tmp_path, conformance_cache)
        try:
            yield h
        finally:
            h.close()

    # -- helpers -------------------------------------------------------------------------

    def _leaks(self) -> LeakCheck:
        return LeakCheck(
            ignore_threads=self.leak_ignore_threads, ignore_processes=self.leak_ignore_processes
        )

    def _assert_no_leaks(self, leaks: LeakCheck, what: str) -> None:
        left = leaks.problems(self.settle_s)
        if left:
            _fail(
                f"{what}: still alive {self.settle_s:g}s after shutdown: {'; '.join(left)}. "
                "shutdown() must release every process, thread and actor the backend started "
                "(and an init that raises must release what it started)."
            )

    @staticmethod
    def _role_or_skip(h: Harness, role: str) -> Role:
        r = Role(role)
        if r not in h.declaration.roles:
            pytest.skip(f"not claimed: backend '{h.declaration.name}' does not serve {role}")
        return r

    def _start(self, h: Harness, role: Role, config: Any) -> Any:
        try:
            return h.start(role, config)
        except NotApplicable as err:
            pytest.skip(str(err))
        except ConformanceFailure as err:
            _fail(str(err))

    def _uses_core_refit(self, h: Harness, *roles: Role) -> bool:
        """True if no plugin serving ``roles`` brings its own ``rlcore_refit``."""
        infos = {id(i): i for r in roles if (i := h.serving(r)) is not None}
        return not any(h.own_impl(i, "rlcore_refit") for i in infos.values())

    # -- declaration and registration -----------------------------------------------------

    def test_declaration_is_valid(self) -> None:
        """The declaration passes validate_declaration (types and contradictions)."""
        ref = resolve_plugin(self.plugin)
        decl = declare(ref.obj)
        if decl is None:
            _fail(f"plugin {ref.describe()} returns no declaration: it is a wrapper, not a backend")
        try:
            validate_declaration(decl, plugin=ref.describe(), distribution=None)
        except RlcoreError as err:
            _fail(str(err))

    def test_declaration_is_pure(self) -> None:
        """rlcore_declare_backend returns the same declaration every time it is called."""
        ref = resolve_plugin(self.plugin)
        first, second = declare(ref.obj), declare(ref.obj)
        if first != second:
            _fail(
                f"rlcore_declare_backend of {ref.describe()} returned different declarations "
                f"on two calls:\n  {first!r}\n  {second!r}\nIt must be pure: the core calls it "
                "in every process that loads plugins and expects the same answer."
            )
        to_dict = getattr(first, "to_dict", None)
        if callable(to_dict):
            json.dumps(to_dict())  # `rlcore plugins --json` must be able to print it

    def test_import_is_light(self) -> None:
        """Importing and declaring (in a fresh interpreter) loads no heavy framework,
        starts no thread or process, and is quick."""
        ref = resolve_plugin(self.plugin)
        try:
            report = import_footprint(ref, registration_name(ref, self.plugin_name))
        except NotApplicable as err:
            pytest.skip(str(err))
        except ConformanceFailure as err:
            _fail(str(err))
        problems = []
        if bad := heavy(report["import_modules"], self.heavy_modules):
            problems.append(f"importing plugin module '{ref.describe()}' imports {', '.join(bad)}")
        if bad := heavy(report["declare_modules"], self.heavy_modules):
            problems.append(f"registering it (rlcore_declare_backend) imports {', '.join(bad)}")
        if report["new_threads"] > 0:
            problems.append(
                f"import and registration left {report['new_threads']} thread(s) running"
            )
        if report["children"] > 0:
            problems.append(
                f"import and registration started {report['children']} child process(es)"
            )
        if report["declare_s"] > self.declare_budget_s:
            problems.append(
                f"registration (rlcore_declare_backend) took {report['declare_s']:.2f}s "
                f"(budget {self.declare_budget_s:g}s)"
            )
        if report["failures"]:
            problems.append("registration failed: " + "; ".join(report["failures"]))
        if problems:
            _fail(
                "; ".join(problems) + ". `rlcore plugins` and every Ray worker import the plugin: "
                "import heavy dependencies inside the init hooks, not at module level."
            )

    def test_registers_cleanly(self, harness: Harness) -> None:
        """load_registry accepts the plugin, twice, and it implements each declared role's hook."""
        h = harness
        failures = [f.message for f in h.registry.failures]
        if failures:
            _fail("registration failed:\n  " + "\n  ".join(failures))
        info = h.info
        again = load_registry(entry_points=False, extra=[(h.name, h.plugin.obj)])
        if again.failures or again.declarations().get(info.declaration.name) != info.declaration:  # type: ignore[union-attr]
            _fail(
                "registering the plugin a second time (as every Ray worker does) gave a different result"
            )
        missing = [
            f"rlcore_init_{role.value}"
            for role in sorted(info.declaration.roles)  # type: ignore[union-attr]
            if not h.own_impl(info, f"rlcore_init_{role.value}")
        ]
        if missing:
            _fail(
                f"{info.origin()} declares roles {sorted(r.value for r in info.declaration.roles)} "  # type: ignore[union-attr]
                f"but does not implement {', '.join(missing)} (a plain @hookimpl, not a wrapper)"
            )

    # -- init and shutdown, per role ------------------------------------------------------------

    @pytest.mark.parametrize("role", ROLES)
    def test_init_and_shutdown(self, harness: Harness, role: str) -> None:
        """Init through the real hook returns a handle whose shutdown() releases everything,
        is idempotent, and the handle carries what the declaration claims."""
        h = harness
        r = self._role_or_skip(h, role)
        config = h.config()
        try:
            h.satisfy_needs(r, config, board=h.board)
        except NotApplicable as err:
            pytest.skip(str(err))
        leaks = self._leaks()
        handle = self._start(h, r, config)
        if not isinstance(handle, BackendHandle):
            _fail(f"init:{role} returned {type(handle).__name__}, which has no shutdown()")
        try:
            self._check_handle(h, r, handle)
        finally:
            h.shutdown(handle, what=f"{role} handle")
        outcome = call_bounded(handle.shutdown, self.shutdown_timeout_s, "second shutdown")
        if outcome.timed_out or outcome.error is not None:
            _fail(
                f"calling shutdown() of the {role} handle a second time "
                f"{'hung' if outcome.timed_out else f'raised {type(outcome.error).__name__}: {outcome.error}'}; "
                "it must be idempotent (the core may call it from a failure path too)"
            )
        self._assert_no_leaks(leaks, f"init:{role} then shutdown()")

    def _check_handle(self, h: Harness, role: Role, handle: Any) -> None:
        decl = h.declaration
        if role is Role.GENERATION and decl.openai_endpoint:
            endpoint = getattr(handle, "endpoint", None)
            if not isinstance(endpoint, Endpoint):
                _fail(
                    f"backend '{decl.name}' declares openai_endpoint=True, but its generation "
                    f"handle's `endpoint` is {endpoint!r}, not an rlcore.handles.Endpoint"
                )
            if self.probe_endpoint:
                self._probe_endpoint(endpoint)
        if role is Role.POLICY and decl.send_transports and self._uses_core_refit(h, role):
            self._check_sender(decl.name, handle)
        if role is Role.GENERATION and decl.receive_transports and self._uses_core_refit(h, role):
            self._check_receiver(decl.name, handle)

    @staticmethod
    def _probe_endpoint(endpoint: Endpoint) -> None:
        url = endpoint.base_url.rstrip("/") + "/models"
        request = urllib.request.Request(
            url, headers={"Authorization": f"Bearer {endpoint.api_key}"}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=30) as resp:
                body = json.loads(resp.read().decode())
        except Exception as err:  # noqa: BLE001 - any failure means "does not serve"
            _fail(f"the claimed OpenAI-compatible endpoint does not answer GET {url}: {err}")
        ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
        if endpoint.model not in ids:
            _fail(f"GET {url} lists models {ids}, not the handle's model {endpoint.model!r}")

    @staticmethod
    def _check_specs(side: str, name: str, specs: Any) -> None:
        from rlcore.refit.specs import TensorSpec

        if not isinstance(specs, list) or not all(isinstance(s, TensorSpec) for s in specs):
            _fail(
                f"{side} handle of '{name}': weight_specs() must return a list of TensorSpec, got {specs!r:.200}"
            )
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            _fail(f"{side} handle of '{name}': weight_specs() repeats names")

    def _check_sender(self, name: str, handle: Any) -> None:
        if not isinstance(handle, RefitSender):
            missing = [
                m
                for m in (
                    "device_type",
                    "weight_specs",
                    "refit_address",
                    "open_refit_channel",
                    "send_weights",
                )
                if not hasattr(handle, m)
            ]
            _fail(
                f"backend '{name}' declares send transports but its policy handle does not "
                f"implement rlcore.handles.RefitSender (missing: {', '.join(missing)}); implement "
                "it, or implement rlcore_refit for your pair"
            )
        if handle.device_type not in ("cpu", "cuda"):
            _fail(
                f"policy handle of '{name}': device_type is {handle.device_type!r}, expected 'cpu' or 'cuda'"
            )
        self._check_specs("policy", name, handle.weight_specs())

    def _check_receiver(self, name: str, handle: Any) -> None:
        if not isinstance(handle, RefitReceiver):
            missing = [
                m
                for m in ("refit_ranks", "weight_specs", "open_refit_channel", "receive_weights")
                if not hasattr(handle, m)
            ]
            _fail(
                f"backend '{name}' declares receive transports but its generation handle does "
                f"not implement rlcore.handles.RefitReceiver (missing: {', '.join(missing)}); "
                "implement it, or implement rlcore_refit for your pair"
            )
        if not isinstance(handle.refit_ranks, int) or handle.refit_ranks < 1:
            _fail(
                f"generation handle of '{name}': refit_ranks is {handle.refit_ranks!r}, expected an int >= 1"
            )
        self._check_specs("generation", name, handle.weight_specs())

    # -- failure without leaks ------------------------------------------------------------------

    @pytest.mark.parametrize("role", ROLES)
    def test_init_cancelled(self, harness: Harness, role: str) -> None:
        """With the cancel token already set, init raises an RlcoreError (or returns a
        handle) within the init bound, and nothing is left running."""
        token = CancelToken()
        token.cancel("conformance: cancelled before init")
        self._init_must_fail_cleanly(
            harness, role, cancel=token, deadline=None, why="its cancel token was set"
        )

    @pytest.mark.parametrize("role", ROLES)
    def test_init_deadline_expired(self, harness: Harness, role: str) -> None:
        """With a deadline of 0 s, init raises an RlcoreError (or returns a handle)
        within the init bound, and nothing is left running."""
        self._init_must_fail_cleanly(
            harness,
            role,
            cancel=CancelToken(),
            deadline=Deadline(0.0, "conformance zero deadline"),
            why="its deadline had passed",
        )

    def _init_must_fail_cleanly(
        self, h: Harness, role: str, *, cancel: CancelToken, deadline: Deadline | None, why: str
    ) -> None:
        r = self._role_or_skip(h, role)
        config = h.config()
        board = EventBoard(cancel)
        try:
            h.satisfy_needs(r, config, board=board)
        except NotApplicable as err:
            pytest.skip(str(err))
        ctx = h.context(r, config, cancel=cancel, deadline=deadline, board=board)
        leaks = self._leaks()
        outcome = call_bounded(lambda: h.init(r, config, ctx), self.init_timeout_s, f"init:{role}")
        if outcome.timed_out:
            _fail(
                f"init:{role} was still running {self.init_timeout_s:g}s after it was called "
                f"although {why}: every wait inside an init must observe ctx.cancel and ctx.deadline"
            )
        if outcome.error is not None:
            err = outcome.error
            if isinstance(err, ConformanceFailure):
                _fail(str(err))
            if not isinstance(err, RlcoreError):
                _fail(
                    f"init:{role} raised {type(err).__name__}: {err} when {why}; expected "
                    "rlcore.errors.Cancelled / DeadlineExceeded (or another RlcoreError), e.g. "
                    "from ctx.cancel.raise_if_cancelled() or ctx.deadline.raise_if_expired()"
                )
        else:
            h.shutdown(outcome.value, what=f"{role} handle")
        self._assert_no_leaks(leaks, f"init:{role} when {why}")

    # -- honest overlap declaration ---------------------------------------------------------------

    def _concurrent_inits(self, h: Harness, config: Any, what: str) -> None:
        roles = sorted(h.declaration.roles, key=lambda r: ROLES.index(r.value))
        batch = roles if len(roles) > 1 else roles * 2  # one role: two instances at once
        started = (
            " and ".join(r.value for r in batch) if len(roles) > 1 else f"two {roles[0].value}"
        )
        try:
            for r in batch:
                h.satisfy_needs(r, config, board=h.board, starting=batch)
        except NotApplicable as err:
            pytest.skip(str(err))
        leaks = self._leaks()
        barrier = threading.Barrier(len(batch))

        def init(r: Role) -> Any:
            barrier.wait(self.init_timeout_s)
            return h.init(r, config)

        threads_out: list[Any] = [None] * len(batch)

        def runner(i: int, r: Role) -> None:
            threads_out[i] = call_bounded(
                lambda: init(r), self.init_timeout_s, f"init:{r.value}#{i}"
            )

        threads = [
            threading.Thread(target=runner, args=(i, r), daemon=True) for i, r in enumerate(batch)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.init_timeout_s + 5)
        outcomes = list(zip(batch, threads_out, strict=True))
        problems = []
        for r, out in outcomes:
            if out is None or out.timed_out:
                problems.append(f"init:{r.value} did not finish within {self.init_timeout_s:g}s")
            elif out.error is not None:
                problems.append(f"init:{r.value} raised {type(out.error).__name__}: {out.error}")
        for r, out in reversed(outcomes):
            if out is not None and not out.timed_out and out.error is None:
                try:
                    h.shutdown(out.value, what=f"{r.value} handle")
                except ConformanceFailure as err:
                    problems.append(str(err))
        if problems:
            _fail(
                f"backend '{h.declaration.name}' claims {what}, but "
                f"{started} inits started at the same moment failed: " + "; ".join(problems)
            )
        self._assert_no_leaks(leaks, f"concurrent inits ({what})")

    def test_overlap_non_colocated(self, harness: Harness) -> None:
        """Claimed non-colocated overlap safety: inits of its roles (or two instances of
        its one role) run at the same moment without error and shut down cleanly."""
        decl = harness.declaration
        if not decl.overlap.non_colocated:
            pytest.skip(f"not claimed: overlap.non_colocated is False ({decl.overlap.reason})")
        self._concurrent_inits(harness, harness.config(), "overlap.non_colocated=True")

    def test_overlap_colocated(self, harness: Harness) -> None:
        """Claimed colocated overlap safety: the same, with placement.colocated=true."""
        decl = harness.declaration
        if not decl.overlap.colocated:
            pytest.skip(f"not claimed: overlap.colocated is False ({decl.overlap.reason})")
        self._concurrent_inits(
            harness, harness.config("placement.colocated=true"), "overlap.colocated=True"
        )

    # -- atomic publish ------------------------------------------------------------------------------

    def test_atomic_publish(self, tmp_path: Path) -> None:
        """Each artifact declared atomic is published through rlcore_publish during init
        and is complete (rlcore.publish.is_complete) when init returns; nothing half-written
        is left in its cache directory."""
        h = self._harness(tmp_path, tmp_path / "fresh-cache")  # fresh: nothing published yet
        try:
            config = h.config()
            decl = h.declaration
            todo = []
            for r in sorted(decl.roles, key=lambda r: ROLES.index(r.value)):
                view = role_view(config, r, decl)
                todo += [(r, a) for a in decl.produced(r, view) if a.atomic]
            if not todo:
                pytest.skip(
                    f"not claimed: backend '{decl.name}' publishes no atomic artifact in this config"
                )
            for r, artifact in todo:
                handle = self._start(h, r, config)
                directory = h.cache_dir / artifact.name
                published = h.spy.under(directory)
                if not published:
                    _fail(
                        f"backend '{decl.name}' declares artifact '{artifact.name}' as atomic (role "
                        f"{r.value}) but its init published nothing under {directory} through the "
                        "rlcore_publish hook: use ctx.publish(name, key, write)"
                    )
                for path in published:
                    if not is_complete(path):
                        _fail(
                            f"artifact '{artifact.name}' at {path} is not complete after init returned"
                        )
                for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
                    if entry.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
                        _fail(f"init:{r.value} left a scratch directory {entry} behind")
                    if not is_complete(entry):
                        _fail(
                            f"{entry} in the cache of artifact '{artifact.name}' is not complete: "
                            "something was written there without atomic publish"
                        )
                h.shutdown(handle, what=f"{r.value} handle")
        finally:
            h.close()

    # -- refit ----------------------------------------------------------------------------------------

    def test_refit_fed_generation_starts(self, harness: Harness) -> None:
        """Claimed refit-fed start: generation inits with generation.refit_fed=true and
        offers the receiving side of its transports."""
        h = harness
        decl = h.declaration
        if Role.GENERATION not in decl.roles or not decl.refit_fed:
            pytest.skip(f"not claimed: backend '{decl.name}' does not declare refit_fed")
        config = h.config("generation.refit_fed=true")
        leaks = self._leaks()
        handle = self._start(h, Role.GENERATION, config)
        try:
            if self._uses_core_refit(h, Role.GENERATION):
                self._check_receiver(decl.name, handle)
        finally:
            h.shutdown(handle, what="generation handle")
        self._assert_no_leaks(leaks, "refit-fed init:generation then shutdown()")

    def test_refit_round_trip(self, harness: Harness) -> None:
        """For every transport both sides declare: refit through the rlcore_refit hook,
        twice, and the generation's weights equal the policy's afterwards."""
        self._round_trip(harness, refit_fed=False)

    def test_refit_fed_round_trip(self, harness: Harness) -> None:
        """The round trip with a generation started refit-fed (weights only from refit)."""
        try:
            gen = harness.decl_for(Role.GENERATION)
        except NotApplicable:
            gen = None
        if gen is None or not gen.refit_fed:
            pytest.skip("not claimed: no generation backend of this test declares refit_fed")
        self._round_trip(harness, refit_fed=True)

    def _round_trip(self, h: Harness, *, refit_fed: bool) -> None:
        from rlcore.setup import refit_context

        pol_info, gen_info = h.serving(Role.POLICY), h.serving(Role.GENERATION)
        if pol_info is None or gen_info is None:
            lacking = "policy" if pol_info is None else "generation"
            pytest.skip(
                f"backend '{h.declaration.name}' does not serve {lacking}; set peer_plugin to a "
                f"backend that serves {lacking} to test the refit round trip"
            )
        pol_decl, gen_decl = pol_info.declaration, gen_info.declaration
        assert pol_decl is not None and gen_decl is not None
        common = sorted(pol_decl.send_transports & gen_decl.receive_transports)
        if not common:
            _fail(
                f"policy backend '{pol_decl.name}' sends over {sorted(map(str, pol_decl.send_transports))}, "
                f"generation backend '{gen_decl.name}' receives over "
                f"{sorted(map(str, gen_decl.receive_transports))}: no transport in common"
            )
        core_refit = self._uses_core_refit(h, Role.POLICY, Role.GENERATION)
        cuda = detect_accelerator() == "cuda"
        transports = [t for t in common if t is not Transport.CUDA_IPC or cuda]
        if not transports:
            pytest.skip(
                f"transports in common {[str(t) for t in common]} need CUDA, which this host lacks"
            )
        from rlcore.refit import transports as core_transports

        implemented = core_transports.implemented()
        if core_refit and (unsupported := [t for t in transports if t not in implemented]):
            _fail(
                f"declared transport(s) {[str(t) for t in unsupported]} have no implementation: the "
                f"core's refit moves bytes over {sorted(t.value for t in implemented)} only, and "
                "neither plugin implements rlcore_refit"
            )
        config = h.config(f"generation.refit_fed={'true' if refit_fed else 'false'}")
        leaks = self._leaks()
        policy = self._start(h, Role.POLICY, config)
        generation = self._start(h, Role.GENERATION, config)
        if core_refit:
            self._check_sender(pol_decl.name, policy)
            self._check_receiver(gen_decl.name, generation)
        refit = h.registry.hook("rlcore_refit", [pol_info, gen_info])
        step = 0
        for transport in transports:
            for _ in range(2):  # the second refit reuses the channel opened by the first
                self._perturb(policy)
                ctx = refit_context(
                    config, step=step, transport=str(transport), cancel=CancelToken(),
                    sessions=h.refit_sessions,
                )
                out = call_bounded(
                    lambda ctx=ctx: refit(policy=policy, generation=generation, ctx=ctx),
                    config.refit.timeout_s + 10,
                    f"refit {transport}",
                )
                where = f"refit step {step} over {transport}"
                if out.timed_out:
                    _fail(
                        f"{where} did not finish within refit.timeout_s={config.refit.timeout_s:g}s"
                    )
                if out.error is not None:
                    _fail(f"{where} raised {type(out.error).__name__}: {out.error}")
                report = out.value
                if not isinstance(report, RefitReport) or report.transport != str(transport):
                    _fail(
                        f"{where} returned {report!r}; expected a RefitReport for transport {transport}"
                    )
                self._assert_same_weights(policy, generation, where)
                step += 1
        h.shutdown(generation, what="generation handle")
        h.shutdown(policy, what="policy handle")
        self._assert_no_leaks(leaks, "refit round trip then shutdown()")

    def _perturb(self, policy: Any) -> None:
        """One training step, if the policy offers the GRPO loop's API, so that a refit
        has something new to carry (a receiver that ignores it is then caught)."""
        train_step, logprobs = (
            getattr(policy, "train_step", None),
            getattr(policy, "logprobs", None),
        )
        if not callable(train_step) or not callable(logprobs):
            return
        batch = [(list(p), list(c)) for p, c in self.probe_batch]
        advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(batch))]
        train_step(batch, advantages, logprobs(batch), clip_eps=0.2, lr=0.05)

    def _assert_same_weights(self, policy: Any, generation: Any, where: str) -> None:
        export_p, export_g = (
            getattr(policy, "export_weights", None),
            getattr(generation, "export_weights", None),
        )
        if callable(export_p) and callable(export_g):
            diff = weight_differences(dict(export_p()), dict(export_g()))
            if diff:
                _fail(
                    f"after {where}, generation weights differ from the policy's: {'; '.join(diff)}"
                )
            return
        lp_p, lp_g = getattr(policy, "logprobs", None), getattr(generation, "logprobs", None)
        if callable(lp_p) and callable(lp_g):
            from rlcore.grpo import token_mult_prob_error

            batch = [(list(p), list(c)) for p, c in self.probe_batch]
            err = token_mult_prob_error(lp_g(batch), lp_p(batch))
            if err > self.max_token_mult_prob_error:
                _fail(
                    f"after {where}, token_mult_prob_error of generation vs policy logprobs is "
                    f"{err:.6f} (max {self.max_token_mult_prob_error:g})"
                )

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
built as :func:`rlcore.setup.runner.run_setup` builds it, so wrapper plugins, the
publish hook and option checking behave as in a real run.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rlcore.app.guards import (
    Caller,
    GuardedGeneration,
    check_logprobs,
    check_rollouts,
    check_samples,
)
from rlcore.context import InitContext
from rlcore.declarations import Role, Transport, validate_declaration
from rlcore.errors import CancelToken, Deadline, ProtocolError, RlcoreError
from rlcore.handles import (
    BackendHandle,
    Checkpointable,
    Endpoint,
    EnvHandle,
    GenerationHandle,
    PolicyHandle,
    RefitReceiver,
    RefitReport,
    RefitSender,
    RolloutRequest,
    SamplingParams,
    StagedCheckpointable,
)
from rlcore.publish import STAGING_PREFIX, TRASH_PREFIX, is_complete
from rlcore.setup.events import EventBoard
from rlcore.setup.planner import detect_accelerator, role_view
from rlcore.setup.registry import load_registry
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

ROLES = [r.value for r in Role]
#: The compute dtypes the training test runs in (each skipped unless declared).
DTYPES = ["float32", "bfloat16", "float16"]
#: The default peer: rlcore's transformers reference policy and generation (Ray actors).
REFERENCE_PEER = "rlcore.testing.peers:REFERENCE"
_PROTOCOLS: dict[Role, type] = {
    Role.POLICY: PolicyHandle,
    Role.GENERATION: GenerationHandle,
    Role.ENV: EnvHandle,
}


def _fail(message: str) -> None:
    pytest.fail(message, pytrace=False)


def _mult_err(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    from rlcore.app.refit_check import token_mult_prob_error

    return token_mult_prob_error(a, b)


@dataclass
class Engines:
    """Backends started once for a test class (policy, generation, env), on first use.

    The protocol tests (``generate``, ``logprobs``, ``collect_rollouts``) share them:
    starting an engine costs seconds, calling it milliseconds.
    """

    harness: Harness
    config: Any
    handles: dict[Role, Any] = field(default_factory=dict)
    failures: dict[Role, str] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)

    def model_dir(self) -> Path:
        from rlcore.models.tiny import ensure_model

        return ensure_model(self.config.model, self.harness.cache_dir)

    def tokenizer(self) -> Any:
        if "tokenizer" not in self.cache:
            from transformers import AutoTokenizer

            self.cache["tokenizer"] = AutoTokenizer.from_pretrained(str(self.model_dir()))
        return self.cache["tokenizer"]

    def eos_ids(self) -> frozenset[int]:
        """The tokenizer's EOS and every id of the model's ``generation_config.eos_token_id``."""
        if "eos" not in self.cache:
            ids = {self.tokenizer().eos_token_id}
            try:
                from transformers import GenerationConfig

                extra = GenerationConfig.from_pretrained(str(self.model_dir())).eos_token_id
                ids |= {extra} if isinstance(extra, int) else set(extra or ())
            except OSError:  # no generation_config.json
                pass
            self.cache["eos"] = frozenset(i for i in ids if i is not None)
        return frozenset(self.cache["eos"])


@dataclass
class _RoundTrip:
    """A policy and a generation started for the suite's refit round trip, and what each
    refit between them needs."""

    config: Any
    policy: Any
    generation: Any
    names: tuple[str, str]  # (policy backend, generation backend)
    refit: Callable[..., Any]  # the rlcore_refit hook of the two backends
    sessions: Any  # the harness's refit sessions (channels reused between refits)
    refit_fed: bool  # the generation started without weights: no comparison before step 0


class _LazyGeneration:
    """The run's generation for an env's RolloutRequest, started when the env first samples."""

    def __init__(self, start: Callable[[], Any]) -> None:
        self._start = start

    def generate(self, prompt_ids: Any, params: SamplingParams) -> Any:
        return self._start().generate(prompt_ids, params)

    def logprobs(self, batch: Any) -> Any:
        return self._start().logprobs(batch)

    def shutdown(self) -> None:  # the suite shuts the real handle down
        pass


def training_capture(suite: BackendConformance, h: Harness, policy: Any, config: Any) -> dict[str, Any]:
    """What ``policy`` sends in one core refit over the first declared transport that runs
    here (files first: they leave no channel open), captured by
    :func:`rlcore.refit.capture.capture_export`."""
    from rlcore.refit.capture import capture_export, file_transport_first
    from rlcore.refit.sessions import RefitSessions
    from rlcore.setup.runner import refit_context

    decl = h.declaration
    transport = file_transport_first(decl.send_transports, detect_accelerator())
    if transport is None:
        pytest.skip(
            f"backend '{decl.name}' sends over {sorted(map(str, decl.send_transports))}, none of "
            "which the suite can receive on this host: its export is checked by the refit round trips"
        )
    suite._ensure_ray()
    ctx = refit_context(config, step=0, transport=transport, cancel=h.cancel, sessions=RefitSessions())
    out = call_bounded(
        lambda: capture_export(policy, ctx),
        config.refit.timeout_s + 10,
        "capture export",
    )
    if out.timed_out:
        _fail(f"backend '{decl.name}': a refit over {transport} did not finish within refit.timeout_s")
    if out.error is not None:
        _fail(
            f"backend '{decl.name}': a refit over {transport} in model.dtype={config.model.dtype} "
            f"raised {type(out.error).__name__}: {out.error}"
        )
    return dict(out.value)


class BackendConformance:
    """Subclass as ``Test<Backend>`` and set :attr:`plugin`; pytest does the rest.

    Class attributes (all optional but ``plugin``):

    * ``plugin``: the plugin under test, as registered under ``rlcore.backends``:
      ``"pkg.module"``, ``"pkg.module:attr"``, a module or an object.
    * ``plugin_name``: its registration name (default: the declared backend name).
    * ``peer_plugin``: a plugin serving the roles this backend lacks (a generation
      backend for a policy backend, and vice versa). Default: rlcore's reference peer
      (:mod:`rlcore.testing.peers`, transformers in Ray actors), so a single-role
      backend gets its refit round trips and protocol checks with nothing else installed.
    * ``use_reference_peer``: set False to run without the default peer (tests that
      need the missing role are then skipped).
    * ``config_overrides``: ``key=value`` overrides for a cheap config of this backend.
    * ``needs_ray``: start an embedded Ray cluster for the class (``ray_num_cpus`` CPUs).
    * ``init_timeout_s`` / ``shutdown_timeout_s``: bounds on one init / one shutdown.
    * ``settle_s``: how long threads and child processes get to end after shutdown.
    * ``heavy_modules``: modules the plugin must not import at import/declare time.
    * ``probe_batch``: ``(prompt_ids, completion_ids)`` pairs for logprob comparison.
    * ``max_token_mult_prob_error``: bound on generation-vs-policy logprobs (same weights).
    * ``sample_temperature``: a sampling temperature != 1 for the logprob-convention check.
    * ``eos_probe``: ``(n, max_tokens, temperature)`` of the sampling that must reach EOS.
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
    use_reference_peer: ClassVar[bool] = True
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
    sample_temperature: ClassVar[float] = 0.7
    eos_probe: ClassVar[tuple[int, int, float]] = (8, 24, 1.5)
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

    #: The Ray cluster this class started (eagerly for ``needs_ray``, else for a peer).
    _cluster: ClassVar[Any] = None

    @classmethod
    def _ensure_ray(cls) -> None:
        """Start (or join) Ray for the class; a cluster started here stops with the class."""
        import ray

        if ray.is_initialized():
            return
        from rlcore.config import ClusterConfig
        from rlcore.runtime.cluster import Cluster

        cls._cluster = Cluster(ClusterConfig(num_cpus=cls.ray_num_cpus)).start()

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def cluster(cls) -> Iterator[Any]:
        """An embedded Ray cluster for the class when ``needs_ray`` is set (otherwise
        one is started on first use by a peer, and stopped here)."""
        cls._cluster = None
        if cls.needs_ray:
            cls._ensure_ray()
        try:
            yield cls._cluster
        finally:
            if cls._cluster is not None:
                cls._cluster.shutdown()
            cls._cluster = None

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls, cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
        """Policy, generation and env of this test class, each started on first use."""
        root = tmp_path_factory.mktemp("rlcore-engines")
        h = cls()._harness(root, root / "cache")
        try:
            yield Engines(h, h.config())
        finally:
            h.close()

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
            peer=self._peer_ref(),
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

    def _peer_ref(self) -> Any:
        """The peer plugin: ``peer_plugin``, else the reference peer (not for itself)."""
        if self.peer_plugin is not None:
            return resolve_plugin(self.peer_plugin)
        if not self.use_reference_peer:
            return None
        ref = resolve_plugin(REFERENCE_PEER)
        return None if resolve_plugin(self.plugin).obj is ref.obj else ref

    # -- helpers -------------------------------------------------------------------------

    def _leaks(self) -> LeakCheck:
        return LeakCheck(
            ignore_threads=self.leak_ignore_threads, ignore_processes=self.leak_ignore_processes
        )

    def _assert_no_leaks(self, h: Harness, leaks: LeakCheck, what: str) -> None:
        left = leaks.problems(self.settle_s)
        if left:
            _fail(
                f"backend '{h.declaration.name}': {what}: still alive {self.settle_s:g}s after shutdown: {'; '.join(left)}. "
                "shutdown() must release every process, thread and actor the backend started "
                "(and an init that raises must release what it started)."
            )

    @staticmethod
    def _role_or_skip(h: Harness, role: str) -> Role:
        r = Role(role)
        if r not in h.declaration.roles:
            pytest.skip(f"not claimed: backend '{h.declaration.name}' does not serve {role}")
        return r

    def _start(self, h: Harness, role: Role, config: Any, adapters: Any = None) -> Any:
        info = h.serving(role)
        if info is not None and info.plugin is not h.plugin.obj:
            self._ensure_ray()  # the peer runs in Ray actors
        try:
            return h.start(role, config, adapters=adapters)
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
        try:
            decl = declare(ref.obj)
        except Exception as err:  # noqa: BLE001 - e.g. a transport rlcore does not have
            _fail(
                f"rlcore_declare_backend of plugin {ref.describe()} raised "
                f"{type(err).__name__}: {err} (valid transports: "
                f"{', '.join(t.value for t in Transport)})"
            )
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
            self._check_handle(h, r, handle, config)
        finally:
            h.shutdown(handle, what=f"{role} handle")
        outcome = call_bounded(handle.shutdown, self.shutdown_timeout_s, "second shutdown")
        if outcome.timed_out or outcome.error is not None:
            _fail(
                f"calling shutdown() of the {role} handle a second time "
                f"{'hung' if outcome.timed_out else f'raised {type(outcome.error).__name__}: {outcome.error}'}; "
                "it must be idempotent (the core may call it from a failure path too)"
            )
        self._assert_no_leaks(harness, leaks, f"init:{role} then shutdown()")

    def _check_handle(self, h: Harness, role: Role, handle: Any, config: Any) -> None:
        decl = h.declaration
        if role is Role.GENERATION and decl.serves_endpoint(role_view(config, role, decl)):
            endpoint = getattr(handle, "endpoint", None)
            if not isinstance(endpoint, Endpoint):
                _fail(
                    f"backend '{decl.name}' serves an OpenAI endpoint in this config "
                    f"(openai_endpoint), but its generation handle's `endpoint` is {endpoint!r}, "
                    "not an rlcore.handles.Endpoint"
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
        self._assert_no_leaks(h, leaks, f"init:{role} when {why}")

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
        self._assert_no_leaks(h, leaks, f"concurrent inits ({what})")

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
        conditions = [*decl.openai_endpoint_when, *(c for x in (*decl.produces, *decl.needs) for c in x.when)]
        if not decl.roles & {Role.POLICY, Role.GENERATION} and not any(c.key == "colocated" for c in conditions):
            pytest.skip(
                f"covered by test_overlap_non_colocated: backend '{decl.name}' serves no role that "
                "placement.colocated puts on shared devices, and no condition of its declaration "
                "tests colocated"
            )
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
        if h.serving(Role.POLICY) is not None:
            # One engine start fewer: with a policy to refit from, test_refit_fed_round_trip
            # starts the generation refit-fed and makes every check of this test, and more.
            pytest.skip("covered by test_refit_fed_round_trip (a policy serves in this test)")
        config = h.config("generation.refit_fed=true")
        leaks = self._leaks()
        handle = self._start(h, Role.GENERATION, config)
        try:
            if self._uses_core_refit(h, Role.GENERATION):
                self._check_receiver(decl.name, handle)
        finally:
            h.shutdown(handle, what="generation handle")
        self._assert_no_leaks(harness, leaks, "refit-fed init:generation then shutdown()")

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
        pol_info, gen_info, common = self._round_trip_peers(h)
        pol_decl, gen_decl = pol_info.declaration, gen_info.declaration
        core_refit = self._uses_core_refit(h, Role.POLICY, Role.GENERATION)
        self._check_transports_run_here(h.declaration, common, core_refit)
        config = h.config(f"generation.refit_fed={'true' if refit_fed else 'false'}")
        leaks = self._leaks()
        policy = self._start(h, Role.POLICY, config)
        generation = self._start(h, Role.GENERATION, config)
        if core_refit:
            self._check_sender(pol_decl.name, policy)
            self._check_receiver(gen_decl.name, generation)
        trip = _RoundTrip(
            config=config, policy=policy, generation=generation, names=(pol_decl.name, gen_decl.name),
            refit=h.registry.hook("rlcore_refit", [pol_info, gen_info]), sessions=h.refit_sessions,
            refit_fed=refit_fed,
        )
        step = 0
        for transport in common:
            for _ in range(2):  # the second refit reuses the channel opened by the first
                self._refit_and_compare(trip, transport, step)
                step += 1
        h.shutdown(generation, what="generation handle")
        h.shutdown(policy, what="policy handle")
        self._assert_no_leaks(h, leaks, "refit round trip then shutdown()")

    def _round_trip_peers(self, h: Harness) -> tuple[Any, Any, list[Transport]]:
        """The policy and generation backends of the round trip and the transports they have
        in common (skips when the test has no pair, fails when they share no transport)."""
        decl = h.declaration
        if not decl.roles & {Role.POLICY, Role.GENERATION}:
            pytest.skip(f"not claimed: backend '{decl.name}' serves neither policy nor generation")
        pol_info, gen_info = h.serving(Role.POLICY), h.serving(Role.GENERATION)
        if pol_info is None or gen_info is None:
            lacking = "policy" if pol_info is None else "generation"
            pytest.skip(
                f"backend '{decl.name}' does not serve {lacking}; set peer_plugin to a "
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
        return pol_info, gen_info, common

    @staticmethod
    def _check_transports_run_here(decl: Any, common: list[Transport], core_refit: bool) -> None:
        """Fail when the backend under test declares a transport that cannot run here, or
        (the core's refit moving the bytes) one the core does not implement."""
        from rlcore.refit import transports as core_transports

        accelerator = detect_accelerator()
        everywhere = core_transports.implemented()
        here = core_transports.implemented(accelerator)
        # Every transport the backend under test declares, whether or not its peer has it.
        declared = set(common)
        if Role.POLICY in decl.roles:
            declared |= decl.send_transports
        if Role.GENERATION in decl.roles:
            declared |= decl.receive_transports
        for t in sorted(declared):
            needs = everywhere[t].accelerator if t in everywhere else None
            if needs is not None and needs != accelerator:
                _fail(
                    f"backend '{decl.name}' declares transport '{t}', which cannot run on this "
                    f"host ({accelerator}, no {needs.upper()}): declare only the transports the "
                    "backend can run where it is installed"
                )
        if core_refit and (missing := sorted(t for t in declared if t not in everywhere)):
            _fail(
                f"backend '{decl.name}': declared transport(s) {[str(t) for t in missing]} have no "
                f"implementation: the core's refit moves bytes over "
                f"{sorted(t.value for t in everywhere)} only, and neither plugin implements rlcore_refit"
            )
        if core_refit and (elsewhere := sorted(t for t in declared if t not in here)):
            _fail(
                f"backend '{decl.name}': declared transport(s) {[str(t) for t in elsewhere]} cannot "
                f"run on this host ({accelerator})"
            )

    def _refit_and_compare(self, trip: _RoundTrip, transport: Transport, step: int) -> None:
        """Train the policy, refit it into the generation over ``transport``, and require the
        generation to compute the policy's logprobs and hold its weights afterwards."""
        where = f"refit step {step} over {transport}"
        pol_name, gen_name = trip.names
        self._perturb(trip.policy, pol_name)
        before = None
        if not (trip.refit_fed and step == 0):  # a refit-fed engine has no weights yet
            before = self._logprob_error(trip.policy, trip.generation, trip.names)
            if before <= self.max_token_mult_prob_error:
                _fail(
                    f"before {where}: a train step of policy backend '{pol_name}' "
                    f"left its logprobs equal to generation backend '{gen_name}''s "
                    f"(token_mult_prob_error {before:.6f}), so the suite cannot see whether "
                    "refit moves weights: train_step must change the policy's weights"
                )
        self._refit_once(trip, transport, step, where)
        after = self._logprob_error(trip.policy, trip.generation, trip.names)
        if after > self.max_token_mult_prob_error:
            was = "" if before is None else f", {before:.4f} before the refit"
            _fail(
                f"after {where}, generation backend '{gen_name}' does not compute the "
                f"logprobs of policy backend '{pol_name}': token_mult_prob_error "
                f"{after:.4f} (max {self.max_token_mult_prob_error:g}{was}): the refit did "
                "not change what the engine computes to the weights it was sent"
            )
        self._assert_same_weights(trip.policy, trip.generation, where)
        self._check_versions(trip.generation, gen_name, step, f"after {where}")

    @staticmethod
    def _refit_once(trip: _RoundTrip, transport: Transport, step: int, where: str) -> None:
        """One refit through the ``rlcore_refit`` hook, bounded by ``refit.timeout_s``; fails
        unless it returns a RefitReport of ``transport``."""
        from rlcore.setup.runner import refit_context

        config, (pol_name, gen_name) = trip.config, trip.names
        ctx = refit_context(
            config, step=step, transport=str(transport), cancel=CancelToken(), sessions=trip.sessions,
        )
        out = call_bounded(
            lambda: trip.refit(policy=trip.policy, generation=trip.generation, ctx=ctx),
            config.refit.timeout_s + 10,
            f"refit {transport}",
        )
        if out.timed_out:
            _fail(
                f"backends '{pol_name}' -> '{gen_name}': {where} did not finish "
                f"within refit.timeout_s={config.refit.timeout_s:g}s"
            )
        if out.error is not None:
            _fail(
                f"backends '{pol_name}' -> '{gen_name}': {where} (a declared "
                f"transport) raised {type(out.error).__name__}: {out.error}"
            )
        report = out.value
        if not isinstance(report, RefitReport) or report.transport != str(transport):
            _fail(f"{where} returned {report!r}; expected a RefitReport for transport {transport}")

    def _check_versions(self, generation: Any, name: str, version: int, when: str) -> bool:
        """The weight versions a generation reports (:mod:`rlcore.handles`, "Weight
        versions"), where it reports them, are ``version``: every engine's
        (``weight_versions()``) and every token's of a sample (``versions``). Returns
        whether it reported any."""
        guarded = GuardedGeneration(generation, name)
        try:
            engines = guarded.weight_versions()
            groups = guarded.generate(self._prompts()[:2], SamplingParams(2, 4, 1.0, 17 + version))
        except ProtocolError as err:
            _fail(f"{when}: {err}")
        if engines is not None and set(engines) != {version}:
            _fail(
                f"{when}, generation backend '{name}' reports weight versions {engines} for its "
                f"engines; expected {version} from every engine (0 before any refit, t after the "
                "refit of step t: rlcore.handles)"
            )
        tokens = sorted({v for g in groups for sample in g for v in sample.get("versions", ())})
        if tokens and tokens != [version]:
            _fail(
                f"{when}, generation backend '{name}' sampled tokens of weight versions {tokens}; "
                f"expected {version} only (0 before any refit, t after the refit of step t: "
                "rlcore.handles)"
            )
        return engines is not None or bool(tokens)

    def _logprob_error(self, policy: Any, generation: Any, names: tuple[str, str]) -> float:
        """token_mult_prob_error of generation vs policy logprobs on the probe batch
        (both results checked against the protocol first)."""
        batch = [(list(p), list(c)) for p, c in self.probe_batch]
        try:
            lp_p = check_logprobs(policy.logprobs(batch), batch, Caller(names[0], "policy", "logprobs"))
            lp_g = check_logprobs(
                generation.logprobs(batch), batch, Caller(names[1], "generation", "logprobs")
            )
        except ProtocolError as err:
            _fail(str(err))
        return _mult_err(lp_g, lp_p)

    def _perturb(self, policy: Any, name: str) -> None:
        """One training step with a large learning rate, so that a refit has something
        new to carry (a receiver that ignores it is then caught)."""
        if not isinstance(policy, PolicyHandle):
            _fail(
                f"policy handle of '{name}' does not implement rlcore.handles.PolicyHandle "
                "(logprobs, train_step)"
            )
        batch = [(list(p), list(c)) for p, c in self.probe_batch]
        advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(batch))]
        try:
            old = check_logprobs(policy.logprobs(batch), batch, Caller(name, "policy", "logprobs"))
        except ProtocolError as err:
            _fail(str(err))
        policy.train_step(batch, advantages, old, clip_eps=0.2, lr=0.05)

    def _assert_same_weights(self, policy: Any, generation: Any, where: str) -> None:
        """Exact weights when both handles export them (logprobs are compared always)."""
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

    # -- training: the policy learns, forgets what it should, exports what it declares ---------

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_train_step_semantics(self, harness: Harness, dtype: str) -> None:
        """In every dtype the backend declares (float32 when it declares none): at the
        checkpoint's weights a batch of 37 rows gives the whole batch's loss and gradient
        norm (micro-batches averaged by token, none dropped); a step
        moves each completion's logprob in the direction of its advantage and lowers the
        loss on its batch; at ``lr=0`` weights stay and the same batch gives the same
        gradient whatever came before; every reported metric is the contract's; the
        refit export is the checkpoint's Hugging Face weights in that dtype."""
        from rlcore.config import cache_dir
        from rlcore.models.tiny import ensure_model
        from rlcore.refit.hf_specs import hf_weight_specs
        from rlcore.testing import training
        from rlcore.testing.peers import ReferencePolicyWorker

        decl = harness.declaration
        self._role_or_skip(harness, Role.POLICY.value)
        declared = decl.dtypes or frozenset({"float32"})
        if dtype not in declared:
            pytest.skip(f"not claimed: backend '{decl.name}' does not declare dtype {dtype}")
        config = harness.config(f"model.dtype={dtype}")
        policy = self._start(harness, Role.POLICY, config)
        who = f"policy backend '{decl.name}'"
        try:
            if self._uses_core_refit(harness, Role.POLICY):
                self._check_sender(decl.name, policy)
                model_dir = ensure_model(config.model, cache_dir(config))
                received = training_capture(self, harness, policy, config)
                training.check_export(
                    received, policy.weight_specs(), hf_weight_specs(model_dir, dtype), who, dtype
                )
            reference = ReferencePolicyWorker(0, 1, str(ensure_model(config.model, cache_dir(config))))
            training.check_whole_batch(policy, who, dtype, reference)  # at the checkpoint's weights
            training.check_learning_step(policy, who, dtype)
            training.check_step_is_memoryless(policy, who, dtype)
        except training.TrainingFailure as err:
            _fail(str(err))
        finally:
            harness.shutdown(policy, what="policy handle")

    def test_checkpoint_round_trip(self, harness: Harness, tmp_path: Path) -> None:
        """A policy that declares ``CheckpointSupport`` saves and loads its whole training
        state: after ``load_checkpoint`` the same steps give exactly the same losses,
        gradient norms and logprobs as right after the save (contract 2.2)."""
        from rlcore.testing import training

        decl = harness.declaration
        claimed = decl.checkpoint is not None
        self._check_checkpoints(harness, claimed, "CheckpointSupport", Checkpointable,
                                training.check_checkpoint_round_trip, tmp_path, with_export=True)

    def test_staged_checkpoint(self, harness: Harness, tmp_path: Path) -> None:
        """A policy that declares ``CheckpointSupport(staged=True)`` writes, in the background,
        the state it had at ``stage_checkpoint`` while it trains on, and says when it is
        written without waiting (contract 2.3)."""
        from rlcore.testing import training

        decl = harness.declaration
        claimed = decl.checkpoint is not None and decl.checkpoint.staged
        self._check_checkpoints(harness, claimed, "CheckpointSupport(staged=True)", StagedCheckpointable,
                                training.check_staged_checkpoint, tmp_path)

    def test_loss_options(self, harness: Harness) -> None:
        """A policy that declares ``loss_options`` (contract 2.5) applies each of them as
        :class:`rlcore.handles.LossOptions` says: at ``lr=0`` the loss and clip fraction it
        reports are the contract's formula of its own logprobs
        (:func:`rlcore.testing.training.check_loss_options`)."""
        from rlcore.testing import training

        decl = harness.declaration
        self._role_or_skip(harness, Role.POLICY.value)
        if not decl.loss_options:
            pytest.skip(f"not claimed: backend '{decl.name}' declares no loss_options")
        policy = self._start(harness, Role.POLICY, harness.config("model.dtype=float32"))
        try:
            training.check_loss_options(policy, f"policy backend '{decl.name}'", decl.loss_options)
        except training.TrainingFailure as err:
            _fail(str(err))
        finally:
            harness.shutdown(policy, what="policy handle")

    def test_adapters(self, harness: Harness) -> None:
        """A policy that declares ``trains_adapters`` (contract 2.4), run with
        ``policy.options.lora``: its refit carries merged weights under the base names (the
        base model itself before any step), a step moves adapted weights only, and the
        merged export computes the policy's logprobs (:func:`rlcore.testing.training.check_adapters`)."""
        from rlcore.config import cache_dir
        from rlcore.models.tiny import ensure_model
        from rlcore.testing import training
        from rlcore.testing.reference import hf_model, reference_logprobs

        decl = harness.declaration
        self._role_or_skip(harness, Role.POLICY.value)
        if not decl.trains_adapters:
            pytest.skip(f"not claimed: backend '{decl.name}' does not declare trains_adapters")
        if not self._uses_core_refit(harness, Role.POLICY):
            pytest.skip(f"backend '{decl.name}' refits through its own path: its merged export is checked there")
        rank = 4
        config = harness.config(f"policy.options.lora.rank={rank}", "model.dtype=float32")
        model_dir = ensure_model(config.model, cache_dir(config))
        base = hf_model(model_dir).state_dict()
        policy = self._start(harness, Role.POLICY, config)
        try:
            training.check_adapters(
                policy, f"policy backend '{decl.name}'",
                lambda: training_capture(self, harness, policy, config), base,
                lambda state: reference_logprobs(hf_model(model_dir, state), training.PROBE_BATCH), rank=rank,
            )
        except training.TrainingFailure as err:
            _fail(str(err))
        finally:
            harness.shutdown(policy, what="policy handle")

    def test_serves_adapters(self, harness: Harness) -> None:
        """A generation that declares ``takes_adapters`` (contract 2.6), started with
        :attr:`~rlcore.context.InitContext.adapters` (rank 4 on attention, MLP and the output
        head): it computes with the checkpoint's base weights before any refit, and after
        each adapter refit (the core's, from :class:`rlcore.testing.adapters.PeftAdapters`)
        with base + those adapters, reporting that refit's step as its weight version."""
        from rlcore.config import cache_dir
        from rlcore.handles import AdapterReceiver, WeightVersioned
        from rlcore.models.tiny import ensure_model
        from rlcore.refit.adapters import refit_adapters
        from rlcore.refit.sessions import RefitSessions
        from rlcore.setup.runner import refit_context
        from rlcore.testing.adapters import CHECKED, PeftAdapters

        decl = harness.declaration
        self._role_or_skip(harness, Role.GENERATION.value)
        if not decl.takes_adapters:
            pytest.skip(f"not claimed: backend '{decl.name}' does not declare takes_adapters")
        config = harness.config("model.dtype=float32")
        source = PeftAdapters(ensure_model(config.model, cache_dir(config)))
        gen = self._start(harness, Role.GENERATION, config, adapters=CHECKED)
        who = f"generation backend '{decl.name}'"
        batch = [(list(p), list(c)) for p, c in self.probe_batch]
        try:
            if not isinstance(gen, AdapterReceiver):
                _fail(f"{who} declares takes_adapters but its handle ({type(gen).__name__}) does not "
                      "implement rlcore.handles.AdapterReceiver (load_adapter)")
            checks = [("before any adapter refit (the checkpoint's base weights)", 0, None)]
            checks += [(f"after the adapter refit of step {step}", step, step) for step in (1, 2)]
            for when, step, seed in checks:
                if seed is not None:
                    source.set_adapters(seed)
                    ctx = refit_context(
                        config, step=step, transport="disk", cancel=harness.cancel,
                        sessions=RefitSessions(), content="adapters",
                    )
                    refit_adapters(source, gen, ctx)
                err = _mult_err(gen.logprobs(batch), source.logprobs(batch, base=seed is None))
                if err > self.max_token_mult_prob_error:
                    _fail(f"{who} {when}: its logprobs differ from peft's with the same base and adapters "
                          f"(token_mult_prob_error {err:.6f}, max {self.max_token_mult_prob_error:g})")
                if isinstance(gen, WeightVersioned) and set(gen.weight_versions()) != {step}:
                    _fail(f"{who} {when}: reports weight versions {gen.weight_versions()}, not {step}")
        finally:
            harness.shutdown(gen, what="generation handle")

    def _check_checkpoints(
        self, harness: Harness, claimed: bool, declared: str, protocol: type, check: Any, tmp_path: Path,
        *, with_export: bool = False,
    ) -> None:
        """Start the policy and run ``check`` on it where it declares ``declared`` (else skip):
        its handle must implement ``protocol``. ``with_export``: ``check`` also gets a
        capture of the policy's core refit, where it refits through the core."""
        from rlcore.testing import training

        decl = harness.declaration
        self._role_or_skip(harness, Role.POLICY.value)
        if not claimed:
            pytest.skip(f"not claimed: backend '{decl.name}' does not declare {declared}")
        config = harness.config()
        policy = self._start(harness, Role.POLICY, config)
        try:
            if not isinstance(policy, protocol):
                _fail(
                    f"policy backend '{decl.name}' declares {declared} but its handle "
                    f"({type(policy).__name__}) does not implement rlcore.handles.{protocol.__name__}"
                )
            extra = {}
            if with_export and self._uses_core_refit(harness, Role.POLICY):
                extra["capture"] = lambda: training_capture(self, harness, policy, config)
            check(policy, f"policy backend '{decl.name}'", tmp_path, **extra)
        except training.TrainingFailure as err:
            _fail(str(err))
        finally:
            harness.shutdown(policy, what="policy handle")

    # -- the handle protocols: what the run loop calls --------------------------------------------

    def _engine(self, e: Engines, role: Role) -> Any:
        """The class's started ``role`` (started on first use; a failed start fails every user)."""
        if role in e.failures:
            _fail(e.failures[role])
        if role not in e.handles:
            try:
                handle = self._start(e.harness, role, e.config)
            except pytest.fail.Exception as err:
                e.failures[role] = f"init:{role.value} failed: {err}"
                raise
            proto = _PROTOCOLS[role]
            if not isinstance(handle, proto):
                info = e.harness.serving(role)
                name = info.declaration.name if info and info.declaration else "?"
                e.failures[role] = (
                    f"{role.value} handle of backend '{name}' ({type(handle).__name__}) does not "
                    f"implement rlcore.handles.{proto.__name__}"
                )
                e.handles[role] = handle
                _fail(e.failures[role])
            e.handles[role] = handle
        return e.handles[role]

    @staticmethod
    def _claimed(e: Engines, *roles: Role) -> list[Role]:
        decl = e.harness.declaration
        mine = [r for r in roles if r in decl.roles]
        if not mine:
            pytest.skip(
                f"not claimed: backend '{decl.name}' serves none of {[r.value for r in roles]}"
            )
        return mine

    def _prompts(self) -> list[list[int]]:
        return [list(p) for p, _ in self.probe_batch]

    def _generate(self, e: Engines, params: SamplingParams) -> list:
        """``generate()`` of the generation under test on the probe prompts, checked by
        :func:`rlcore.app.guards.check_samples` (cached per ``params``)."""
        key = f"generate:{params}"
        if key not in e.cache:
            gen = self._engine(e, Role.GENERATION)
            prompts = self._prompts()
            out = gen.generate(prompts, params)
            who = Caller(e.harness.declaration.name, "generation", "generate")
            try:
                e.cache[key] = check_samples(out, len(prompts), params.n, params.max_tokens, who, e.eos_ids())
            except ProtocolError as err:
                _fail(f"{err} (temperature={params.temperature:g}, seed={params.seed})")
        return list(e.cache[key])

    def test_logprobs_shape(self, engines: Engines) -> None:
        """``logprobs()`` of the policy and generation it serves: one row per pair, one
        finite logprob (<= 0) per completion token (:func:`rlcore.app.guards.check_logprobs`)."""
        batch = [(list(p), list(c)) for p, c in self.probe_batch]
        for role in self._claimed(engines, Role.POLICY, Role.GENERATION):
            handle = self._engine(engines, role)
            who = Caller(engines.harness.declaration.name, role.value, "logprobs")
            try:
                check_logprobs(handle.logprobs(batch), batch, who)
            except ProtocolError as err:
                _fail(str(err))

    def test_logprobs_agree(self, engines: Engines) -> None:
        """Policy and generation started from the same checkpoint give the same logprobs
        of the same tokens (both at temperature 1)."""
        self._claimed(engines, Role.POLICY, Role.GENERATION)
        h = engines.harness
        pol_info, gen_info = h.serving(Role.POLICY), h.serving(Role.GENERATION)
        if pol_info is None or gen_info is None:
            pytest.skip("no peer serves the role this backend lacks (set peer_plugin)")
        names = (pol_info.declaration.name, gen_info.declaration.name)  # type: ignore[union-attr]
        # The backend under test first: a broken one fails before a peer is started.
        first = Role.POLICY if pol_info is h.info else Role.GENERATION
        self._engine(engines, first)
        policy = self._engine(engines, Role.POLICY)
        generation = self._engine(engines, Role.GENERATION)
        err = self._logprob_error(policy, generation, names)
        if err > self.max_token_mult_prob_error:
            _fail(
                f"with the same checkpoint, generation backend '{names[1]}' and policy backend "
                f"'{names[0]}' give different logprobs of the same tokens: token_mult_prob_error "
                f"{err:.6f} (max {self.max_token_mult_prob_error:g}); both must be log_softmax of "
                "the raw logits at temperature 1 (rlcore.handles)"
            )

    def test_generate_samples(self, engines: Engines) -> None:
        """``generate()``: n samples per prompt of 1..max_tokens token ids, one logprob per
        token, nothing after EOS; greedy (temperature 0) samples of a prompt are equal."""
        self._claimed(engines, Role.GENERATION)
        n, max_tokens, temperature = self.eos_probe
        self._generate(engines, SamplingParams(n, max_tokens, temperature, 1234))
        greedy = self._generate(engines, SamplingParams(2, 8, 0.0, 5))
        for i, group in enumerate(greedy):
            if group[0]["token_ids"] != group[1]["token_ids"]:
                _fail(
                    f"generation backend '{engines.harness.declaration.name}': generate() at "
                    f"temperature 0 (greedy) gave prompt {i} two different samples"
                )

    def test_generate_stops_at_eos(self, engines: Engines) -> None:
        """Sampling stops after EOS, which is the sample's last token (with its logprob);
        a sample shorter than max_tokens ends with EOS; some sample reaches EOS."""
        self._claimed(engines, Role.GENERATION)
        name = engines.harness.declaration.name
        n, max_tokens, temperature = self.eos_probe
        groups = self._generate(engines, SamplingParams(n, max_tokens, temperature, 1234))
        eos = engines.eos_ids()
        ended = 0
        for i, group in enumerate(groups):
            for j, sample in enumerate(group):
                ids = sample["token_ids"]
                if ids[-1] in eos:
                    ended += 1
                elif len(ids) < max_tokens:
                    _fail(
                        f"generation backend '{name}' broke the EOS rule of generate(): prompt {i} "
                        f"sample {j} stopped after {len(ids)} < max_tokens={max_tokens} tokens "
                        f"without ending with EOS (ids {sorted(eos)}); EOS is kept as the last token"
                    )
        if not ended:
            _fail(
                f"generation backend '{name}' broke the EOS rule of generate(): none of "
                f"{len(groups) * n} samples (temperature {temperature:g}, up to {max_tokens} tokens) "
                f"ended with EOS (ids {sorted(eos)}); the engine must stop on EOS and keep it as "
                "the last token (tune eos_probe if your model rarely ends)"
            )

    def test_weight_versions_before_refit(self, engines: Engines) -> None:
        """An engine never refitted holds weight version 0, and so does every token it
        samples, where it reports them (``weight_versions()``, a sample's ``versions``)."""
        self._claimed(engines, Role.GENERATION)
        name = engines.harness.declaration.name
        if not self._check_versions(self._engine(engines, Role.GENERATION), name, 0, "before any refit"):
            pytest.skip(f"not claimed: generation backend '{name}' reports no weight versions")

    def test_generate_is_seeded(self, engines: Engines) -> None:
        """Same seed, same samples; different seeds, different samples (temperature 1)."""
        self._claimed(engines, Role.GENERATION)
        name = engines.harness.declaration.name

        def ids(seed: int) -> list[list[list[int]]]:
            out = self._generate(engines, SamplingParams(2, 8, 1.0, seed))
            return [[s["token_ids"] for s in g] for g in out]

        first = ids(7)
        engines.cache = {k: v for k, v in engines.cache.items() if not k.startswith("generate:")}
        again, other = ids(7), ids(8)
        if first != again:
            _fail(
                f"generation backend '{name}' broke the seeding rule of generate(): two calls "
                "with seed=7 gave different samples"
            )
        if first == other:
            _fail(
                f"generation backend '{name}' broke the seeding rule of generate(): seeds 7 and 8 "
                "gave identical samples at temperature 1 (the seed is ignored)"
            )

    def test_generate_logprobs_at_temperature_1(self, engines: Engines) -> None:
        """Sampled at a temperature != 1, ``generate()`` still reports logprobs at
        temperature 1: those the policy (same checkpoint) and the engine's own
        ``logprobs()`` give the sampled tokens."""
        self._claimed(engines, Role.GENERATION)
        h = engines.harness
        name = h.declaration.name
        t = self.sample_temperature
        groups = self._generate(engines, SamplingParams(2, 12, t, 99))
        pairs = [(p, s["token_ids"]) for p, g in zip(self._prompts(), groups, strict=True) for s in g]
        got = [s["logprobs"] for g in groups for s in g]
        refs: list[tuple[str, Any, str]] = [("its own logprobs()", self._engine(engines, Role.GENERATION), "generation")]
        pol_info = h.serving(Role.POLICY)
        if pol_info is not None:
            refs.insert(0, (f"policy backend '{pol_info.declaration.name}'", self._engine(engines, Role.POLICY), "policy"))  # type: ignore[union-attr]
        for what, handle, role in refs:
            try:
                want = check_logprobs(handle.logprobs(pairs), pairs, Caller(name, role, "logprobs"))
            except ProtocolError as err:
                _fail(str(err))
            err = _mult_err(got, want)
            if err > self.max_token_mult_prob_error:
                _fail(
                    f"generation backend '{name}' broke the logprob convention of generate(): "
                    f"sampled at temperature {t:g}, its logprobs are not {what}'s of the same "
                    f"tokens (token_mult_prob_error {err:.4f}, max {self.max_token_mult_prob_error:g}); "
                    "logprobs are log_softmax of the raw logits at temperature 1, never scaled by "
                    "the sampling temperature (rlcore.handles)"
                )

    def test_env_collect_rollouts(self, engines: Engines) -> None:
        """``collect_rollouts()``: ``prompts`` groups of ``samples_per_prompt`` rollouts with
        prompt ids, token ids, one logprob per token and a finite reward
        (:func:`rlcore.app.guards.check_rollouts`); the same step gives the same prompts."""
        self._claimed(engines, Role.ENV)
        name = engines.harness.declaration.name
        env = self._engine(engines, Role.ENV)
        request = RolloutRequest(
            step=1, prompts=2, samples_per_prompt=2, max_new_tokens=8, temperature=1.0, seed=3,
            generation=_LazyGeneration(lambda: self._engine(engines, Role.GENERATION)),  # type: ignore[arg-type]
            tokenizer=engines.tokenizer(),
        )
        who = Caller(name, "env", "collect_rollouts")
        try:
            first = check_rollouts(env.collect_rollouts(request), request, who)
            again = check_rollouts(env.collect_rollouts(request), request, who)
        except ProtocolError as err:
            _fail(str(err))
        prompts = [[r["prompt_ids"] for r in g] for g in first]
        if prompts != [[r["prompt_ids"] for r in g] for g in again]:
            _fail(
                f"env backend '{name}' broke the contract of collect_rollouts(): two calls for "
                "step 1 gave different prompts (a step's prompts are deterministic)"
            )

"""Tests of rlcore.setup.registry: plugin discovery, validation, allowlist and selection.

The first group installs small plugin distributions with pip (offline, into a
temporary ``--target`` directory) and loads them in a subprocess through the
real entry-point machinery. The rest register plugin objects in-process.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlcore.declarations import CONTRACT_VERSION, BackendDeclaration, Role, Transport
from rlcore.errors import BackendNotFoundError
from rlcore.hookspecs import hookimpl
from rlcore.setup import builtin, registry
from rlcore.setup.registry import (
    ALLOWLIST_ENV,
    ENTRY_POINT_GROUP,
    PluginInfo,
    Registry,
    allowlist,
    load_registry,
)

REPO = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------
# Real distributions, installed with pip
# --------------------------------------------------------------------------

_DEMO = """
from rlcore.declarations import BackendDeclaration, Role, Transport
from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_declare_backend():
    return BackendDeclaration(
        name="demo",
        roles={Role.POLICY},
        send_transports={Transport.DISK},
        description="demo backend installed by rlcore's tests",
    )


@hookimpl
def rlcore_init_policy(ctx):
    return {"backend": "demo", "ctx": ctx}
"""

_TIMING = """
from rlcore.hookspecs import hookimpl

CALLS = []


@hookimpl(wrapper=True)
def rlcore_init_policy(ctx):
    CALLS.append("before")
    result = yield
    CALLS.append("after")
    return result
"""

_BAD_ARG = """
from rlcore.declarations import BackendDeclaration, Role, Transport
from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_declare_backend():
    return BackendDeclaration(name="bad-arg", roles={Role.POLICY}, send_transports={"disk"})


@hookimpl
def rlcore_init_policy(ctx, gpus):
    return None
"""

_BAD_NAME = """
from rlcore.declarations import BackendDeclaration, Role
from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_declare_backend():
    return BackendDeclaration(name="bad-name", roles={Role.POLICY}, send_transports={"disk"})


@hookimpl
def rlcore_init_polcy(ctx):
    return None
"""

_CONTRADICTORY = """
from rlcore.declarations import BackendDeclaration, Role
from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_declare_backend():
    # refit_fed only makes sense for a generation backend
    return BackendDeclaration(
        name="contradictory", roles={Role.POLICY}, send_transports={"disk"}, refit_fed=True
    )
"""

_TWIN = """
from rlcore.declarations import BackendDeclaration, Role
from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_declare_backend():
    return BackendDeclaration(name="twin", roles={Role.POLICY}, send_transports={"disk"})


@hookimpl
def rlcore_init_policy(ctx):
    return "twin"
"""

# Declares the backend name of rlcore-demo's 'demo_copy': two installed plugins, one name.
_DUP = """
from rlcore.declarations import BackendDeclaration, Role
from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_declare_backend():
    return BackendDeclaration(name="twin", roles={Role.GENERATION}, receive_transports={"disk"})


@hookimpl
def rlcore_init_generation(ctx):
    return "dup"
"""

#: distribution name -> {entry-point name: (module path, module source)}
DISTRIBUTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "rlcore-demo": {
        "demo": ("rlcore_demo.plugin", _DEMO),
        "demo_timing": ("rlcore_demo.timing", _TIMING),
        "demo_copy": ("rlcore_demo.copy", _TWIN),
    },
    "rlcore-broken": {
        "broken_import": ("rlcore_broken.missing", "import rlcore_no_such_engine  # noqa\n"),
        "broken_syntax": ("rlcore_broken.syntax", "def oops(:\n    pass\n"),
    },
    "rlcore-bad-hooks": {
        "bad_arg": ("rlcore_bad_hooks.bad_arg", _BAD_ARG),
        "bad_name": ("rlcore_bad_hooks.bad_name", _BAD_NAME),
    },
    "rlcore-contradictory": {"contradictory": ("rlcore_contradictory.plugin", _CONTRADICTORY)},
    "rlcore-demo-dup": {"demo_dup": ("rlcore_demo_dup.plugin", _DUP)},
}


def _write_distribution(root: Path, dist: str, eps: dict[str, tuple[str, str]]) -> Path:
    package = dist.replace("-", "_")
    src = root / dist
    (src / package).mkdir(parents=True)
    (src / package / "__init__.py").write_text("")
    entry_lines = []
    for ep_name, (module, source) in eps.items():
        entry_lines.append(f'{ep_name} = "{module}"')
        (src / package / (module.rsplit(".", 1)[1] + ".py")).write_text(source.lstrip())
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "0.1.0"

            [tool.setuptools]
            packages = ["{package}"]

            [project.entry-points."{ENTRY_POINT_GROUP}"]
            """
        )
        + "\n".join(entry_lines)
        + "\n"
    )
    return src


@pytest.fixture(scope="session")
def installed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the test distributions, installed by pip (once per session)."""
    root = tmp_path_factory.mktemp("plugin_dists")
    sources = [_write_distribution(root, d, eps) for d, eps in DISTRIBUTIONS.items()]
    site = root / "site"
    cmd = [
        sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
        "--no-index", "--no-compile", "--disable-pip-version-check", "--quiet",
        "--target", str(site), *map(str, sources),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    return site


def _run_python(code: str, site: Path | None, env_extra: dict[str, str] | None = None):
    env = {k: v for k, v in os.environ.items() if k != ALLOWLIST_ENV}
    paths = ([str(site)] if site else []) + [str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


_LOAD_SCRIPT = """
import json, sys
from rlcore.setup.registry import load_registry

reg = load_registry(allow=json.loads(sys.argv[1]) if len(sys.argv) > 1 else None)
out = {
    "backends": {
        n: {
            "name": i.name,
            "distribution": i.distribution,
            "version": i.version,
            "declaration": i.declaration.to_dict(),
        }
        for n, i in reg.backends.items()
    },
    "wrappers": [{"name": w.name, "distribution": w.distribution} for w in reg.wrappers],
    "failures": [
        {"name": f.name, "distribution": f.distribution, "stage": f.stage, "message": f.message}
        for f in reg.failures
    ],
    "disabled": reg.disabled,
}
if "demo" in reg.backends:
    handle = reg.hook("rlcore_init_policy", [reg.backend_for("policy", "demo")])(ctx="CTX")
    calls = []
    if any(w.name == "demo_timing" for w in reg.wrappers):
        import rlcore_demo.timing
        calls = rlcore_demo.timing.CALLS
    out["init"] = {"handle": handle, "wrapper_calls": calls}
print(json.dumps(out))
"""


def _load_in_subprocess(
    site: Path, allow: list[str] | None = None, env: dict[str, str] | None = None
):
    code = _LOAD_SCRIPT
    if allow is not None:
        code = f"import sys; sys.argv[1:] = [{json.dumps(json.dumps(allow))}]\n" + code
    proc = _run_python(code, site, env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


@pytest.fixture(scope="session")
def installed_registry(installed_site: Path) -> tuple[dict[str, Any], str]:
    return _load_in_subprocess(installed_site)


# Plugins installed in the environment (the repo's own) may sit beside the test ones.
TEST_DISTRIBUTIONS = {"rlcore-demo", "rlcore-broken", "rlcore-bad-hooks", "rlcore-contradictory", "rlcore-demo-dup"}
TEST_PLUGINS = {"demo", "demo_timing", "demo_copy", "broken_import", "broken_syntax", "bad_arg", "bad_name", "contradictory", "demo_dup"}


def _test_backends(out: dict[str, Any]) -> list[str]:
    return [n for n, b in out["backends"].items() if b["distribution"] in TEST_DISTRIBUTIONS]


def test_installed_plugin_is_discovered(installed_registry: tuple[dict[str, Any], str]) -> None:
    out, _ = installed_registry
    assert _test_backends(out) == ["demo"]  # 'twin' is declared twice: neither plugin has it
    demo = out["backends"]["demo"]
    assert demo["name"] == "demo"
    assert demo["distribution"] == "rlcore-demo"
    assert demo["version"] == "0.1.0"
    assert demo["declaration"]["roles"] == ["policy"]
    assert demo["declaration"]["send_transports"] == ["disk"]
    assert out["wrappers"] == [{"name": "demo_timing", "distribution": "rlcore-demo"}]
    assert out["disabled"] == []
    # The selected backend ran and the installed wrapper plugin wrapped the call.
    assert out["init"] == {
        "handle": {"backend": "demo", "ctx": "CTX"},
        "wrapper_calls": ["before", "after"],
    }


@pytest.mark.parametrize(
    ("name", "distribution", "stage", "expect"),
    [
        ("broken_import", "rlcore-broken", "import", "ModuleNotFoundError"),
        ("broken_syntax", "rlcore-broken", "import", "SyntaxError"),
        ("bad_arg", "rlcore-bad-hooks", "validate", "gpus"),
        ("bad_name", "rlcore-bad-hooks", "validate", "did you mean 'rlcore_init_policy'"),
        ("contradictory", "rlcore-contradictory", "declare", "refit_fed"),
        ("demo_dup", "rlcore-demo-dup", "duplicate", "plugin 'demo_copy' (distribution rlcore-demo 0.1.0 at "),
    ],
    ids=["broken_import", "broken_syntax", "bad_arg", "bad_name", "contradictory", "demo_dup"],
)
def test_installed_broken_plugin_is_reported(
    installed_registry: tuple[dict[str, Any], str],
    name: str,
    distribution: str,
    stage: str,
    expect: str,
) -> None:
    out, stderr = installed_registry
    failures = {f["name"]: f for f in out["failures"]}
    assert failures[name]["distribution"] == distribution
    assert failures[name]["stage"] == stage
    message = failures[name]["message"]
    assert f"'{name}'" in message and distribution in message
    assert expect in message
    assert name in stderr  # logged as a warning
    assert "demo" in out["backends"]  # the good plugin still loads


def test_installed_plugins_allowlist(installed_site: Path) -> None:
    """Config allowlist and $RLCORE_PLUGINS intersect; the rest is listed as disabled."""
    out, _ = _load_in_subprocess(
        installed_site,
        allow=["demo", "demo_timing", "bad_arg"],
        env={ALLOWLIST_ENV: "demo, bad_arg,contradictory"},
    )
    assert _test_backends(out) == ["demo"]
    assert out["wrappers"] == []
    assert [f["name"] for f in out["failures"]] == ["bad_arg"]
    assert [d for d in out["disabled"] if d in TEST_PLUGINS] == [
        "bad_name", "broken_import", "broken_syntax", "contradictory", "demo_copy", "demo_dup",
        "demo_timing",
    ]  # fmt: skip
    assert out["init"]["wrapper_calls"] == []


def test_cli_plugins_json(installed_site: Path) -> None:
    code = "import sys, rlcore.app.cli; sys.exit(rlcore.app.cli.main(['plugins', '--json']))"
    proc = _run_python(code, installed_site)
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    backends = {b["name"]: b for b in data["backends"]}
    assert backends["demo"]["distribution"] == "rlcore-demo"
    assert backends["demo"]["declaration"]["roles"] == ["policy"]
    # wrappers and failures are named by plugin (entry-point) name: "plugin" or "name"
    assert [w.get("plugin", w.get("name")) for w in data["wrappers"]] == ["demo_timing"]
    stages = {f.get("plugin", f.get("name")): f["stage"] for f in data["failures"]}
    assert stages["broken_import"] == "import"
    assert stages["demo_dup"] == "duplicate"
    # one failure refuses backend 'twin' for both installed plugins that declare it
    [twin] = [f for f in data["failures"] if f.get("backend") == "twin"]
    assert sorted(twin["plugins"]) == ["demo_copy", "demo_dup"] and "twin" not in backends


# --------------------------------------------------------------------------
# In-process plugins
# --------------------------------------------------------------------------


def _declaration(name: str, *roles: Role) -> BackendDeclaration:
    roles = roles or (Role.POLICY,)
    return BackendDeclaration(
        name=name,
        roles=frozenset(roles),
        send_transports={Transport.DISK} if Role.POLICY in roles else frozenset(),
        receive_transports={Transport.DISK} if Role.GENERATION in roles else frozenset(),
    )


class Backend:
    """A backend plugin serving the roles of its declaration; records init calls."""

    def __init__(self, name: str, *roles: Role) -> None:
        self.decl = _declaration(name, *roles)
        self.calls: list[str] = []

    @hookimpl
    def rlcore_declare_backend(self) -> BackendDeclaration:
        return self.decl

    @hookimpl
    def rlcore_init_policy(self, ctx: Any) -> str:
        self.calls.append("policy")
        return f"{self.decl.name}:policy"

    @hookimpl
    def rlcore_init_generation(self, ctx: Any) -> str:
        self.calls.append("generation")
        return f"{self.decl.name}:generation"


class Wrapper:
    """A wrapper plugin that records every init_policy call it wraps."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    @hookimpl(wrapper=True)
    def rlcore_init_policy(self, ctx: Any):  # noqa: ANN201 - generator
        self.seen.append(("before", ctx))
        result = yield
        self.seen.append(("after", result))
        return result


class BadArgument(Backend):
    @hookimpl
    def rlcore_init_policy(self, ctx: Any, gpus: int) -> str:  # type: ignore[override]
        return "never"


class UnknownHook:
    @hookimpl
    def rlcore_init_polcy(self, ctx: Any) -> None:
        return None


class OptionalUnknownHook:
    @hookimpl(optionalhook=True)
    def rlcore_some_future_hook(self) -> None:
        return None


class DeclareRaises:
    @hookimpl
    def rlcore_declare_backend(self) -> BackendDeclaration:
        raise RuntimeError("engine config missing")


class DeclareWrongType:
    @hookimpl
    def rlcore_declare_backend(self) -> dict[str, str]:
        return {"name": "dicty"}


class Contradictory:
    @hookimpl
    def rlcore_declare_backend(self) -> BackendDeclaration:
        return BackendDeclaration(
            name="contra", roles={Role.POLICY}, send_transports={"disk"}, openai_endpoint=True
        )


class PlainInitWithoutDeclaration:
    @hookimpl
    def rlcore_init_policy(self, ctx: Any) -> str:
        return "hijack"


@pytest.fixture
def reg() -> Registry:
    return load_registry(entry_points=False)


def test_builtin_is_core_not_backend_or_wrapper(reg: Registry) -> None:
    assert [i.name for i in reg.core] == [builtin.PLUGIN_NAME]
    assert reg.core[0].plugin is builtin
    assert reg.backends == {} and reg.wrappers == [] and reg.failures == []
    impls = reg.hook("rlcore_publish", []).get_hookimpls()
    assert [i.plugin for i in impls] == [builtin]


def test_register_backend_and_wrapper(reg: Registry) -> None:
    backend, wrapper = Backend("alpha"), Wrapper()
    info = reg.register(backend, "alpha-plugin", "rlcore-alpha", "1.2")
    winfo = reg.register(wrapper, "timing")
    assert info == PluginInfo("alpha-plugin", "rlcore-alpha", "1.2", backend.decl, backend)
    assert info.is_backend and winfo is not None and not winfo.is_backend
    assert reg.backends == {"alpha": info}
    assert reg.wrappers == [winfo]
    assert reg.declarations() == {"alpha": backend.decl}
    json.dumps(reg.to_dict())  # JSON-ready


def test_register_twice_is_a_noop(reg: Registry) -> None:
    backend = Backend("alpha")
    first = reg.register(backend, "alpha")
    again = reg.register(backend, "alpha")
    under_other_name = reg.register(backend, "alpha-again")
    assert first is again is under_other_name
    assert list(reg.backends) == ["alpha"] and reg.failures == []
    assert len(reg.pm.get_plugins()) == 2  # builtin + alpha


def test_extra_plugins_are_registered_in_order() -> None:
    a, w = Backend("alpha"), Wrapper()
    reg = load_registry(entry_points=False, extra=[("alpha", a), ("timing", w), ("alpha", a)])
    assert reg.backends["alpha"].plugin is a
    assert [i.plugin for i in reg.wrappers] == [w]
    assert reg.failures == []


@pytest.mark.parametrize(
    ("plugin", "stage", "expect"),
    [
        (BadArgument("bad"), "validate", "gpus"),
        (UnknownHook(), "validate", "'rlcore_init_polcy' (did you mean 'rlcore_init_policy'?)"),
        (DeclareRaises(), "declare", "RuntimeError: engine config missing"),
        (DeclareWrongType(), "declare", "returned dict, expected BackendDeclaration"),
        (Contradictory(), "declare", "openai_endpoint is only meaningful"),
        (PlainInitWithoutDeclaration(), "validate", "wrapper=True"),
    ],
    ids=[
        "bad-argument",
        "unknown-hook",
        "declare-raises",
        "wrong-type",
        "contradictory",
        "plain-init",
    ],
)
def test_bad_plugin_is_reported_and_skipped(
    reg: Registry, caplog: pytest.LogCaptureFixture, plugin: object, stage: str, expect: str
) -> None:
    good = Backend("alpha")
    reg.register(good, "alpha")
    with caplog.at_level(logging.WARNING, logger="rlcore.setup.registry"):
        assert reg.register(plugin, "culprit", "rlcore-culprit", "0.3") is None
    [failure] = reg.failures
    assert (failure.name, failure.distribution, failure.stage) == (
        "culprit",
        "rlcore-culprit",
        stage,
    )
    assert "'culprit'" in failure.message and "rlcore-culprit" in failure.message
    assert expect in failure.message
    assert "culprit" in caplog.text
    # unregistered again, and the good plugin keeps working
    assert not reg.pm.is_registered(plugin) and reg.pm.get_plugin("culprit") is None
    assert list(reg.backends) == ["alpha"]
    caller = reg.hook("rlcore_init_policy", [reg.backends["alpha"]])
    assert caller(ctx=None) == "alpha:policy"


def test_optional_unknown_hook_is_allowed(reg: Registry) -> None:
    info = reg.register(OptionalUnknownHook(), "future")
    assert info is not None and reg.failures == []


def test_failed_plugin_registered_again_is_reported_once(reg: Registry) -> None:
    bad = UnknownHook()
    reg.register(bad, "bad")
    reg.register(bad, "bad")
    assert len(reg.failures) == 1


def test_duplicate_backend_name_names_both(reg: Registry) -> None:
    first, second = Backend("shared"), Backend("shared", Role.GENERATION)
    reg.register(first, "first", "rlcore-first", "1.0")
    assert reg.register(second, "second", "rlcore-second", "2.0") is None
    [failure] = reg.failures
    assert failure.stage == "duplicate" and failure.backend == "shared"
    for part in ("'first'", "rlcore-first", "'second'", "rlcore-second", "'shared'"):
        assert part in failure.message
    assert reg.backends["shared"].plugin is first
    # selecting it for the role only the skipped plugin serves explains why
    with pytest.raises(BackendNotFoundError) as err:
        reg.backend_for(Role.GENERATION, "shared")
    assert "serves policy, not generation" in str(err.value)
    assert "failed to load (duplicate)" in str(err.value) and "rlcore-second" in str(err.value)


def test_duplicate_plugin_name(reg: Registry) -> None:
    reg.register(Backend("one"), "same", "rlcore-one")
    assert reg.register(Backend("two"), "same", "rlcore-two") is None
    [failure] = reg.failures
    assert failure.stage == "duplicate"
    assert "rlcore-one" in failure.message and "rlcore-two" in failure.message


@dataclass
class FakeDist:
    name: str
    version: str = "1.0"


class FakeEntryPoint:
    """Stands in for importlib.metadata.EntryPoint in in-process loader tests."""

    def __init__(self, name: str, obj: object = None, error: BaseException | None = None) -> None:
        self.name, self.value = name, f"fake_{name}.plugin"
        self.dist = FakeDist(f"rlcore-{name}")
        self._obj, self._error = obj, error

    def load(self) -> object:
        if self._error is not None:
            raise self._error
        return self._obj


@pytest.fixture
def fake_entry_points(monkeypatch: pytest.MonkeyPatch) -> list[FakeEntryPoint]:
    eps = [
        FakeEntryPoint("alpha", Backend("alpha")),
        FakeEntryPoint("beta", Backend("beta", Role.GENERATION)),
        FakeEntryPoint("gamma", Backend("gamma", Role.GENERATION)),
        FakeEntryPoint("vllm", error=SyntaxError("invalid syntax (plugin.py, line 3)")),
        FakeEntryPoint("explodes", error=SystemExit(3)),
    ]
    monkeypatch.setattr(registry, "_iter_entry_points", lambda: eps)
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    return eps


def test_import_errors_are_reported(fake_entry_points: list[FakeEntryPoint]) -> None:
    reg = load_registry()
    assert sorted(reg.backends) == ["alpha", "beta", "gamma"]
    failures = {f.name: f for f in reg.failures}
    assert failures["vllm"].stage == "import" and failures["vllm"].distribution == "rlcore-vllm"
    assert "SyntaxError: invalid syntax" in failures["vllm"].message
    assert failures["explodes"].stage == "import"
    assert reg.backends["alpha"].distribution == "rlcore-alpha"
    assert reg.backends["alpha"].version == "1.0"


class HangingEntryPoint(FakeEntryPoint):
    """An entry point whose import blocks (on the network, a lock) until ``release`` is set."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = threading.Event()

    def load(self) -> object:
        self.release.wait(60)  # the import that never finishes
        return None


def test_a_plugin_whose_import_hangs_is_named_with_where_it_waits_and_skipped(
    fake_entry_points: list[FakeEntryPoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    hanging = HangingEntryPoint("stuck")
    fake_entry_points.append(hanging)
    monkeypatch.setenv(registry.IMPORT_TIMEOUT_ENV, "0.5")
    try:
        reg = load_registry()  # returns: the hanging import is left behind
    finally:
        hanging.release.set()
    assert sorted(reg.backends) == ["alpha", "beta", "gamma"]  # the others load as ever
    failure = {f.name: f for f in reg.failures}["stuck"]
    assert failure.stage == "import" and failure.distribution == "rlcore-stuck"
    assert "did not finish within 0.5s" in failure.message and registry.IMPORT_TIMEOUT_ENV in failure.message
    lines, first = inspect.getsourcelines(HangingEntryPoint.load)
    waits = first + next(i for i, line in enumerate(lines) if "release.wait" in line)
    assert f"waiting at {__file__}:{waits} in load" in failure.message  # where it blocks, named
    # A run whose config needs it is refused naming why; one that does not, runs.
    with pytest.raises(BackendNotFoundError, match="(?s)'stuck'.*failed to load .import.*did not finish within 0.5s"):
        reg.backend_for(Role.POLICY, "stuck")
    assert reg.backend_for(Role.POLICY, "alpha").name == "alpha"


def test_the_import_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.IMPORT_TIMEOUT_ENV, raising=False)
    assert registry.import_timeout_s() == registry.IMPORT_TIMEOUT_S
    monkeypatch.setenv(registry.IMPORT_TIMEOUT_ENV, "7")
    assert registry.import_timeout_s() == 7.0
    monkeypatch.setenv(registry.IMPORT_TIMEOUT_ENV, "soon")
    assert registry.import_timeout_s() == registry.IMPORT_TIMEOUT_S


@pytest.mark.parametrize(
    ("config", "env", "expected"),
    [
        (None, None, None),
        (None, "", None),
        (None, " , ", None),
        (["a", "b"], None, {"a", "b"}),
        (None, "a, b,", {"a", "b"}),
        (["a", "b"], "b,c", {"b"}),
        ([], None, set()),
        ([], "a", set()),
    ],
)
def test_allowlist(
    monkeypatch: pytest.MonkeyPatch,
    config: list[str] | None,
    env: str | None,
    expected: set[str] | None,
) -> None:
    if env is None:
        monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    else:
        monkeypatch.setenv(ALLOWLIST_ENV, env)
    assert allowlist(config) == expected


def test_allowlist_filters_entry_points(
    fake_entry_points: list[FakeEntryPoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALLOWLIST_ENV, "alpha,beta,vllm")
    reg = load_registry(allow=["alpha", "gamma", "vllm"], extra=[("timing", Wrapper())])
    assert list(reg.backends) == ["alpha"]
    assert [w.name for w in reg.wrappers] == ["timing"]  # extra plugins are not filtered
    assert sorted(reg.disabled) == ["beta", "explodes", "gamma"]
    assert [f.name for f in reg.failures] == ["vllm"]
    with pytest.raises(BackendNotFoundError) as err:
        reg.backend_for(Role.GENERATION, "gamma")
    assert "installed but not loaded" in str(err.value) and ALLOWLIST_ENV in str(err.value)


def test_allowlist_warns_about_unknown_names(
    fake_entry_points: list[FakeEntryPoint], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rlcore.setup.registry"):
        reg = load_registry(allow=["alpah"])
    assert reg.backends == {}
    assert "'alpah'" in caplog.text and "did you mean 'alpha'" in caplog.text


def test_backend_for(fake_entry_points: list[FakeEntryPoint]) -> None:
    reg = load_registry()
    assert reg.backend_for(Role.POLICY, "alpha").name == "alpha"
    assert reg.backend_for("generation", "beta").name == "beta"

    with pytest.raises(BackendNotFoundError) as err:
        reg.backend_for(Role.GENERATION, "betta")
    msg = str(err.value)
    assert "generation.backend" in msg and "'betta'" in msg
    assert "Did you mean 'beta'?" in msg and "beta, gamma" in msg

    with pytest.raises(BackendNotFoundError) as err:
        reg.backend_for(Role.GENERATION, "alpha")
    msg = str(err.value)
    assert "generation.backend" in msg and "serves policy, not generation" in msg

    with pytest.raises(BackendNotFoundError) as err:
        reg.backend_for(Role.GENERATION, "vllm")
    msg = str(err.value)
    assert "failed to load (import)" in msg and "SyntaxError" in msg and "rlcore-vllm" in msg

    with pytest.raises(BackendNotFoundError, match="'env.backend' is not set"):
        reg.backend_for(Role.ENV, None)


def test_hook_calls_only_selected_backend_and_wrappers_see_it(reg: Registry) -> None:
    alpha, omega, wrapper = Backend("alpha"), Backend("omega"), Wrapper()
    for name, plugin in (("alpha", alpha), ("omega", omega), ("timing", wrapper)):
        assert reg.register(plugin, name) is not None

    caller = reg.hook("rlcore_init_policy", [reg.backend_for(Role.POLICY, "alpha")])
    assert caller(ctx="ctx") == "alpha:policy"
    assert alpha.calls == ["policy"] and omega.calls == []
    assert wrapper.seen == [("before", "ctx"), ("after", "alpha:policy")]

    caller = reg.hook("rlcore_init_policy", [reg.backend_for(Role.POLICY, "omega")])
    assert caller(ctx="ctx2") == "omega:policy"
    assert alpha.calls == ["policy"] and omega.calls == ["policy"]
    assert wrapper.seen[-1] == ("after", "omega:policy")

    # the core's own implementation is always there
    publish = reg.hook("rlcore_publish", [reg.backends["alpha"]])
    assert builtin in [i.plugin for i in publish.get_hookimpls()]

    with pytest.raises(ValueError, match="not an rlcore hook"):
        reg.hook("rlcore_init_polcy", [])


def test_unmarked_hook_function_warns(reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    class Forgot(Backend):
        def rlcore_init_env(self, ctx: Any) -> None:  # no @hookimpl
            return None

    with caplog.at_level(logging.WARNING, logger="rlcore.setup.registry"):
        assert reg.register(Forgot("forgot"), "forgot") is not None
    assert "rlcore_init_env" in caplog.text and "@hookimpl" in caplog.text


# --------------------------------------------------------------------------
# Contract versions
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "loads"),
    [("2.0", True), (CONTRACT_VERSION, True), ("1.1", False), ("3.0", False), ("1.0", False), ("2.99", False)],
)
def test_a_plugin_for_another_major_or_a_newer_minor_is_refused(version: str, loads: bool) -> None:
    import dataclasses

    old = Backend("oldtimer")
    old.decl = dataclasses.replace(old.decl, contract_version=version)
    fine = Backend("fine")
    registry = load_registry(
        entry_points=False, extra=[("oldtimer", old), ("fine", fine)]
    )
    assert "fine" in registry.backends  # the rest keep loading
    assert ("oldtimer" in registry.backends) is loads
    if not loads:
        [failure] = registry.failures
        assert failure.stage == "contract" and failure.backend == "oldtimer"
        assert "\n" not in failure.message
        assert f"contract {version}" in failure.message and f"implements contract {CONTRACT_VERSION}" in failure.message
        assert "plugin 'oldtimer'" in failure.message and "this rlcore (" in failure.message
        # A plugin of the major before is told what changed and how to port it.
        assert ("SamplingParams" in failure.message) is version.startswith("1.")


def test_a_malformed_contract_version_is_a_declaration_error() -> None:
    import dataclasses

    bad = Backend("badver")
    bad.decl = dataclasses.replace(bad.decl, contract_version="v1")
    registry = load_registry(entry_points=False, extra=[("badver", bad)])
    [failure] = registry.failures
    assert failure.stage == "declare" and "'v1' is not MAJOR.MINOR" in failure.message


def test_every_in_tree_backend_states_the_contract_it_targets() -> None:
    registry = load_registry()
    for name in ("fsdp", "vllm", "sglang", "megatron", "arithmetic", "nemo_gym"):
        decl = registry.backends[name].declaration
        assert decl is not None and decl.contract_version == CONTRACT_VERSION, name


def test_memory_handoff_on_an_env_backend_is_refused() -> None:
    import dataclasses

    env = Backend("sleepy_env", Role.ENV)
    env.decl = dataclasses.replace(env.decl, memory_handoff=True)
    registry = load_registry(entry_points=False, extra=[("sleepy_env", env)])
    [failure] = registry.failures
    assert failure.stage == "declare" and "memory_handoff is only meaningful" in failure.message


@pytest.mark.parametrize(
    ("dtypes", "roles", "words"),
    [({"float64"}, {Role.POLICY}, "dtypes ['float64'] unknown"),
     ({"bfloat16"}, {Role.ENV}, "serves neither policy nor generation")],
)
def test_a_bad_dtypes_declaration_is_refused(dtypes: set[str], roles: set[Role], words: str) -> None:
    import dataclasses

    backend = Backend("dtyped", next(iter(roles)))
    backend.decl = dataclasses.replace(backend.decl, dtypes=frozenset(dtypes))
    registry = load_registry(entry_points=False, extra=[("dtyped", backend)])
    [failure] = registry.failures
    assert failure.stage == "declare" and words in failure.message


def test_in_tree_policies_declare_the_dtypes_they_train_in() -> None:
    registry = load_registry()
    for name in ("fsdp", "megatron"):
        decl = registry.backends[name].declaration
        assert decl is not None and decl.dtypes == {"float32", "bfloat16"}, name
        assert decl.to_dict()["dtypes"] == ["bfloat16", "float32"]


def test_in_tree_policies_declare_the_staleness_their_loss_corrects_for() -> None:
    """Both train through rlcore.runtime.losses.clipped_pg_loss with the sampling logprobs as
    old_logprobs (the conformance suite checks the ratio with stale ones)."""
    registry = load_registry()
    for name in ("fsdp", "megatron"):
        decl = registry.backends[name].declaration
        assert decl is not None and decl.max_staleness == 8, name
        assert decl.to_dict()["max_staleness"] == 8
    for name in ("arithmetic", "nemo_gym"):
        decl = registry.backends[name].declaration
        assert decl is not None and decl.max_staleness == 0 and decl.inflight_refit == (), name

"""The conformance suite (rlcore.testing) passes honest backends and fails dishonest ones.

Each case writes a plugin module and a test module that subclasses
``BackendConformance`` into a temporary directory, runs pytest in-process, and
checks the outcome of every test of the suite: a dishonest backend must fail
exactly the tests of the claim it breaks, and pass or skip the rest.
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# -- helpers ------------------------------------------------------------------------

# An honest, dependency-free base the dishonest backends start from: each case
# changes one thing. Handles implement the refit protocols with no weights.
BASE = """
import subprocess, sys, threading, time
from rlcore.declarations import Artifact, BackendDeclaration, OverlapSafety, Role, Transport
from rlcore.hookspecs import hookimpl


class Handle:
    device_type = "cpu"
    refit_ranks = 1

    def __init__(self):
        self.closed = False

    def weight_specs(self):
        return []

    def refit_address(self):
        return ("127.0.0.1", 1)

    def open_refit_channel(self, spec):
        return []

    def send_weights(self, spec, step, buckets):
        return []

    def receive_weights(self, spec, step, buckets):
        return []

    def generate(self, prompt_ids, params):
        # one seeded token, then EOS (id 3 in rlcore's tiny tokenizer)
        def tok(i, j):
            return 4 + (i if params.temperature == 0 else params.seed * 7 + i * 3 + j) % 40
        m = params.max_tokens
        return [[{"token_ids": [tok(i, j), 3][:m], "logprobs": [-1.0, -1.0][:m]}
                 for j in range(params.n)] for i in range(len(prompt_ids))]

    def logprobs(self, batch):
        return [[-1.0] * len(c) for _, c in batch]

    def collect_rollouts(self, request):
        return [
            [{"prompt_ids": [2, 5], "token_ids": [7, 3], "logprobs": [-1.0, -2.0], "reward": 0.5}
             for _ in range(request.samples_per_prompt)]
            for _ in range(request.prompts)
        ]

    def shutdown(self):
        self.closed = True


def checked(ctx):
    ctx.cancel.raise_if_cancelled(ctx.task)
    ctx.deadline.raise_if_expired(ctx.task)
"""

SUITE_ROWS = {
    "test_declaration_is_valid",
    "test_declaration_is_pure",
    "test_import_is_light",
    "test_registers_cleanly",
    *(
        f"test_{t}[{r}]"
        for t in ("init_and_shutdown", "init_cancelled", "init_deadline_expired")
        for r in ("policy", "generation", "env")
    ),
    "test_overlap_non_colocated",
    "test_overlap_colocated",
    "test_atomic_publish",
    "test_refit_fed_generation_starts",
    "test_refit_round_trip",
    "test_refit_fed_round_trip",
    "test_logprobs_shape",
    "test_logprobs_agree",
    "test_generate_samples",
    "test_generate_stops_at_eos",
    "test_generate_is_seeded",
    "test_generate_logprobs_at_temperature_1",
    "test_weight_versions_before_refit",
    "test_env_collect_rollouts",
    "test_checkpoint_round_trip",
    "test_staged_checkpoint",
    "test_adapters",
    "test_serves_adapters",
    "test_loss_options",
    *(f"test_train_step_semantics[{d}]" for d in ("float32", "bfloat16", "float16")),
}


class _Reports:
    """Collects the reports of an in-process pytest run."""

    def __init__(self) -> None:
        self.reports: list[pytest.TestReport] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.reports.append(report)


def run_pytest(
    directory: Path, test_file: Path, *paths: Path, args: tuple[str, ...] = ()
) -> list[pytest.TestReport]:
    """``pytest.main`` on ``test_file`` in this process, with ``directory`` and ``paths``
    importable. (Not pytester: it drops modules a run imports, and torch's lazily
    imported submodules cannot be imported twice in one process.)"""
    collector = _Reports()
    saved_path, cwd = list(sys.path), os.getcwd()
    sys.path[:0] = [str(directory), *map(str, paths)]
    importlib.invalidate_caches()
    os.chdir(directory)
    try:
        pytest.main(
            [str(test_file), "-q", "-p", "no:cacheprovider", f"--rootdir={directory}", *args],
            plugins=[collector],
        )
    finally:
        sys.path[:] = saved_path
        os.chdir(cwd)
    return collector.reports


def run_suite(
    tmp_path: Path,
    name: str,
    plugin_source: str | None,
    class_body: str = "",
    *,
    plugin: str | None = None,
    paths: tuple[Path, ...] = (),
) -> dict[str, str]:
    """Run BackendConformance against a plugin; return {test id: outcome}.

    ``plugin_source`` is written as module ``name`` (the plugin) unless None, in
    which case ``plugin`` names a plugin module importable from ``paths``.
    Module names must be unique in the session (runs share ``sys.modules``).
    """
    if plugin_source is not None:
        head, base, tail = plugin_source.rpartition(BASE)
        (tmp_path / f"{name}.py").write_text(head + base + textwrap.dedent(tail))
    body = textwrap.indent(textwrap.dedent(class_body), "    ")
    test_file = tmp_path / f"test_{name}.py"
    test_file.write_text(
        "from rlcore.testing import BackendConformance\n\n\n"
        f"class TestIt(BackendConformance):\n    plugin = {plugin or name!r}\n{body}\n"
    )
    outcomes: dict[str, str] = {}
    for rep in run_pytest(tmp_path, test_file, *paths):
        test = rep.nodeid.split("::")[-1]
        if rep.failed:
            outcomes[test] = "failed"
        elif rep.skipped and outcomes.get(test) != "failed":
            outcomes[test] = "skipped"
        elif rep.when == "call" and rep.passed and test not in outcomes:
            outcomes[test] = "passed"
    assert set(outcomes) == SUITE_ROWS, f"unexpected test list: {sorted(outcomes)}"
    return outcomes


def failed(outcomes: dict[str, str]) -> set[str]:
    return {t for t, o in outcomes.items() if o == "failed"}


@pytest.fixture(autouse=True)
def reap_children() -> Iterator[None]:
    """Kill child processes a dishonest backend leaked during the test."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    for p in me.children(recursive=True):
        if p.pid not in before:
            try:
                p.kill()
                p.wait(5)
            except psutil.Error:
                pass


# -- honest backends --------------------------------------------------------------------


def test_honest_minimal_backend_passes(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "honest_env",
        BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="honest-env", roles={Role.ENV})

        @hookimpl
        def rlcore_init_env(ctx):
            checked(ctx)
            return Handle()
        """,
    )
    assert not failed(out), out


def test_endpoint_claimed_but_missing(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "no_endpoint",
        BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(
                name="no-endpoint", roles={Role.GENERATION}, openai_endpoint=True,
                receive_transports={Transport.DISK},
            )

        @hookimpl
        def rlcore_init_generation(ctx):
            checked(ctx)
            return Handle()  # no `endpoint` although the declaration claims one
        """,
        class_body="use_reference_peer = False\n",
    )
    assert failed(out) == {"test_init_and_shutdown[generation]"}, out


def test_endpoint_claimed_but_not_serving(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "dead_endpoint",
        BASE
        + """
        from rlcore.handles import Endpoint

        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(
                name="dead-endpoint", roles={Role.GENERATION}, openai_endpoint=True,
                receive_transports={Transport.DISK},
            )

        @hookimpl
        def rlcore_init_generation(ctx):
            checked(ctx)
            h = Handle()
            h.endpoint = Endpoint("http://127.0.0.1:9/v1", "m")  # nothing listens there
            return h
        """,
        class_body="use_reference_peer = False\n",
    )
    assert failed(out) == {"test_init_and_shutdown[generation]"}, out


def test_shutdown_leaks_a_child_process(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "leaky",
        BASE
        + """
        class Leaky(Handle):
            def shutdown(self):
                self.closed = True  # forgets self.proc

        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="leaky", roles={Role.ENV})

        @hookimpl
        def rlcore_init_env(ctx):
            h = Leaky()
            h.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            return h
        """,
        class_body="settle_s = 0.5\n",
    )
    assert failed(out) == {
        "test_init_and_shutdown[env]",
        "test_init_cancelled[env]",
        "test_init_deadline_expired[env]",
        "test_overlap_non_colocated",
    }, out


def test_shutdown_leaks_a_thread(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "leaky_thread",
        BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="leaky-thread", roles={Role.ENV},
                                      overlap=OverlapSafety(non_colocated=False))

        @hookimpl
        def rlcore_init_env(ctx):
            checked(ctx)
            stop = threading.Event()
            threading.Thread(target=stop.wait, args=(20,), name="engine-loop", daemon=True).start()
            return Handle()  # shutdown never sets `stop`
        """,
        class_body="settle_s = 0.5\n",
    )
    assert failed(out) == {"test_init_and_shutdown[env]"}, out


def test_heavy_import_at_module_level(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = run_suite(
        tmp_path,
        "heavy",
        "import torch  # noqa: F401  (at module level: every `rlcore plugins` pays for it)\n"
        + BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="heavy", roles={Role.ENV})

        @hookimpl
        def rlcore_init_env(ctx):
            checked(ctx)
            return Handle()
        """,
    )
    assert failed(out) == {"test_import_is_light"}, out


def test_impure_declaration(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "impure",
        BASE
        + """
        import itertools
        calls = itertools.count()

        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="impure", roles={Role.ENV},
                                      description=f"call {next(calls)}")

        @hookimpl
        def rlcore_init_env(ctx):
            checked(ctx)
            return Handle()
        """,
    )
    assert failed(out) == {"test_declaration_is_pure", "test_registers_cleanly"}, out


def test_invalid_declaration(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "invalid",
        BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            # refit_fed without serving generation: contradictory
            return BackendDeclaration(name="invalid", roles={Role.ENV}, refit_fed=True)

        @hookimpl
        def rlcore_init_env(ctx):
            return Handle()
        """,
    )
    assert {
        "test_declaration_is_valid",
        "test_registers_cleanly",
        "test_import_is_light",
    } <= failed(out), out


def test_cancellation_raises_untyped_error(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "untyped",
        BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="untyped", roles={Role.ENV})

        @hookimpl
        def rlcore_init_env(ctx):
            if ctx.cancel.cancelled:
                raise RuntimeError("stopped")  # not rlcore.errors.Cancelled
            return Handle()
        """,
    )
    assert failed(out) == {"test_init_cancelled[env]"}, out


def test_init_ignores_cancel_and_deadline(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "stubborn",
        BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="stubborn", roles={Role.ENV})

        @hookimpl
        def rlcore_init_env(ctx):
            if ctx.cancel.cancelled or ctx.deadline.expired:
                time.sleep(2.0)  # a wait that observes neither
            return Handle()
        """,
        class_body="init_timeout_s = 0.5\n",
    )
    assert failed(out) == {"test_init_cancelled[env]", "test_init_deadline_expired[env]"}, out


def test_shutdown_not_idempotent(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "once",
        BASE
        + """
        class Once(Handle):
            def shutdown(self):
                if self.closed:
                    raise RuntimeError("already shut down")
                self.closed = True

        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="once", roles={Role.ENV})

        @hookimpl
        def rlcore_init_env(ctx):
            checked(ctx)
            return Once()
        """,
    )
    assert failed(out) == {"test_init_and_shutdown[env]"}, out


def test_overlap_claimed_but_unsafe(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "exclusive",
        BASE
        + """
        ENGINE = threading.Lock()

        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="exclusive", roles={Role.ENV},
                                      overlap=OverlapSafety(non_colocated=True))

        @hookimpl
        def rlcore_init_env(ctx):
            checked(ctx)
            if not ENGINE.acquire(blocking=False):
                raise RuntimeError("another init is profiling the device")
            try:
                time.sleep(0.3)
            finally:
                ENGINE.release()
            return Handle()
        """,
    )
    assert failed(out) == {"test_overlap_non_colocated"}, out


def test_atomic_claimed_but_written_in_place(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "inplace",
        BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="inplace", roles={Role.ENV},
                                      produces=(Artifact("inplace.data", atomic=True),))

        @hookimpl
        def rlcore_init_env(ctx):
            checked(ctx)
            path = ctx.artifact_path("inplace.data", "k")  # written without ctx.publish
            path.mkdir(parents=True, exist_ok=True)
            (path / "data.txt").write_text("x")
            return Handle()
        """,
    )
    assert failed(out) == {"test_atomic_publish"}, out


def test_transport_claimed_without_protocol(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "no_receiver",
        BASE
        + """
        class Bare:
            def shutdown(self):
                pass

        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="no-receiver", roles={Role.GENERATION},
                                      receive_transports={Transport.DISK}, refit_fed=True)

        @hookimpl
        def rlcore_init_generation(ctx):
            checked(ctx)
            return Bare()  # declares a receive transport, implements no RefitReceiver
        """,
        class_body="use_reference_peer = False\n",
    )
    assert failed(out) == {
        "test_init_and_shutdown[generation]",
        "test_refit_fed_generation_starts",
        # neither a GenerationHandle: every protocol test of generation fails
        "test_logprobs_shape",
        "test_generate_samples",
        "test_generate_stops_at_eos",
        "test_generate_is_seeded",
        "test_generate_logprobs_at_temperature_1",
        "test_weight_versions_before_refit",
    }, out


def test_declared_role_without_hook(tmp_path: Path) -> None:
    out = run_suite(
        tmp_path,
        "hookless",
        BASE
        + """
        @hookimpl
        def rlcore_declare_backend():
            return BackendDeclaration(name="hookless", roles={Role.ENV})
        """,
    )
    assert failed(out) == {
        "test_registers_cleanly",
        "test_init_and_shutdown[env]",
        "test_init_cancelled[env]",
        "test_init_deadline_expired[env]",
        "test_overlap_non_colocated",
        "test_env_collect_rollouts",
    }, out



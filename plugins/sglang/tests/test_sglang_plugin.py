"""The plugin module (declaration, options, light import) and SGLang's pinned CPU route."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlcore.config import resolve_options
from rlcore.declarations import Role, Transport, validate_declaration
from rlcore.errors import ConfigError
from rlcore.testing.fixtures import heavy_imports
from rlcore_sglang.options import SGLangOptions
from rlcore_sglang.plugin import rlcore_declare_backend


def test_declaration_validates() -> None:
    d = validate_declaration(rlcore_declare_backend(), plugin="sglang", distribution="rlcore-sglang")
    assert d.name == "sglang" and d.roles == {Role.GENERATION}
    assert d.refit_fed and d.openai_endpoint
    assert d.receive_transports == {Transport.COLLECTIVE, Transport.SHARED_MEMORY, Transport.DISK}
    assert d.overlap.non_colocated and not d.overlap.colocated and "memory" in d.overlap.reason


def test_the_declared_landing_is_the_workers() -> None:
    """PAUSE with per-token versions, under any config: the worker takes refits in flight."""
    from rlcore.declarations import RefitLanding
    from rlcore_sglang.worker import SGLangWorker

    landing = rlcore_declare_backend().refit_landing({"options": {}})
    assert landing.landing is RefitLanding.PAUSE and landing.token_versions
    assert SGLangWorker.inflight_refit


def test_options_are_checked() -> None:
    opts = resolve_options(
        {"port": 8123, "extra_args": ["--log-level", "info"]}, SGLangOptions, section="generation", backend="sglang"
    )
    assert isinstance(opts, SGLangOptions) and opts.port == 8123
    assert list(opts.extra_args) == ["--log-level", "info"]
    with pytest.raises(ConfigError, match="max_total_token"):
        resolve_options({"max_total_token": 1}, SGLangOptions, section="generation", backend="sglang")


def test_plugin_import_is_light() -> None:
    heavy = heavy_imports(
        "rlcore_sglang.plugin", "rlcore_sglang.handle", "rlcore_sglang.worker", "rlcore_sglang.server",
        heavy=("sglang", "torch", "transformers", "vllm"),
    )
    assert heavy == []


def test_launch_args_follow_the_cpu_route_and_refit_fed() -> None:
    from rlcore_sglang.worker import launch_args

    args = launch_args("/m", dtype="float32", refit_fed=True, options=SGLangOptions(), seed=3, cuda=False)
    for flag in ("--device", "--attention-backend", "--sampling-backend", "--disable-cuda-graph",
                 "--disable-overlap-schedule", "--load-format"):
        assert flag in args
    assert args[args.index("--load-format") + 1] == "dummy"
    assert args[args.index("--attention-backend") + 1] == "torch_native"
    assert "--load-format" not in launch_args(
        "/m", dtype="float32", refit_fed=False, options=SGLangOptions(), seed=3, cuda=False
    )


def test_pinned_cpu_route_imports() -> None:
    """SGLang's CPU route in .venv-sglang: every import the server needs, in order, and
    the torchvision op schemas. Fails (never skips) naming the import or op that broke."""
    from rlcore_sglang.server import SITE_DIR, find_sglang_python

    python = find_sglang_python(None)  # ConfigError naming install.sh if the venv is missing
    out = subprocess.run(
        [str(python), "-m", "rlcore_sglang_site_check"],
        env={"PYTHONPATH": str(SITE_DIR), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SGLang 0.5.21 CPU route OK" in out.stdout, out.stdout


def test_unknown_endpoint_kind_fails_before_anything_starts(tmp_path: object) -> None:
    from pathlib import Path

    from sglang_helpers import init_context, make_config

    from rlcore_sglang.handle import start_generation

    tmp = Path(str(tmp_path))
    ctx = init_context(make_config(tmp / "no-model", tmp / "cache", endpoint="vllm"), tmp / "run")
    with pytest.raises(ConfigError, match="generation.options.endpoint"):
        start_generation(ctx)


def test_the_worker_launches_its_server_without_importing_torch() -> None:
    """Everything the actor does before its server is launched (the device, the arguments,
    the environment) takes the device from the handle: neither torch nor transformers is
    imported there, where it would take seconds of the cores the server starts on; the
    weight specs are worked out after the launch."""
    code = (
        "import sys\n"
        "import rlcore_sglang.worker as w\n"
        "class Launched(Exception): pass\n"
        "class Server:\n"
        "    def __init__(self, python, args, **kw):\n"
        "        print(sorted(m for m in ('torch', 'transformers', 'sglang') if m in sys.modules), '--device' in args)\n"
        "        raise Launched\n"
        "w.ServerProcess = Server\n"
        "from rlcore_sglang.options import SGLangOptions\n"
        "from rlcore.runtime.generation_group import EngineArgs\n"
        "worker = w.SGLangWorker(0, 1, EngineArgs('/m', dtype='float32', refit_fed=True, options=SGLangOptions(),\n"
        "                                         log_dir='/tmp', cuda=False))\n"
        "try:\n"
        "    worker.start(5.0)\n"
        "except Launched:\n"
        "    print(worker._specs_ahead is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[]", "True", "True"]


def test_a_generate_answer_gives_each_tokens_weight_version() -> None:
    """From SGLang's spans of weight labels (a refit that landed mid-request splits them),
    else its one label; with neither the worker's counter fills them in later."""
    from rlcore_sglang.worker import NativeGenerate

    entries = [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]]
    spans = [{"version": "default", "start": 0, "end": 1}, {"version": "step-4", "start": 1, "end": 3}]
    answers = [
        {"meta_info": {"output_token_logprobs": entries, "weight_versions": spans, "weight_version": "step-4"}},
        {"meta_info": {"output_token_logprobs": entries, "weight_version": "step-2"}},
        {"meta_info": {"output_token_logprobs": entries}},
    ]
    got = NativeGenerate(0).samples(answers, None)  # type: ignore[arg-type]
    assert [s["token_ids"] for s in got] == [[5, 6, 7]] * 3
    assert [s.get("versions") for s in got] == [[0, 4, 4], [2, 2, 2], None]

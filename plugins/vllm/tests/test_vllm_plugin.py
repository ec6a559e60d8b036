"""The plugin module: declaration, options, light import; the handle's pure helpers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlcore.config import resolve_options
from rlcore.declarations import Role, Transport, validate_declaration
from rlcore.errors import ConfigError
from rlcore.runtime.generation_group import EngineArgs
from rlcore.testing.fixtures import heavy_imports
from rlcore_vllm.options import VLLMOptions
from rlcore_vllm.plugin import rlcore_declare_backend


def test_declaration_validates() -> None:
    d = validate_declaration(rlcore_declare_backend(), plugin="vllm", distribution="rlcore-vllm")
    assert d.name == "vllm" and d.roles == {Role.GENERATION}
    assert d.refit_fed and d.openai_endpoint
    assert d.receive_transports == {Transport.COLLECTIVE, Transport.SHARED_MEMORY, Transport.DISK}
    assert d.overlap.non_colocated and not d.overlap.colocated and d.overlap.reason
    assert "serve_openai" in (d.option_names() or [])


@pytest.mark.parametrize("serve", [True, False])
def test_the_declared_landing_is_the_workers(serve: bool) -> None:
    """Server mode declares PAUSE (the server's pause; /v1/completions says no token's
    version), in-process BETWEEN_STEPS (the worker's step loop) with per-token versions (vLLM's
    spans); the worker takes refits in flight."""
    from rlcore.declarations import RefitLanding
    from rlcore_vllm.worker import VLLMWorker

    landing = rlcore_declare_backend().refit_landing({"options": {"serve_openai": serve}})
    assert landing.landing is (RefitLanding.PAUSE if serve else RefitLanding.BETWEEN_STEPS)
    assert landing.token_versions is not serve and VLLMWorker.inflight_refit


def test_options_are_checked() -> None:
    opts = resolve_options(
        {"serve_openai": True, "port": 8123}, VLLMOptions, section="generation", backend="vllm"
    )
    assert isinstance(opts, VLLMOptions) and opts.serve_openai and opts.port == 8123
    with pytest.raises(ConfigError, match="serve_openai"):
        resolve_options({"serve_opneai": True}, VLLMOptions, section="generation", backend="vllm")


def test_plugin_import_is_light() -> None:
    heavy = heavy_imports(
        "rlcore_vllm.plugin", "rlcore_vllm.transfer", heavy=("vllm", "torch", "ray", "transformers")
    )
    assert heavy == []


def test_cpu_engine_gets_the_kv_cache_size_as_an_engine_argument() -> None:
    """On CPU the engine's KV cache is ``kv_cache_gib`` (fractions allowed), passed as vLLM's
    ``kv_cache_memory_bytes``; with ``enforce_eager`` its helpers run uncompiled."""
    import torch

    from rlcore_vllm.worker import VLLMWorker

    if torch.cuda.is_available():
        pytest.skip("the KV cache size is a CPU option")
    opts = resolve_options(
        {"kv_cache_gib": 0.0625}, VLLMOptions, section="generation", backend="vllm"
    )
    worker = VLLMWorker(0, 1, EngineArgs("/model", dtype="float32", refit_fed=True, options=opts))
    args = worker._engine_args()
    assert args["kv_cache_memory_bytes"] == 64 * 2**20 and args["load_format"] == "dummy"
    assert worker._uncompiled()
    opts.enforce_eager = False
    assert not VLLMWorker(0, 1, EngineArgs("/m", dtype="float32", refit_fed=False, options=opts))._uncompiled()


def test_worker_sets_vllms_variables_in_its_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process engine (no engine-core subprocess) and the driver's vLLM log level are
    set by the worker before vLLM is imported, not as the actor's runtime_env (which would
    keep the actor out of the workers Ray starts ahead of time)."""
    from rlcore_vllm.worker import VLLMWorker

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    opts = resolve_options({}, VLLMOptions, section="generation", backend="vllm")
    worker = VLLMWorker(0, 1, EngineArgs("/m", dtype="float32", refit_fed=True, options=opts), log_level="ERROR")
    worker._set_vllm_env()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"


def test_server_mode_worker_launches_without_importing_torch() -> None:
    """Everything the actor does before its server starts (vLLM's variables, the engine's
    arguments, whether helpers run eagerly) takes the device from the handle: torch is not
    imported in the actor, where it would take seconds of the cores the server starts on."""
    code = (
        "import sys\n"
        "from rlcore.config import resolve_options\n"
        "from rlcore_vllm.options import VLLMOptions\n"
        "from rlcore_vllm.worker import VLLMWorker\n"
        "opts = resolve_options({'serve_openai': True}, VLLMOptions, section='generation', backend='vllm')\n"
        "from rlcore.runtime.generation_group import EngineArgs\n"
        "w = VLLMWorker(0, 1, EngineArgs('/m', dtype='float32', refit_fed=True, options=opts, cuda=False))\n"
        "w._set_vllm_env(); args = w._engine_args(); eager = w._uncompiled()\n"
        "import rlcore_vllm.server, rlcore_vllm.transfer\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules), 'kv_cache_memory_bytes' in args, eager)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[] True True"


def test_a_completion_gives_each_tokens_weight_version_from_vllms_spans() -> None:
    """vLLM's ``CompletionOutput.weight_versions`` (spans of weight labels, split where a
    refit landed) -> one version per token; without spans the worker's counter fills them."""
    from types import SimpleNamespace as NS

    from rlcore_vllm.worker import _sample

    logprobs = [{5: NS(logprob=-0.1)}, {6: NS(logprob=-0.2)}, {7: NS(logprob=-0.3)}]
    spans = [NS(version="default", start=0, end=2), NS(version="step-9", start=2, end=3)]
    split = _sample(NS(token_ids=[5, 6, 7], logprobs=logprobs, weight_versions=spans))
    assert split == {"token_ids": [5, 6, 7], "logprobs": [-0.1, -0.2, -0.3], "versions": [0, 0, 9]}
    assert "versions" not in _sample(NS(token_ids=[5, 6, 7], logprobs=logprobs, weight_versions=None))

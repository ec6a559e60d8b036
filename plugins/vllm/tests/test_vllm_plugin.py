"""The plugin module: declaration, options, light import; the handle's pure helpers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlcore.config import resolve_options
from rlcore.declarations import Role, Transport, validate_declaration
from rlcore.errors import ConfigError
from rlcore_vllm.plugin import VLLMOptions, rlcore_declare_backend


def test_declaration_validates() -> None:
    d = validate_declaration(rlcore_declare_backend(), plugin="vllm", distribution="rlcore-vllm")
    assert d.name == "vllm" and d.roles == {Role.GENERATION}
    assert d.refit_fed and d.openai_endpoint
    assert d.receive_transports == {Transport.COLLECTIVE, Transport.SHARED_MEMORY, Transport.DISK}
    assert d.overlap.non_colocated and not d.overlap.colocated and d.overlap.reason
    assert "serve_openai" in (d.option_names() or [])


def test_options_are_checked() -> None:
    opts = resolve_options(
        {"serve_openai": True, "port": 8123}, VLLMOptions, section="generation", backend="vllm"
    )
    assert isinstance(opts, VLLMOptions) and opts.serve_openai and opts.port == 8123
    with pytest.raises(ConfigError, match="serve_openai"):
        resolve_options({"serve_opneai": True}, VLLMOptions, section="generation", backend="vllm")


def test_plugin_import_is_light() -> None:
    script = (
        "import json, sys\n"
        "import rlcore_vllm.plugin as p\n"
        "p.rlcore_declare_backend()\n"
        "import rlcore_vllm.transfer\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    heavy = [
        m
        for m in json.loads(out.stdout)
        if m.split(".")[0] in ("vllm", "torch", "ray", "transformers")
    ]
    assert heavy == []


def test_prompt_seeds_are_distinct_and_split_is_contiguous() -> None:
    from rlcore_vllm.handle import _split, prompt_seed

    seeds = [prompt_seed(7, i) for i in range(1000)]
    # vLLM gives sample j of a prompt seed + j: no two prompts' sample streams may meet.
    streams = {s + j for s in seeds for j in range(16)}
    assert len(streams) == 16 * len(seeds)
    assert prompt_seed(7, 3) == prompt_seed(7, 3) != prompt_seed(8, 3)
    assert _split(5, 2) == [(0, 3), (3, 5)] and _split(1, 3) == [(0, 1), (1, 1), (1, 1)]

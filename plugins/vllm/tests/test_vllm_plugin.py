"""The plugin module: declaration, options, light import; the handle's pure helpers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlcore.config import resolve_options
from rlcore.declarations import Role, Transport, validate_declaration
from rlcore.errors import ConfigError
from rlcore_vllm.options import VLLMOptions
from rlcore_vllm.plugin import rlcore_declare_backend


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

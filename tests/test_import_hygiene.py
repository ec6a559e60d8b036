"""``import rlcore`` and ``rlcore plugins`` must not import heavy frameworks.

Runs in a fresh interpreter (this test process may already have imported them)
and checks ``sys.modules`` afterwards in the parent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "vllm", "megatron", "transformers")

_SCRIPT = """
import contextlib, importlib, importlib.util, io, json, sys

import rlcore
import rlcore.setup.registry
from rlcore.setup.registry import load_registry

load_registry()
done = ["rlcore", "rlcore.setup.registry", "load_registry()"]
for mod in ("rlcore.config", "rlcore.setup.planner", "rlcore.setup.plan"):
    if importlib.util.find_spec(mod) is not None:
        importlib.import_module(mod)
        done.append(mod)
if importlib.util.find_spec("rlcore.app.cli") is not None:
    import rlcore.app.cli
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        rlcore.app.cli.main(["plugins", "--json"])
    done.append("rlcore plugins --json")
sys.__stdout__.write(json.dumps({"done": done, "modules": sorted(sys.modules)}))
"""


def test_light_imports_do_not_load_heavy_frameworks() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RLCORE_PLUGINS"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {"rlcore", "rlcore.setup.registry", "load_registry()"} <= set(result["done"])
    heavy = sorted(m for m in result["modules"] if m.split(".")[0] in HEAVY)
    assert heavy == [], f"{', '.join(result['done'])} imported heavy modules: {heavy}"


def test_testing_reference_imports_without_the_config_stack() -> None:
    """GPU scripts (no omegaconf, pluggy-free environments) import the references."""
    code = (
        "import json, sys; import rlcore.testing.reference; "
        "sys.__stdout__.write(json.dumps(sorted(sys.modules)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    assert not loaded & {"omegaconf", "rlcore.config", "rlcore.testing.harness", "torch"}


def test_rlcore_open_is_imported_at_its_first_use_only() -> None:
    """``import rlcore`` does not import the application; ``rlcore.open`` imports it, and
    still no heavy framework (Ray starts when a session opens, not when it is imported)."""
    code = (
        "import json, sys; import rlcore; before = sorted(m for m in sys.modules if m.startswith('rlcore.app')); "
        "rlcore.open, rlcore.Session, rlcore.RunInterrupted; "
        "sys.__stdout__.write(json.dumps({'before': before, 'after': sorted(sys.modules)}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "RLCORE_PLUGINS"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["before"] == []
    assert "rlcore.app.session" in result["after"]
    assert sorted(m for m in result["after"] if m.split(".")[0] in HEAVY) == []

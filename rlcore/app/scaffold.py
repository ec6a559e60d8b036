"""``rlcore new-backend NAME``: write a ready backend plugin package.

:func:`write_backend_package` fills the templates in ``rlcore/app/templates/backend``
(package data) for the chosen roles and writes::

    rlcore-<name>/
        pyproject.toml          entry point <name> in group rlcore.backends
        README.md
        rlcore_<name>/__init__.py
        rlcore_<name>/plugin.py the declaration and init hooks (light: imported everywhere)
        rlcore_<name>/engine.py policy/generation: a transformers engine in Ray actors
        rlcore_<name>/env.py    env: a prompt-and-score toy environment
        rlcore_<name>/py.typed
        tests/test_conformance.py   rlcore.testing.BackendConformance, wired in

The generated plugin passes the conformance suite as written, with refit round
trips against rlcore's reference peer for the roles it does not serve: it claims
only what its engine does. The package is assembled in a private directory and
renamed into place, so a failure never leaves half a package behind, and an
existing directory is never overwritten.

Template syntax: ``${placeholder}`` (:class:`string.Template`) and whole-line
``#:if role [role ...]`` / ``#:endif`` blocks, kept when the backend serves any
of the listed roles (``!role``: and does not serve that one).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from string import Template

from rlcore.declarations import CONTRACT_VERSION, Role
from rlcore.errors import ConfigError

#: Backend names the scaffold accepts: the declaration's rule, and short enough for a package.
NAME_RULE = "lower case letters, digits, '_' and '-', starting with a letter, at most 40 characters"
_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
_IF_RE = re.compile(r"^#:if\s+(?P<roles>[a-z! ]+)$")
_ENDIF = "#:endif"
_ROLE_ORDER = [Role.POLICY, Role.GENERATION, Role.ENV]


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid backend name; raise ConfigError naming the rule otherwise."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"backend name {name!r} is not valid: use {NAME_RULE} (e.g. 'mybackend', 'my-engine')",
            key="name",
        )
    if name.endswith(("-", "_")) or "--" in name or "__" in name:
        raise ConfigError(
            f"backend name {name!r} is not valid: no trailing or doubled '-'/'_' ({NAME_RULE})",
            key="name",
        )
    return name


def parse_roles(roles: str) -> list[Role]:
    """``"policy,generation"`` -> roles in plan order; ConfigError for an unknown or empty list."""
    parts = [p.strip() for p in str(roles).split(",") if p.strip()]
    valid = ", ".join(r.value for r in _ROLE_ORDER)
    if not parts:
        raise ConfigError(f"--roles is empty; give one or more of {valid}", key="roles")
    chosen = set()
    for part in parts:
        try:
            chosen.add(Role(part))
        except ValueError:
            raise ConfigError(
                f"--roles names {part!r}, which is not a role; roles are {valid}", key="roles"
            ) from None
    return [r for r in _ROLE_ORDER if r in chosen]


def _template(name: str) -> str:
    return (resources.files("rlcore.app") / "templates" / "backend" / name).read_text(encoding="utf-8")


def _select_blocks(text: str, roles: set[str]) -> str:
    """Keep ``#:if`` blocks whose roles intersect ``roles``; drop the marker lines."""
    out: list[str] = []
    keep: bool | None = None  # None: outside a block
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        stripped = line.strip()
        match = _IF_RE.match(stripped)
        if match:
            if keep is not None:
                raise ValueError(f"template line {lineno}: nested #:if")
            words = match["roles"].split()
            wanted = {w for w in words if not w.startswith("!")}
            unwanted = {w[1:] for w in words if w.startswith("!")}
            keep = (not wanted or bool(wanted & roles)) and not (unwanted & roles)
            continue
        if stripped == _ENDIF:
            if keep is None:
                raise ValueError(f"template line {lineno}: #:endif without #:if")
            keep = None
            continue
        if keep is None or keep:
            out.append(line)
    if keep is not None:
        raise ValueError("template ends inside an #:if block")
    return "".join(out)


def _render(template: str, roles: list[Role], values: dict[str, str]) -> str:
    text = _select_blocks(_template(template), {r.value for r in roles})
    return Template(text).substitute(values)


def _values(name: str, roles: list[Role]) -> dict[str, str]:
    module = "rlcore_" + name.replace("-", "_")
    title = "".join(part.capitalize() for part in re.split(r"[-_]", name))
    model = [r for r in roles if r in (Role.POLICY, Role.GENERATION)]
    decl_imports = ["BackendDeclaration", "OverlapSafety", "Role"]
    if model:
        decl_imports.append("Transport")
    deps = ['"ray>=2.40"', '"torch>=2.4"', '"transformers>=4.46"'] if model else []
    overrides = [f"{r.value}.devices_per_worker=0.5" for r in model]
    if Role.POLICY in roles:  # two data-parallel ranks: the suite checks their reduced step
        overrides.append("policy.workers=2")
    roles_text = ", ".join(r.value for r in roles)
    return {
        "name": name,
        "dist": f"rlcore-{name}",
        "module": module,
        "title": title,
        "roles": ", ".join(f"Role.{r.name}" for r in roles),
        "roles_text": roles_text,
        "first_role": roles[0].value,
        "decl_imports": ", ".join(decl_imports),
        "deps": ", ".join(deps),
        "overrides": "[" + "".join(f'\n        "{o}",' for o in overrides) + ("\n    ]" if overrides else "]"),
        "description": f"{roles_text} backend '{name}' (transformers in Ray actors)",
        "contract_version": CONTRACT_VERSION,
    }


def write_backend_package(name: str, parent: Path, roles: str = "generation") -> Path:
    """Write the plugin package ``rlcore-<name>`` under ``parent`` and return its path.

    Args:
        name: the backend's name (``policy.backend: <name>`` selects it); lower case
            letters, digits, ``_`` and ``-``, starting with a letter.
        parent: directory to write into (created if missing).
        roles: comma-separated roles it serves: ``policy``, ``generation``, ``env``.

    Raises:
        ConfigError: the name or a role is invalid, or ``parent/rlcore-<name>`` exists.
    """
    check_name(name)
    chosen = parse_roles(roles)
    values = _values(name, chosen)
    parent = Path(parent)
    target = parent / values["dist"]
    if os.path.lexists(target):
        raise ConfigError(
            f"{target} already exists; rlcore new-backend never overwrites: remove it or "
            "choose another --dir",
            key="dir",
        )
    parent.mkdir(parents=True, exist_ok=True)
    files = {
        "pyproject.toml": _render("pyproject.toml.tmpl", chosen, values),
        "README.md": _render("README.md.tmpl", chosen, values),
        f"{values['module']}/__init__.py": _render("__init__.py.tmpl", chosen, values),
        f"{values['module']}/plugin.py": _render("plugin.py.tmpl", chosen, values),
        f"{values['module']}/py.typed": "",
        **(
            {f"{values['module']}/engine.py": _render("engine.py.tmpl", chosen, values)}
            if {Role.POLICY, Role.GENERATION} & set(chosen)
            else {}
        ),
        **(
            {f"{values['module']}/env.py": _render("env.py.tmpl", chosen, values)}
            if Role.ENV in chosen
            else {}
        ),
        "tests/test_conformance.py": _render("test_conformance.py.tmpl", chosen, values),
    }
    staging = Path(tempfile.mkdtemp(prefix=f".{values['dist']}.", dir=parent))
    try:
        for rel, text in files.items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        staging.chmod(0o755)
        try:
            os.rename(staging, target)  # one step; fails if a non-empty target appeared meanwhile
        except OSError as err:
            raise ConfigError(
                f"{target} appeared while writing it ({err}); nothing was overwritten", key="dir"
            ) from err
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target

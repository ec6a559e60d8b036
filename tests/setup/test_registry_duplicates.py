"""A plugin distribution installed twice, and a backend name two distributions declare.

Real files on ``sys.path``: each test writes package directories and ``.dist-info``
directories (METADATA, entry_points.txt, RECORD with sha256 hashes) into temporary
site directories, exactly as pip leaves them, and loads them through
``importlib.metadata``. ``rlcore_dupe_backend`` is the plugin installed twice;
``rlcore_good_backend`` is a healthy plugin in the same scan.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlcore.declarations import Role
from rlcore.errors import BackendNotFoundError
from rlcore.setup.registry import ALLOWLIST_ENV, ENTRY_POINT_GROUP, load_registry

REPO = Path(__file__).resolve().parents[2]
DUPE = "rlcore-dupe-backend"
DUPE_INFO = "rlcore_dupe_backend-{}.dist-info"


def _backend_source(backend: str, version: str, role: str = "POLICY") -> str:
    """A plugin module declaring ``backend``; ``version`` makes each copy's code differ."""
    hook = "rlcore_init_policy" if role == "POLICY" else "rlcore_init_generation"
    transports = "send_transports" if role == "POLICY" else "receive_transports"
    return (
        "from rlcore.declarations import BackendDeclaration, Role\n"
        "from rlcore.hookspecs import hookimpl\n\n"
        f"CODE_VERSION = {version!r}\n\n\n"
        "@hookimpl\n"
        "def rlcore_declare_backend():\n"
        f"    return BackendDeclaration(name={backend!r}, roles={{Role.{role}}}, "
        f"{transports}={{'disk'}}, description='code of ' + CODE_VERSION)\n\n\n"
        "@hookimpl\n"
        f"def {hook}(ctx):\n"
        "    return CODE_VERSION\n"
    )


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install_copy(
    site: Path,
    dist: str,
    version: str,
    entry_points: dict[str, str],
    sources: dict[str, str],
    *,
    write_code: bool = True,
) -> Path:
    """Install ``dist`` ``version`` into ``site`` the way pip does; returns its dist-info.

    ``sources`` maps package-relative paths (``pkg/plugin.py``) to their text; RECORD
    lists each with its hash. ``write_code=False`` writes only the metadata: a stale
    dist-info whose files were since overwritten or removed.
    """
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    record = []
    for rel, text in sources.items():
        if write_code:
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(text)
        record.append(f"{rel},{_record_hash(text.encode())},{len(text.encode())}")
    meta = {
        "METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        "entry_points.txt": f"[{ENTRY_POINT_GROUP}]\n"
        + "".join(f"{name} = {module}\n" for name, module in entry_points.items()),
        "INSTALLER": "pip\n",
    }
    for name, text in meta.items():
        (info / name).write_text(text)
        record.append(f"{info.name}/{name},{_record_hash(text.encode())},{len(text.encode())}")
    record.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return info


def install_dupe(site: Path, version: str, *, write_code: bool = True) -> Path:
    """``rlcore-dupe-backend`` ``version``: plugin 'dupe' declaring backend 'dupe'."""
    sources = {
        "rlcore_dupe_backend/__init__.py": "",
        "rlcore_dupe_backend/plugin.py": _backend_source("dupe", version),
    }
    return install_copy(
        site, DUPE, version, {"dupe": "rlcore_dupe_backend.plugin"}, sources, write_code=write_code
    )


def install_good(site: Path) -> Path:
    """``rlcore-good-backend`` 2.0: plugin 'goodone', a healthy generation backend."""
    sources = {
        "rlcore_good_backend/__init__.py": "",
        "rlcore_good_backend/plugin.py": _backend_source("goodone", "2.0", "GENERATION"),
    }
    return install_copy(
        site, "rlcore-good-backend", "2.0", {"goodone": "rlcore_good_backend.plugin"}, sources
    )


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No allowlist from the environment; this file's plugin modules forgotten after."""
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    yield
    ours = ("rlcore_dupe", "rlcore_good", "rlcore_clash")
    for name in [m for m in sys.modules if m.startswith(ours)]:
        del sys.modules[name]


def _load(monkeypatch: pytest.MonkeyPatch, sites: list[Path], allow: list[str]):
    for site in reversed(sites):  # syspath_prepend puts each first: the first site ends first
        monkeypatch.syspath_prepend(str(site))
    return load_registry(allow=allow)


@pytest.fixture
def split_sites(tmp_path: Path) -> tuple[Path, Path]:
    """The issue's case: a stale 0.0.9 dist-info (no code left) in a directory earlier on
    ``sys.path`` than 0.1.0 with its code: ``entry_points()`` reports 0.0.9, 0.1.0 runs."""
    stale, current = tmp_path / "stale_site", tmp_path / "site"
    install_dupe(stale, "0.0.9", write_code=False)
    install_dupe(current, "0.1.0")
    install_good(current)
    return stale, current


def test_stale_dist_info_earlier_on_the_path_refuses_the_plugin(
    split_sites: tuple[Path, Path], isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale, current = split_sites
    reg = _load(monkeypatch, [stale, current], ["dupe", "goodone"])
    assert "dupe" not in reg.backends
    [failure] = [f for f in reg.failures if f.name == "dupe"]
    assert failure.stage == "duplicate" and failure.distribution == DUPE
    assert failure.version == "0.1.0"  # the version of the code Python imports
    assert "\n" not in failure.message
    stale_info, current_info = (
        stale / DUPE_INFO.format("0.0.9"),
        current / DUPE_INFO.format("0.1.0"),
    )
    imported = current / "rlcore_dupe_backend" / "plugin.py"
    assert failure.message.startswith(
        f"plugin 'dupe' (distribution {DUPE}) is installed 2 times: 0.0.9 at {stale_info} and "
        f"0.1.0 at {current_info} (Python imports its code: {imported.resolve()}), so it was "
        "not loaded"
    )
    assert f"rm -r {stale_info} " in failure.message  # the fix: only the stale metadata
    assert [(c.version, c.location, c.imported) for c in failure.copies] == [
        ("0.0.9", str(stale_info), False),
        ("0.1.0", str(current_info), True),
    ]
    assert "rlcore_dupe_backend" not in sys.modules  # refused before its code ran
    # every other backend still loads, and selecting the refused one says why
    assert reg.backends["goodone"].version == "2.0"
    assert reg.backend_for(Role.GENERATION, "goodone").name == "goodone"
    with pytest.raises(BackendNotFoundError) as err:
        reg.backend_for(Role.POLICY, "dupe")
    assert f"rm -r {stale_info}" in str(err.value)


@pytest.mark.parametrize("on_disk", ["0.1.0", "0.0.9"])
def test_two_dist_infos_in_one_site_the_hashes_tell_which_code_is_imported(
    on_disk: str, tmp_path: Path, isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both RECORDs list the same file; only the copy whose hash matches it was imported
    (whichever directory ``os.listdir`` happens to return first)."""
    site = tmp_path / "site"
    other = "0.0.9" if on_disk == "0.1.0" else "0.1.0"
    install_dupe(site, other)
    install_dupe(site, on_disk)  # its files overwrite the other copy's
    install_good(site)
    reg = _load(monkeypatch, [site], ["dupe", "goodone"])
    [failure] = [f for f in reg.failures if f.name == "dupe"]
    assert failure.version == on_disk
    assert {c.version: c.imported for c in failure.copies} == {on_disk: True, other: False}
    assert f"rm -r {site / DUPE_INFO.format(other)} " in failure.message
    assert str(site / DUPE_INFO.format(on_disk)) in failure.message
    assert sorted(reg.backends) == ["goodone"]


def test_undecidable_copies_are_refused_with_a_reinstall(
    tmp_path: Path, isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither RECORD matches the code that is there: rlcore says it cannot tell."""
    site = tmp_path / "site"
    install_dupe(site, "0.0.9")
    install_dupe(site, "0.1.0")
    (site / "rlcore_dupe_backend" / "plugin.py").write_text(_backend_source("dupe", "edited"))
    reg = _load(monkeypatch, [site], ["dupe"])
    [failure] = reg.failures
    assert failure.version is None and not any(c.imported for c in failure.copies)
    assert "cannot tell which copy" in failure.message
    assert f"pip install --force-reinstall --no-deps '{DUPE}==<that version>'" in failure.message
    assert "dupe" not in reg.backends


def test_an_unhashed_egg_info_and_an_editable_install_are_not_guessed_between(
    tmp_path: Path, isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project on ``sys.path`` with its ``.egg-info`` (SOURCES.txt lists the module, no
    hash) at 0.0.9, and an editable 0.1.0 install of that project: both hold the code."""
    project, site = tmp_path / "project", tmp_path / "site"
    (project / "rlcore_dupe_backend").mkdir(parents=True)
    (project / "rlcore_dupe_backend" / "__init__.py").write_text("")
    (project / "rlcore_dupe_backend" / "plugin.py").write_text(_backend_source("dupe", "src"))
    egg = project / "rlcore_dupe_backend.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: {DUPE}\nVersion: 0.0.9\n")
    (egg / "SOURCES.txt").write_text(
        "rlcore_dupe_backend/__init__.py\nrlcore_dupe_backend/plugin.py\n"
    )
    (egg / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ndupe = rlcore_dupe_backend.plugin\n"
    )
    editable = install_copy(site, DUPE, "0.1.0", {"dupe": "rlcore_dupe_backend.plugin"}, {})
    direct_url = {"url": project.as_uri(), "dir_info": {"editable": True}}
    (editable / "direct_url.json").write_text(json.dumps(direct_url))
    reg = _load(monkeypatch, [project, site], ["dupe"])
    [failure] = reg.failures
    assert [(c.version, c.imported) for c in failure.copies] == [("0.0.9", False), ("0.1.0", False)]
    assert "cannot tell which copy" in failure.message and str(egg) in failure.message
    assert "dupe" not in reg.backends


def test_copies_of_one_version_are_not_refused(
    tmp_path: Path, isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project's own metadata beside its install (same version) is not a stale copy."""
    first, second = tmp_path / "a", tmp_path / "b"
    install_dupe(first, "0.1.0")
    install_dupe(second, "0.1.0")
    reg = _load(monkeypatch, [first, second], ["dupe"])
    assert reg.failures == []
    assert reg.backends["dupe"].version == "0.1.0"


def test_two_distributions_declaring_one_backend_are_both_refused(
    tmp_path: Path, isolated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    infos = {}
    for letter, version in (("a", "1.0"), ("b", "3.2")):
        package = f"rlcore_clash_{letter}"
        infos[letter] = install_copy(
            site,
            f"rlcore-clash-{letter}",
            version,
            {f"clash_{letter}": f"{package}.plugin"},
            {
                f"{package}/__init__.py": "",
                f"{package}/plugin.py": _backend_source("clash", version),
            },
        )
    install_good(site)
    reg = _load(monkeypatch, [site], ["clash_a", "clash_b", "goodone"])
    assert sorted(reg.backends) == ["goodone"]
    assert reg.pm.get_plugin("clash_a") is None and reg.pm.get_plugin("clash_b") is None
    [failure] = reg.failures  # one line for the backend, naming both plugins
    assert failure.stage == "duplicate" and failure.backend == "clash"
    assert set(failure.plugins) == {"clash_a", "clash_b"} and "\n" not in failure.message
    for part in (
        f"plugin 'clash_a' (distribution rlcore-clash-a 1.0 at {infos['a']})",
        f"plugin 'clash_b' (distribution rlcore-clash-b 3.2 at {infos['b']})",
        "pip uninstall rlcore-clash-a, or pip uninstall rlcore-clash-b",
    ):
        assert part in failure.message
    with pytest.raises(BackendNotFoundError) as err:
        reg.backend_for(Role.POLICY, "clash")
    assert "pip uninstall rlcore-clash-b" in str(err.value)


def _cli(args: list[str], sites: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ALLOWLIST_ENV}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sites), str(REPO)])
    env[ALLOWLIST_ENV] = "dupe,goodone"
    code = f"import sys, rlcore.app.cli; sys.exit(rlcore.app.cli.main({args!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_plugins_shows_the_imported_version(split_sites: tuple[Path, Path]) -> None:
    stale, current = split_sites
    proc = _cli(["plugins", "--json"], [stale, current])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [(b["name"], b["version"]) for b in data["backends"]] == [("goodone", "2.0")]
    [dupe] = [f for f in data["failures"] if f["plugin"] == "dupe"]
    assert dupe["stage"] == "duplicate" and dupe["version"] == "0.1.0"
    assert [(c["version"], c["location"], c["imported"]) for c in dupe["copies"]] == [
        ("0.0.9", str(stale / DUPE_INFO.format("0.0.9")), False),
        ("0.1.0", str(current / DUPE_INFO.format("0.1.0")), True),
    ]
    text = _cli(["plugins"], [stale, current])
    assert text.returncode == 0, text.stderr
    [line] = [ln for ln in text.stdout.splitlines() if "skipped plugin dupe" in ln]
    assert line.startswith(f"skipped plugin dupe ({DUPE} 0.1.0), duplicate:")
    assert "0.0.9 at" in line and f"rm -r {stale / DUPE_INFO.format('0.0.9')}" in line

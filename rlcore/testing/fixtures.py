"""What the fixtures of a backend's own tests are built from::

    @pytest.fixture(scope="session")
    def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tiny_model_dir(tmp_path_factory)

rlcore's tiny model in a temporary directory, an :class:`rlcore.context.InitContext`
for one init hook without the rest of setup, this host's address beyond loopback,
what a fresh interpreter loads with a plugin module, and the sockets a process listens on. Imports the config stack and
torch only when called.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from rlcore.config import RunConfig
    from rlcore.context import InitContext
    from rlcore.declarations import Role


def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, name: str = "tiny-model") -> Path:
    """A new temporary directory ``name`` holding rlcore's tiny model (default config)."""
    from rlcore.config import TinyModelConfig
    from rlcore.models.tiny import write_tiny_model

    path = tmp_path_factory.mktemp(name)
    write_tiny_model(path, TinyModelConfig())
    return path


def init_context(
    role: Role,
    backend: str,
    config: RunConfig,
    options_class: type,
    *,
    run_dir: Path,
    cache_dir: Path | None = None,
    options: Mapping[str, Any] | None = None,
    deadline_s: float = 300.0,
) -> InitContext:
    """An InitContext for ``backend``'s init hook of ``role``, with its own cancel token,
    deadline (``init:<role>``) and event board, as ``rlcore.setup.runner`` builds it.

    ``options`` default to the config section's; ``cache_dir`` to ``setup.cache_dir``,
    else ``run_dir``. Raises :class:`rlcore.errors.ConfigError` on options
    ``options_class`` does not take.
    """
    from rlcore.config import resolve_options
    from rlcore.context import InitContext
    from rlcore.errors import CancelToken, Deadline
    from rlcore.setup.events import EventBoard

    section = role.value
    if options is None:
        options = getattr(config, section).options
    cancel = CancelToken()
    return InitContext(
        role=role,
        backend=backend,
        config=config,
        options=resolve_options(options, options_class, section=section, backend=backend),
        cancel=cancel,
        deadline=Deadline(deadline_s, f"init:{section}"),
        run_dir=run_dir,
        cache_dir=cache_dir if cache_dir is not None else Path(config.setup.cache_dir or run_dir),
        events=EventBoard(cancel),
    )


def outward_address() -> str:
    """An address of this host other hosts could reach (not loopback); skips the test
    when the host has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        addr = str(s.getsockname()[0])
    if addr.startswith("127."):
        pytest.skip("this host has no address beyond loopback")
    return addr


def heavy_imports(plugin: str, *also: str, heavy: Iterable[str], timeout_s: float = 60.0) -> list[str]:
    """The modules of the packages ``heavy`` that a fresh interpreter has loaded after
    importing the plugin module ``plugin``, calling its ``rlcore_declare_backend()`` and
    importing the modules ``also``. Raises AssertionError if that fails."""
    script = (
        "import importlib, json, sys\n"
        f"importlib.import_module({plugin!r}).rlcore_declare_backend()\n"
        f"for name in {list(also)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise AssertionError(f"importing {plugin} failed:\n{out.stderr}")
    packages = set(heavy)
    return [m for m in json.loads(out.stdout) if m.split(".")[0] in packages]


def listening_sockets(proc: Any, *, udp: bool = True) -> list[tuple[str, int, str]]:
    """``(ip, port, "tcp" | "udp")`` of the TCP sockets ``proc`` (a ``psutil.Process``)
    listens on and, with ``udp``, the UDP sockets it bound without a peer: what another
    host could reach. Raises ``psutil.Error`` if the process is gone."""
    import psutil

    out = []
    for c in proc.net_connections("inet"):
        if not c.laddr:
            continue
        if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
            out.append((c.laddr.ip, c.laddr.port, "tcp"))
        elif udp and c.type == socket.SOCK_DGRAM and not c.raddr:
            out.append((c.laddr.ip, c.laddr.port, "udp"))
    return out

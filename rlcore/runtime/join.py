"""Which Ray cluster a run uses, and whether it can be joined, decided before the run writes anything.

:func:`choose_cluster` picks the cluster the way Ray's own tools would, with one
exception: an explicit ``cluster.address`` (``local``: the embedded cluster, whatever the
environment says); else the cluster this process already is a driver of (a script that
called ``ray.init`` before :func:`rlcore.open`); else ``RAY_ADDRESS`` (which Ray sets for the
driver of a ``ray job submit`` job, and which ``ray status`` and friends read); else a new
embedded cluster. Ray's file of the last cluster started on this host
(``/tmp/ray/ray_current_cluster``) is never read unless ``cluster.address=auto`` asks for it:
a cluster left over from another session must not take a run over.

:func:`check_join` asks the cluster's GCS, without joining it, what ``ray.init`` would find
out slowly or not at all: whether anything listens at the address (a refused connect is
seen at once, where ``ray.init`` retries for minutes), whether it takes this machine's token
(found as Ray's CLI finds it: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
``~/.ray/auth_token``; with ``RAY_AUTH_MODE`` unset, a token found turns token
authentication on, as ``ray start`` and ``ray status`` do), whether it runs this driver's
Ray and Python, and what its alive nodes offer. Every failure is one
:class:`~rlcore.errors.ConfigError` line naming the address and the cause.

A loopback address stays loopback: Ray would rewrite ``127.0.0.1`` to the host's outward
address, where a single-host cluster (its head started with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) does not listen (:func:`single_host`). The other
nodes of such a cluster Ray's CLI cannot start; ``python -m rlcore.runtime.join ARGS`` does
(:func:`start_loopback_node`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import platform
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcore.config import ClusterConfig
from rlcore.config.placement import NodeInfo
from rlcore.errors import ConfigError

log = logging.getLogger(__name__)

#: Set by Ray for the driver of a job (``ray job submit``): the job's config, with its
#: runtime environment, which ``ray.init`` merges into the driver's.
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
#: Ray's address variable (``ray status``, ``ray.init()``, and a job's driver read it).
ADDRESS_ENV = "RAY_ADDRESS"
#: Seconds a TCP connect to the GCS may take before the address is said not to answer.
CONNECT_TIMEOUT_S = 3.0
#: Seconds the GCS has to answer once connected (its cluster id, metadata and nodes).
ANSWER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ClusterChoice:
    """The cluster a run uses and why: ``address`` ``None`` is a new embedded cluster;
    ``attached`` is a connection this process already had (kept open at the end)."""

    address: str | None
    why: str
    attached: bool = False

    @property
    def joined(self) -> bool:
        return self.address is not None or self.attached

    def describe(self) -> str:
        """One line for ``rlcore plan`` and a run's first lines."""
        if self.attached:
            return f"the Ray cluster this process is connected to ({self.why})"
        if self.address is None:
            return f"a new embedded Ray cluster on this host ({self.why})"
        return f"the Ray cluster at {self.address} ({self.why})"


def choose_cluster(config: ClusterConfig, environ: Mapping[str, str] | None = None) -> ClusterChoice:
    """The cluster a run with ``config`` uses here (see the module doc for the order)."""
    env = os.environ if environ is None else environ
    if config.address == "local":
        return ClusterChoice(None, "cluster.address=local")
    if config.address:
        return ClusterChoice(config.address, "cluster.address")
    if _ray_connected():
        return ClusterChoice(None, "ray.init was called before rlcore", attached=True)
    address = env.get(ADDRESS_ENV, "").strip()
    if address and address not in ("local", "auto"):
        if JOB_CONFIG_ENV in env:
            return ClusterChoice(address, f"this is the driver of a Ray job: {ADDRESS_ENV} set by Ray")
        return ClusterChoice(address, f"{ADDRESS_ENV} is set; cluster.address=local runs on an embedded one")
    return ClusterChoice(None, f"no cluster.address and no {ADDRESS_ENV}; a Ray cluster file alone is never joined")


def _ray_connected() -> bool:
    """Whether this process is already a Ray driver (without importing Ray)."""
    import sys

    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())


def job_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of the runtime environment of the Ray job this process is the driver of."""
    env = os.environ if environ is None else environ
    try:
        job = json.loads(env.get(JOB_CONFIG_ENV) or "{}")
    except ValueError:
        return {}
    return dict(((job.get("runtime_env") or {}).get("env_vars")) or {})


def is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]") or address
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


@contextlib.contextmanager
def single_host() -> Iterator[None]:
    """Keep Ray on loopback for the block: Ray's single-host switch
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) is a constant read at ``import ray``, so it is
    set on the module while the block runs (a loopback address is then not rewritten to
    the host's outward one, and a node started here binds 127.0.0.1)."""
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - a Ray without the switch: start as Ray decides
        log.warning("this Ray has no single-host switch; its ports may listen on every interface")
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def start_loopback_node(argv: list[str]) -> None:
    """``ray start ARGV`` for a node that joins a head on loopback: a cluster of several
    nodes on one host (``python -m rlcore.runtime.join ARGV``; docs/ray-cluster.md).

    Ray's CLI cannot start one. A head started with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    (Ray's single-host switch) listens on 127.0.0.1 only; with that switch on, ``ray start
    --address`` refuses any node but a head ("Multi-node Ray clusters are not supported on
    Windows and OSX"), and with it off, Ray rewrites 127.0.0.1 (the head's address and the
    node's own) to the host's outward address, where nothing listens: the node waits for
    ever. Ray's GCS and raylet bind loopback only for a node address of exactly 127.0.0.1,
    so another loopback address does not help either. Here the node may join, and a
    loopback address is kept as given (any other is resolved as Ray does). Exits with the
    CLI's exit code (with ``--block``: once the node has stopped).
    """
    from ray._private import ray_constants, services
    from ray.scripts.scripts import main as ray_main

    from rlcore.runtime.addresses import is_loopback as is_loopback_host

    resolve = services.resolve_ip_for_localhost

    def keep_loopback(host: str) -> str:
        return host if is_loopback_host(host) else resolve(host)

    # Both are read when called: the CLI's refusal of a worker node, and the rewrite.
    ray_constants.ENABLE_RAY_CLUSTER = True
    services.resolve_ip_for_localhost = keep_loopback
    sys.argv = ["ray", "start", *argv]
    ray_main()


# ---------------------------------------------------------------- the token


def token_sources(environ: Mapping[str, str] | None = None) -> list[str]:
    """Where this machine has a Ray token, in the order Ray's loader reads them."""
    env = os.environ if environ is None else environ
    found = []
    if env.get("RAY_AUTH_TOKEN"):
        found.append("RAY_AUTH_TOKEN")
    path = env.get("RAY_AUTH_TOKEN_PATH")
    if path and Path(path).expanduser().is_file():
        found.append(f"RAY_AUTH_TOKEN_PATH={path}")
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file():
        found.append(str(default))
    return found


#: Addresses whose GCS answered without a token (:func:`check_join` found it so): their
#: cluster runs without token authentication, and this driver must not turn it on.
_NO_TOKEN: set[str] = set()


def use_token_like_ray_cli(address: str | None = None) -> None:
    """Turn Ray's token authentication on in this process where Ray's CLI would: with
    ``RAY_AUTH_MODE`` unset and a token on this machine (``ray.init`` with an address never
    does this by itself, so a driver of a ``ray start`` cluster was refused), unless the
    cluster at ``address`` answered without one (:func:`check_join`): a driver with token
    authentication on refuses the calls of a GCS that runs without it, and every actor of
    the run died before it started."""
    if os.environ.get("RAY_AUTH_MODE") is not None or (address is not None and address in _NO_TOKEN):
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # pragma: no cover - a Ray without token authentication
        return
    # Ray logs a warning that token authentication is on; the run's first line says which cluster.
    quiet = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


# ---------------------------------------------------------------- the probe


@dataclass(frozen=True)
class ClusterFacts:
    """What the GCS of a cluster to join said (before joining it)."""

    address: str
    ray_version: str | None
    python_version: str | None
    nodes: list[NodeInfo] = field(default_factory=list)

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for n in self.nodes:
            for kind, amount in n.resources.items():
                out[kind] = out.get(kind, 0.0) + amount
        return out


def resolve_address(address: str) -> str:
    """``host:port`` of the GCS to join (``auto``: Ray's own lookup, ``RAY_ADDRESS`` or
    this host's last ``ray start``); a loopback address is kept as given."""
    from ray._private import services

    with single_host() if is_loopback(address) or address == "auto" else contextlib.nullcontext():
        try:
            resolved = services.canonicalize_bootstrap_address(address)
        except (ValueError, ConnectionError) as err:
            raise ConfigError(f"cluster.address {address!r}: {err}", key="cluster.address") from err
    if resolved is None:
        raise ConfigError(
            f"cluster.address {address!r}: no Ray cluster found (RAY_ADDRESS unset and no `ray start` on this host); "
            "give the head's host:port",
            key="cluster.address",
        )
    return resolved


def check_join(address: str, timeout_s: float = ANSWER_TIMEOUT_S) -> ClusterFacts | None:
    """Ask the GCS at ``address`` whether this driver can join it (module doc); ``None`` for
    a Ray Client address (``ray://``), which has no GCS to ask.

    Raises:
        ConfigError: one line naming the address and why it cannot be joined.
    """
    if "://" in address:
        log.info("not probing %s: a Ray Client address", address)
        return None
    given, address = address, resolve_address(address)
    _check_listening(address)
    facts = _ask_as_the_cluster_expects(address, timeout_s)
    if address in _NO_TOKEN:
        _NO_TOKEN.add(given)  # the join names the cluster as the config did
    _check_versions(facts)
    return facts


def _ask_as_the_cluster_expects(address: str, timeout_s: float) -> ClusterFacts:
    """Ask without a token first (unless ``RAY_AUTH_MODE`` says, or a token is on already);
    a GCS that answers runs without token authentication (remembered: the join then leaves
    it off); one that refuses for want of a token is asked again with the machine's token,
    as Ray's CLI would send it."""
    if os.environ.get("RAY_AUTH_MODE") is not None or _token_on():
        return _ask_gcs(address, timeout_s)
    try:
        facts = _ask_gcs(address, timeout_s, raw=True)
    except Exception as err:  # noqa: BLE001 - an authentication refusal is retried, the rest explained
        if not _is_auth_error(err):
            raise _explain(address, err) from None
        use_token_like_ray_cli()
        return _ask_gcs(address, timeout_s)
    _NO_TOKEN.add(address)
    return facts


def _token_on() -> bool:
    """Whether this process already sends a token (an earlier join turned it on)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # pragma: no cover - another Ray's layout
        return False
    return bool(is_token_auth_enabled())


def _is_auth_error(err: BaseException) -> bool:
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(err, AuthenticationError)


def _fail(address: str, cause: str) -> ConfigError:
    return ConfigError(f"cannot join the Ray cluster at {address}: {cause}", key="cluster.address")


def _check_listening(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except ConnectionRefusedError:
        raise _fail(address, "nothing is listening there (connection refused); start the head "
                    "(`ray start --head`) or fix cluster.address") from None
    except TimeoutError:
        raise _fail(address, f"no answer to a connect within {CONNECT_TIMEOUT_S:g}s (a firewall, "
                    "or a host that is down)") from None
    except (OSError, ValueError) as err:
        raise _fail(address, f"cannot connect: {err}") from None


def _ask_gcs(address: str, timeout_s: float, *, raw: bool = False) -> ClusterFacts:
    """The GCS's metadata and nodes, asked in a thread of its own: Ray's client blocks in C++
    and cannot be interrupted, so a GCS that never answers is left to it after ``timeout_s``.
    ``raw``: the client's own error is raised (else explained in one line)."""
    box: dict[str, Any] = {}

    def ask() -> None:
        try:
            from ray._raylet import GcsClient

            gcs = GcsClient(address=address)
            meta = gcs.internal_kv_get(b"CLUSTER_METADATA", namespace=b"cluster", timeout=timeout_s)
            infos = gcs.get_all_node_info(timeout=timeout_s)
            box["facts"] = _facts(address, meta, infos)
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=ask, name="rlcore-gcs-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if thread.is_alive():
        raise _fail(address, f"its GCS accepted the connection but did not answer within {timeout_s:g}s "
                    "(is this a Ray head's GCS port?)")
    err = box.get("error")
    if err is not None:
        if raw:
            raise err
        raise _explain(address, err) from None
    return box["facts"]


def _facts(address: str, meta: bytes | None, infos: Mapping[Any, Any]) -> ClusterFacts:
    info = json.loads(meta) if meta else {}
    alive = []
    for node_id, node in infos.items():
        if int(node.state) != 0:  # GcsNodeInfo.ALIVE is 0
            continue
        alive.append(NodeInfo(node_id.hex(), dict(node.resources_total), dict(node.labels)))
    return ClusterFacts(address, info.get("ray_version"), info.get("python_version"), alive)


def _explain(address: str, err: BaseException) -> ConfigError:
    """A refused token says which token was tried, or that none was found, and the fix."""
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:  # pragma: no cover
        AuthenticationError = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(err, AuthenticationError):
        sources = token_sources()
        fix = ("copy the cluster's token (`ray get-auth-token` on the head prints it) to ~/.ray/auth_token "
               "here, or set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH")
        if not sources:
            return _fail(address, f"it uses Ray's token authentication and this machine has no token "
                         f"(no RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); {fix}")
        if os.environ.get("RAY_AUTH_MODE", "").lower() not in ("", "token"):
            return _fail(address, f"it uses Ray's token authentication, but RAY_AUTH_MODE="
                         f"{os.environ['RAY_AUTH_MODE']} here; unset it or set RAY_AUTH_MODE=token")
        return _fail(address, f"it refused this machine's token (from {sources[0]}); {fix}")
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return _fail(address, f"its GCS did not answer: {first}")


def _check_versions(facts: ClusterFacts) -> None:
    import ray

    here_ray, here_py = ray.__version__, platform.python_version()
    if facts.ray_version is None:
        return  # a GCS that keeps no metadata: ray.init compares what it can
    if facts.ray_version != here_ray or facts.python_version != here_py:
        raise _fail(facts.address, f"it runs Ray {facts.ray_version} on Python {facts.python_version}, this "
                    f"driver Ray {here_ray} on Python {here_py}; run rlcore with the cluster's Ray and "
                    "Python (the image its nodes run)")


if __name__ == "__main__":
    start_loopback_node(sys.argv[1:])

"""Network addresses of a run: free ports, loopback, this node's address, and the
interface collectives listen on.

A single-host run keeps everything on loopback (nothing another host can reach); a run
across nodes binds to the node's address, the one Ray reaches the node by.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

from rlcore.config.placement import Network

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` or ``localhost``: an address no other host can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (None when none does)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == address for a in addrs):
                return str(name)
    except Exception as err:  # pragma: no cover - psutil missing or no permission
        log.debug("cannot list network interfaces: %s", err)
    return None


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 (``lo`` on Linux)."""
    return interface_of("127.0.0.1") or "lo"


def pin_collectives_to(host: str) -> None:
    """Make gloo listen where the rendezvous is: on the loopback interface when ``host``
    is loopback (a single-host run then opens no port that another host can reach, and
    NCCL's bootstrap is pinned there too); otherwise on the interface that holds this
    process's node address, the one Ray reaches the node by, so ranks on other nodes
    reach this one whatever the host name resolves to (often 127.0.1.1).

    Sets ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` for loopback) in this process
    unless the user chose an interface; process groups created afterwards pick it up.
    """
    if is_loopback(host):
        iface = loopback_interface()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
        return
    own = interface_of(node_ip())
    if own is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", own)


def server_host(network: Network | None) -> str:
    """The address a server of this process binds: loopback when the run has no reader
    on another node (:class:`rlcore.config.placement.Network`), else this node's address."""
    return node_ip() if network is not None and network.readers_elsewhere else "127.0.0.1"


def node_ip() -> str:
    """This process's address for rendezvous: the Ray node's address, which is loopback
    for rlcore's embedded single-host cluster (:mod:`rlcore.runtime.cluster`)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # pragma: no cover - fallback outside Ray
        pass
    return "127.0.0.1"



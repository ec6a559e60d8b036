"""Rendezvous stores: the ``torch.distributed.TCPStore`` a group meets at, listening
before its address is handed out and bound only where the run's ranks are.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from rlcore.runtime.addresses import node_ip, pin_collectives_to

#: Listening sockets of stores this process will serve, by (host, port): see :func:`listen_ahead`.
_LISTENING: dict[tuple[str, int], socket.socket] = {}
_listening_lock = threading.Lock()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_ahead(host: str) -> int:
    """Listen on a free port of ``host`` now, for a rendezvous store this process will
    serve later (:func:`tcp_store` with ``is_master`` takes the socket); returns the port.

    The ranks of a rendezvous are told the address at once and race to it: a client whose
    connect came before the master's store listened was refused, and torch's client
    retries only after a backoff (0.3-0.5 s measured, against milliseconds when the server
    listens first). Listening from the moment the address is handed out, a client that
    comes first waits in the socket's backlog. The port is the kernel's choice, held from
    then on, so nothing else can take it between the answer and the store.
    """
    sock = _listen(host, 0)
    port = int(sock.getsockname()[1])
    with _listening_lock:
        _LISTENING[(host, port)] = sock
    return port


def listening_address() -> tuple[str, int]:
    """This process's node address and a port already listening there (:func:`listen_ahead`):
    what rank 0 answers when asked where a store it will serve meets."""
    host = node_ip()
    return host, listen_ahead(host)


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> Any:
    """A ``torch.distributed.TCPStore`` for rendezvous at ``host:port``.

    torch's store server listens on every interface whatever ``host`` says, so the
    master binds the listening socket to ``host`` itself and hands it to the store: on
    loopback (a single-host run) the store answers only on this host; on a node's
    address (a run across nodes) only on that address, not on every interface. The
    socket :func:`listen_ahead` opened for ``host:port`` is used where there is one.
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    pin_collectives_to(host)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master, timeout=timeout)
    with _listening_lock:
        sock = _LISTENING.pop((host, port), None)
    if sock is None:
        sock = _listen(host, port)
    # The store owns the descriptor from here on (it closes it), so the socket object lets go.
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, master_listen_fd=sock.detach())



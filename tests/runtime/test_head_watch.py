"""The head watch (:mod:`rlcore.runtime.head_watch`): a GCS port that stops accepting ends the run's waits."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from rlcore.errors import Cancelled, ClusterLost
from rlcore.runtime.gate import RAY_GATE
from rlcore.runtime.head_watch import HeadWatch, gcs_reachable
from rlcore.testing.waits import wait_for


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    RAY_GATE.open()  # an earlier test's cluster shutdown leaves the process's gate closed
    try:
        yield sock
    finally:
        sock.close()
        RAY_GATE.open()  # the watch closes the process's gate when it finds the head gone


def test_a_gcs_that_stops_accepting_is_lost_within_half_the_timeout(listener: socket.socket) -> None:
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    watch = HeadWatch()
    watch.start(address, timeout_s=1.0)
    try:
        time.sleep(0.5)
        assert not watch.lost  # answering: nothing said
        watch.raise_if_lost("step 1")
        closed_at = time.monotonic()
        listener.close()
        assert wait_for(lambda: watch.lost, timeout_s=4.0, step_s=0.02)
        # Half the timeout, plus a connect or two; a loaded machine may add a second.
        assert time.monotonic() - closed_at <= 2.0
        with pytest.raises(ClusterLost, match=rf"head is gone: its GCS at {address} .* during step 3") as err:
            watch.raise_if_lost("step 3")
        assert err.value.address == address
        with pytest.raises(Cancelled, match="head is gone"), RAY_GATE.call("a Ray call"):
            pass  # the run's Ray calls are refused: its teardown asks nothing of the dead GCS
    finally:
        watch.clear()
    assert not watch.lost and watch.error() is None


def test_a_stopped_watch_says_nothing_when_the_gcs_goes_on_purpose(listener: socket.socket) -> None:
    watch = HeadWatch()
    watch.start(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.5)
    watch.stop()
    listener.close()
    time.sleep(0.6)
    assert not watch.lost and RAY_GATE.closed is None


def test_reachable_only_where_something_listens(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    assert gcs_reachable(f"127.0.0.1:{port}", 1.0)
    listener.close()
    assert not gcs_reachable(f"127.0.0.1:{port}", 1.0)
    assert not gcs_reachable("not-an-address", 1.0)

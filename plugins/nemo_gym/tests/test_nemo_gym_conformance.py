"""rlcore's conformance suite against the nemo_gym env backend.

Gym's servers run from the Gym venv and call a TEST-ONLY stub of the generation
endpoint (``gym_helpers.StubEndpoint``), announced as the ``generation.endpoint``
event. Skipped only when the Gym venv is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gym_helpers import StubEndpoint, gym_python

from rlcore.testing import BackendConformance

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        gym_python() is None, reason="the NeMo Gym venv (.venv-gym) is not installed: run bash install.sh --all"
    ),
]

_STUB: list[StubEndpoint] = []


@pytest.fixture(scope="module", autouse=True)
def stub() -> Iterator[StubEndpoint]:
    s = StubEndpoint().start()
    _STUB.append(s)
    yield s
    _STUB.clear()
    s.stop()


class TestNemoGymConformance(BackendConformance):
    plugin = "rlcore_nemo_gym.plugin"
    init_timeout_s = 240.0
    settle_s = 10.0
    heavy_modules = (*BackendConformance.heavy_modules, "nemo_gym", "httpx")
    # The stub's thread and HTTP server are the test's, not the backend's.
    leak_ignore_threads = ("stub-endpoint",)

    def conformance_events(self) -> dict[str, Any]:
        return {"generation.endpoint": _STUB[0].endpoint}

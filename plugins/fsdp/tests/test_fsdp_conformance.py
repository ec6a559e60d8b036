"""rlcore's conformance suite against the fsdp policy backend.

The generation side of the refit round trips and of the logprob comparison is
rlcore's reference peer (transformers in one Ray actor), the suite's default.
"""

from __future__ import annotations

import pytest

from rlcore.testing import BackendConformance

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


class TestFSDPConformance(BackendConformance):
    plugin = "rlcore_fsdp.plugin"
    needs_ray = True
    config_overrides = ("policy.devices_per_worker=0.5",)

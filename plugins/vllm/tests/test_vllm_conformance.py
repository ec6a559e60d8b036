"""rlcore's conformance suite against the vllm generation backend.

The policy side of the refit round trips, and the policy whose logprobs
``generate()``'s are compared with, is rlcore's reference peer (transformers in one
Ray actor). The engines run in the session's Ray cluster (``conftest.ray_cluster``).
"""

from __future__ import annotations

import pytest

from rlcore.testing import BackendConformance

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


class TestVLLMConformance(BackendConformance):
    plugin = "rlcore_vllm.plugin"
    needs_ray = True
    init_timeout_s = 300.0
    config_overrides = ("generation.devices_per_worker=0.5",)

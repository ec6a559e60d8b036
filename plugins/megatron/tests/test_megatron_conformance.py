"""rlcore's conformance suite against the megatron backend (policy and generation).

Every claim of the declaration is exercised through the real init hooks in Ray:
init/shutdown per role without leaks, cancellation and a passed deadline, both
inits at the same moment (non-colocated overlap safety), the atomically published
checkpoint, refit-fed start and refit round trips over every transport, checked
by generation-vs-policy logprobs. It starts many worker groups: about 2-3 minutes
on two cores, hence ``slow``.
"""

from __future__ import annotations

import pytest

from rlcore.testing import BackendConformance

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


class TestMegatronConformance(BackendConformance):
    plugin = "rlcore_megatron.plugin"
    needs_ray = True
    ray_num_cpus = 2
    init_timeout_s = 240.0
    # The endpoint is claimed (openai_endpoint=True) and served with serve_openai.
    config_overrides = (
        "policy.devices_per_worker=0.5",
        "generation.devices_per_worker=0.5",
        "generation.options.serve_openai=true",
    )

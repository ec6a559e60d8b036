"""rlcore's conformance suite against the sglang backend, with the FSDP policy as the
refit peer (as a real run pairs them).

Every claim of the declaration is exercised through the real init hook in Ray with
real SGLang servers: init/shutdown without leaks (and SGLang's /v1 answering
``GET /models``), cancellation and a passed deadline, two servers starting at the
same moment (non-colocated overlap safety), refit-fed start, and refit round trips
over collective, disk and shared memory (checked by generation-vs-policy logprobs).
It starts eight SGLang servers (and FSDP peers): 9-12 minutes on two cores shared with
other jobs (load ~8), hence ``slow``.
"""

from __future__ import annotations

import pytest

from rlcore.testing import BackendConformance
from rlcore.testing.harness import Harness

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


class TestSGLangConformance(BackendConformance):
    plugin = "rlcore_sglang.plugin"
    peer_plugin = "rlcore_fsdp.plugin"
    needs_ray = True
    ray_num_cpus = 2
    init_timeout_s = 300.0
    settle_s = 10.0
    max_token_mult_prob_error = 1.0001
    config_overrides = ("policy.workers=1", "policy.devices_per_worker=1", "generation.devices_per_worker=1")

    @pytest.mark.soak
    def test_overlap_non_colocated(self, harness: Harness) -> None:
        """Two SGLang servers started at the same moment: 45 s on two quiet cores, 5 min
        on a loaded CI machine, for a claim the other servers' tests meet one at a time
        (init, refit, generation) and ``examples/sglang_nemo_gym.yaml`` meets overlapped."""
        super().test_overlap_non_colocated(harness)

    @pytest.mark.soak
    def test_refit_round_trip(self, harness: Harness) -> None:
        """The round trip with a server that loaded the checkpoint: the same refit through
        the same transports as ``test_refit_fed_round_trip`` (which runs by default), after
        a start that ``test_init_and_shutdown`` covers."""
        super().test_refit_round_trip(harness)

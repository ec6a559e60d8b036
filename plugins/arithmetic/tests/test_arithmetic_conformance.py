"""rlcore's conformance suite against the arithmetic env backend.

``collect_rollouts`` samples through rlcore's reference generation (transformers in
one Ray actor, started by the suite when the env first samples).
"""

from __future__ import annotations

from rlcore.testing import BackendConformance


class TestArithmeticConformance(BackendConformance):
    plugin = "rlcore_arithmetic.plugin"

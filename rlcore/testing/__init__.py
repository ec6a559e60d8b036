"""rlcore's conformance suite for backend plugins.

In a plugin's tests::

    from rlcore.testing import BackendConformance

    class TestFoo(BackendConformance):
        plugin = "rlcore_foo.plugin"

The declaration is the requirements object: every claim in it is tested, and
tests of features it does not claim are skipped. See ``docs/writing-a-backend.md``.
Needs pytest and psutil (``pip install rlcore[test]``).
"""

import pytest

pytest.register_assert_rewrite("rlcore.testing.suite")

from rlcore.testing.harness import (  # noqa: E402 - after the assert-rewrite registration
    ConformanceFailure,
    Harness,
    LeakCheck,
    NotApplicable,
    resolve_plugin,
)
from rlcore.testing.suite import BackendConformance  # noqa: E402

__all__ = [
    "BackendConformance",
    "ConformanceFailure",
    "Harness",
    "LeakCheck",
    "NotApplicable",
    "resolve_plugin",
]

"""rlcore's conformance suite for backend plugins.

In a plugin's tests::

    from rlcore.testing import BackendConformance

    class TestFoo(BackendConformance):
        plugin = "rlcore_foo.plugin"

The declaration is the requirements object: every claim in it is tested, and
tests of features it does not claim are skipped. The roles the plugin does not
serve are played by rlcore's reference peer (``rlcore.testing.peers.REFERENCE``). See ``docs/writing-a-backend.md``.
Needs pytest and psutil (``pip install rlcore[test]``).
"""

from typing import Any

import pytest

pytest.register_assert_rewrite("rlcore.testing.suite")

# Loaded on first use, so that ``rlcore.testing.reference`` (torch and transformers
# only) imports where the core's config stack does not exist (the GPU machines).
_EXPORTS = {
    "BackendConformance": "rlcore.testing.suite",
    "ConformanceFailure": "rlcore.testing.harness",
    "Harness": "rlcore.testing.harness",
    "LeakCheck": "rlcore.testing.harness",
    "NotApplicable": "rlcore.testing.harness",
    "REFERENCE": "rlcore.testing.peers",
    "ReferencePlugin": "rlcore.testing.peers",
    "resolve_plugin": "rlcore.testing.harness",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlcore.testing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)

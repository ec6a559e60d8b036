"""Fixtures of the nemo_gym backend's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlcore.testing import LeakCheck


@pytest.fixture
def leaks() -> Iterator[LeakCheck]:
    """A :class:`LeakCheck`; after the test, nothing it started may be left 10 s on."""
    check = LeakCheck()
    yield check
    left = check.problems(10.0)
    assert not left, f"left behind: {left}"

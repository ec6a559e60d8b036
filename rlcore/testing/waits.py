"""Waiting in tests: poll a condition with a deadline instead of sleeping.

A test that sleeps for a fixed time either wastes it or flakes on a loaded machine;
:func:`wait_for` returns the moment the condition holds and gives up only at a
generous deadline (the test then asserts on what it returns).
"""

from __future__ import annotations

from collections.abc import Callable

from rlcore.errors import Deadline, DeadlineExceeded, wait_until


def wait_for(condition: Callable[[], object], timeout_s: float = 5.0, step_s: float = 0.01) -> bool:
    """Poll ``condition`` until it is truthy (True) or ``timeout_s`` passes (False)."""
    try:
        wait_until(
            lambda: True if condition() else None,
            what="test condition",
            deadline=Deadline(timeout_s, "test condition"),
            poll_s=step_s,
            max_poll_s=max(step_s, 0.1),
        )
    except DeadlineExceeded:
        return False
    return True

"""The setup's progress: a task still running past ``setup.slow_task_warn_s`` is named once."""

from __future__ import annotations

import threading
import time

from rlcore.app.progress import SlowTasks


def test_a_task_past_the_bound_is_named_once_with_how_long() -> None:
    said: list[str] = []
    slow = SlowTasks(60.0, said.append)
    slow("init:policy", "start")
    slow("init:generation", "start")
    t0 = time.monotonic()
    assert slow.check(t0 + 30) == [] and said == []
    slow("init:policy", "end")  # done in time: never named
    assert slow.check(t0 + 61) == ["init:generation still running after 61 s"]
    assert slow.check(t0 + 200) == []  # once per task
    assert said == ["init:generation still running after 61 s"]
    slow("refit:initial", "start")
    assert slow.check(time.monotonic() + 5.25) == []
    assert slow.check(time.monotonic() + 60.4) == ["refit:initial still running after 60 s"]


def test_failed_or_cancelled_tasks_are_not_named() -> None:
    said: list[str] = []
    slow = SlowTasks(1.0, said.append)
    slow("init:env", "start")
    slow("init:env", "failed")
    slow("init:policy", "not_started")
    assert slow.check(time.monotonic() + 10) == [] and said == []


def test_watching_says_it_while_the_setup_runs_and_stops_after() -> None:
    said: list[str] = []
    told = threading.Event()
    slow = SlowTasks(0.05, lambda line: (said.append(line), told.set()))
    with slow.watching():
        slow("init:generation", "start")
        assert told.wait(5.0)
        time.sleep(0.1)  # several more looks: still one line
    assert len(said) == 1 and said[0].startswith("init:generation still running after 0.")
    slow("init:policy", "start")
    time.sleep(0.15)  # not watching any more: nothing said
    assert len(said) == 1

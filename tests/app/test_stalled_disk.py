"""A disk under the run directory that stalls (issue 48 item 1): a write or fsync of
``metrics.jsonl`` that has not returned within the bound is warned about, naming the path,
and the run waits for it; when it returns, that is said too and nothing is lost.

A frozen filesystem (``fsfreeze``) needs root and a loop device; the stall is made here by
holding ``os.write`` and ``os.fsync`` of the writer, which is what a frozen disk does to them.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import rlcore.app.records as records
from rlcore.app.loggers import LoggedWriter
from rlcore.app.records import MetricsWriter, read_metrics
from rlcore.config import load_config


class ReleaseOnWarning(logging.Handler):
    """Sets ``release`` when the stall warning is logged."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.event = release  # not "release": logging.Handler has a method of that name

    def emit(self, record: logging.LogRecord) -> None:
        if "has not returned" in record.getMessage():
            self.event.set()


class OsWith:
    """The ``os`` module, one function replaced."""

    def __init__(self, name: str, fn: Any) -> None:
        self._name, self._fn = name, fn

    def __getattr__(self, attr: str) -> Any:
        return self._fn if attr == self._name else getattr(os, attr)


def held(real: Any, release: threading.Event) -> Any:
    def call(*args: Any) -> Any:
        release.wait(60)  # bounded: a stall that is never said fails the assertions below
        return real(*args)

    return call


@pytest.mark.parametrize("call", ["write", "fsync"])
def test_a_stalled_write_is_warned_about_and_waited_for(
    call: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl", stall_warn_s=0.2)
    release = threading.Event()
    # Only the writer's module sees the held call (logging and pytest write through os too).
    monkeypatch.setattr(records, "os", OsWith(call, held(getattr(os, call), release)))
    # The disk comes back once the stall has been said (no race with a clock).
    releaser = ReleaseOnWarning(release)
    logging.getLogger("rlcore.app.records").addHandler(releaser)
    try:
        with caplog.at_level(logging.WARNING, logger="rlcore.app.records"):
            writer.write({"a": 1}, step=1)
            writer.sync()
    finally:
        logging.getLogger("rlcore.app.records").removeHandler(releaser)
    messages = [r.getMessage() for r in caplog.records]
    stalled = [m for m in messages if "has not returned for 0 s" in m]
    assert stalled and str(tmp_path / "metrics.jsonl") in stalled[0] and "the run waits for it" in stalled[0]
    assert any("returned after" in m and "the run goes on" in m for m in messages)
    assert [r["a"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]  # nothing lost
    writer.close()


def test_a_write_that_returns_in_time_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = MetricsWriter(tmp_path / "m.jsonl", stall_warn_s=5.0)
    with caplog.at_level(logging.WARNING, logger="rlcore.app.records"):
        writer.write({"a": 1})
        writer.sync()
    assert not caplog.records
    writer.close()


def test_the_runs_writer_warns_within_the_clusters_hang_timeout(tmp_path: Path) -> None:
    config = load_config(None, ["policy.backend=p", "generation.backend=g", "cluster.hang_timeout_s=7"])
    writer = LoggedWriter(tmp_path / "metrics.jsonl", config, sinks=[])
    assert writer.stall_warn_s == 7.0
    writer.close()

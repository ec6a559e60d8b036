"""End to end: what a newcomer sees of the quickstart (issue 47, item 2).

The shared run (``quickstart``, tests/e2e/conftest.py: ``rlcore run`` in a subprocess, its
stdout and stderr together) shows rlcore's lines alone: what Ray, vLLM and torch print
(vLLM's and the NUMA notices of its worker, FutureWarnings, Ray's start and token lines)
is in the run directory's ``run.log``, named once; the step lines' columns are explained
once, before the first step.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")

from quickstart_run import STEPS, Quickstart  # noqa: E402  (the shared run)

from rlcore.app.run import legend  # noqa: E402

#: What the quickstart's libraries print (each seen on its console before issue 47).
NOISE = ("pid=", "Started a local Ray instance", "Token authentication", "FutureWarning", "NUMA",
         "libtcmalloc", "Triton")


def test_the_console_shows_rlcore_and_run_log_has_the_libraries(quickstart: Quickstart) -> None:
    lines = quickstart.output.splitlines()
    noisy = [line for line in lines if any(word in line for word in NOISE)]
    assert not noisy, "\n".join(noisy)
    # A WARNING on the console is rlcore's own (its loggers: rlcore.*, rlcore_*).
    assert all("rlcore" in line for line in lines if "WARNING" in line), quickstart.output
    log = quickstart.dir / "run.log"
    named = [line for line in lines if "run.log" in line]
    assert named == [f"other libraries' output (Ray and its workers, warnings): {log}"], quickstart.output
    text = log.read_text()
    assert "(VLLMWorker pid=" in text and "Started a local Ray instance" in text, text[-3000:]


def test_the_step_columns_are_explained_once_before_the_first_step(quickstart: Quickstart) -> None:
    lines = quickstart.output.splitlines()
    shown = legend()
    first = lines.index(shown[0])
    assert lines[first : first + len(shown)] == shown, quickstart.output
    assert lines.count(shown[0]) == 1
    steps = [i for i, line in enumerate(lines) if re.match(r"step +\d+ ", line)]
    assert len(steps) == STEPS and steps[0] == first + len(shown), quickstart.output

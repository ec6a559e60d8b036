"""Fixtures the e2e modules share: one quickstart run per session (:mod:`quickstart_run`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    from quickstart_run import run_quickstart

    return run_quickstart(tmp_path_factory.mktemp("quickstart") / "run", tmp_path_factory.mktemp("cache"))

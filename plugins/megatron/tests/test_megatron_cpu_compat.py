"""Each CPU patch of megatron-core is needed: without it, its code path fails with a CUDA error.

One subprocess per patch runs the CPU paths (seed, forward/backward, dist_checkpointing
save/load, static generation) with only that patch disabled; one more runs them with
every patch and checks the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlcore_megatron import cpu_compat

HERE = Path(__file__).parent

#: Where each patch's absence shows: the stage of ``_cpu_paths.py`` that fails.
FAILS_AT = {
    "rng_tracker": "seed",
    "rope_device": "forward",
    "memory_buffer_device": "forward",
    "checkpoint_preload_sync": "save",
    "checkpoint_finalize_device": "save",
    "kv_cache_device": "generate",
    "static_generation": "generate",
}
CUDA_ERRORS = ("Torch not compiled with CUDA enabled", "dummy base class Event")


def test_every_patch_is_tested() -> None:
    assert sorted(FAILS_AT) == sorted(cpu_compat.names())


@pytest.fixture(scope="module")
def runs(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One forked child per patch (plus ``all``), from one parent that imported megatron-core."""
    root = tmp_path_factory.mktemp("cpu-paths")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop(cpu_compat.DISABLE_ENV, None)
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "_cpu_paths.py"),
            str(llama_dir),
            str(root / "runs"),
            "all",
            *cpu_compat.names(),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no report (rc {proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_all_paths_run_on_cpu_with_the_patches(runs: dict[str, dict[str, Any]]) -> None:
    rec = runs["all"]
    assert rec["stage"] == "done", rec.get("traceback")
    assert rec["applied"] == cpu_compat.names()
    assert rec["checks"] == {
        "apply_is_idempotent": True,
        "other_callers_unpatched": True,
        "grads": True,
        "loaded_equal": True,
        "greedy_tokens_equal_hf": True,
    }, rec


@pytest.mark.parametrize("patch", sorted(FAILS_AT))
def test_patch_is_needed(runs: dict[str, dict[str, Any]], patch: str) -> None:
    rec = runs[patch]
    assert patch not in rec["applied"]
    assert rec["stage"] == FAILS_AT[patch], rec
    assert any(e in rec.get("error", "") for e in CUDA_ERRORS), rec


def test_apply_is_a_no_op_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply() == []


def test_unknown_patch_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_compat.DISABLE_ENV, "no_such_patch")
    with pytest.raises(ValueError, match="no_such_patch"):
        cpu_compat.apply()


def test_causal_mask_masks_the_future() -> None:
    m = cpu_compat.causal_mask(3)
    assert m.shape == (1, 1, 3, 3)
    assert m[0, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]

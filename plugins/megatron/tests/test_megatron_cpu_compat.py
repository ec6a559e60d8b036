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
#: Patches of code paths that only tensor parallelism > 1 takes (tested with 2 ranks below).
TP_ONLY = ("gather_last_dim",)
CUDA_ERRORS = ("Torch not compiled with CUDA enabled", "dummy base class Event")


def test_every_patch_is_tested() -> None:
    assert sorted([*FAILS_AT, *TP_ONLY]) == sorted(cpu_compat.names())


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
            *sorted(FAILS_AT),
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


def _tp2_generation(model_dir: Path, work: Path, disable: str | None) -> list[dict[str, Any]]:
    from _megatron_helpers import spawn_ranks, tp_generate_worker

    saved = os.environ.get(cpu_compat.DISABLE_ENV)
    if disable:
        os.environ[cpu_compat.DISABLE_ENV] = disable  # the spawned ranks inherit it
    try:
        work.mkdir()
        spawn_ranks(
            tp_generate_worker,
            2,
            ((work / "rendezvous").as_uri(), str(model_dir), str(work / "out")),
            timeout_s=240,
        )
    finally:
        if saved is None:
            os.environ.pop(cpu_compat.DISABLE_ENV, None)
        else:
            os.environ[cpu_compat.DISABLE_ENV] = saved
    return [json.loads((work / f"out.{r}").read_text()) for r in range(2)]


def test_tp2_static_generation_needs_gather_last_dim(llama_dir: Path, tmp_path: Path) -> None:
    """The static engine at TP=2 gathers vocab-parallel logits (megatron-core allocates the
    gather on CUDA): with the patch it generates, the same samples on both ranks, with
    transformers' logprobs; without it, the CUDA error."""
    from _megatron_helpers import hf_model, max_diff, reference_logprobs

    ok = _tp2_generation(llama_dir, tmp_path / "patched", None)
    assert all("error" not in r for r in ok), ok
    assert ok[0]["samples"] == ok[1]["samples"]
    rows = [
        (p, s["token_ids"])
        for p, g in zip(ok[0]["prompts"], ok[0]["samples"], strict=True)
        for s in g
    ]
    got = [s["logprobs"] for g in ok[0]["samples"] for s in g]
    assert max_diff(got, reference_logprobs(hf_model(llama_dir), rows)) < 1e-4
    broken = _tp2_generation(llama_dir, tmp_path / "unpatched", "gather_last_dim")
    assert all(any(e in r.get("error", "") for e in CUDA_ERRORS) for r in broken), broken

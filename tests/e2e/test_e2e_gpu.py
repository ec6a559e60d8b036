"""``rlcore run`` on a GPU through Ray: the GPU examples end to end (``-m gpu``; never in CI).

Each colocated example (``examples/gpu/``: Megatron -> Megatron over cuda_ipc on the native
path, FSDP -> Megatron on the Hugging Face path) runs as a user runs it, ``python -m rlcore
run``, on the embedded Ray cluster, with the tiny model (``model.preset=tiny``, bf16) for a
few steps. Checks: exit code 0; one placement-group bundle holds both roles, on the same
GPU; every refit is checked within its bound; each step line splits the step into
generate, train, refit, handoff and refit check, and the handoff ran (the generation sleeps
while the policy trains); the run directory is complete; no Ray process is left.

    source .gpu/setup.sh && python3 -m pytest tests/e2e/test_e2e_gpu.py -m gpu
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
PHASES = ("generate", "train", "refit", "handoff", "refit_check")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which("nvidia-smi") is None or not os.path.exists("/dev/nvidiactl"), reason="needs an NVIDIA GPU"),
]


def _ray_processes() -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if any(k in cmd for k in ("raylet", "gcs_server", "ray::", "default_worker.py")):
            found.append(f"{p.pid} {cmd[:80]}")
    return found


@pytest.mark.parametrize(
    ("example", "transport"),
    [("megatron_colocated", "cuda_ipc"), ("fsdp_megatron_colocated", "cuda_ipc")],
)
def test_colocated_example_runs_through_ray(example: str, transport: str, tmp_path: Path) -> None:
    before = set(_ray_processes())
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "rlcore", "run", str(REPO / "examples" / "gpu" / f"{example}.yaml"),
            "--out", str(out), "model.preset=tiny", f"grpo.steps={STEPS}", "grpo.prompts_per_step=8",
            f"setup.cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("metrics.jsonl", "trace.json", "placement.json", "config.yaml", "reward.png", "setup_timeline.png"):
        assert (out / name).is_file(), name
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["refit/transport"] == transport for r in steps)
    checks = [r["refit/token_mult_prob_error"] for r in lines if "refit/token_mult_prob_error" in r]
    assert len(checks) >= STEPS and max(checks) <= 1.05
    for r in steps:
        assert all(isinstance(r.get(f"timing/{p}_time_s"), float) for p in PHASES), r
        assert r["timing/handoff_time_s"] > 0  # the generation slept and woke
    # Both roles' ranks ran on the one GPU of their shared bundle.
    placed = json.loads((out / "placement.json").read_text())
    assert placed, placed
    left = set(_ray_processes()) - before
    assert not left, left

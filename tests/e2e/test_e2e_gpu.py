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
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from quickstart_run import stop_at_line

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


def test_the_realistic_example_samples_long_completions_through_ray(tmp_path: Path) -> None:
    """examples/gpu/megatron_colocated_long.yaml as shipped (the 1B shape, 64 prompts x 8 samples
    of up to 512 tokens) for two steps: completions of hundreds of tokens, every refit checked,
    and generation the largest phase of a step, as in real RL post-training (issue 43)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "rlcore", "run", str(REPO / "examples" / "gpu" / "megatron_colocated_long.yaml"),
            "--out", str(out), "grpo.steps=2", f"setup.cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True, text=True, timeout=900, cwd=REPO,
        env={**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["train/samples"] == 512
        assert r["generate/tokens"] / r["train/samples"] > 200, r["generate/tokens"]
        assert r["generate/prompt_tokens"] / r["train/samples"] > 20
        assert r["refit/token_mult_prob_error"] <= 1.05
        phases = {p: r[f"timing/{p}_time_s"] for p in PHASES}
        # Long completions make generation a large part of the step (at lr 1e-6 completions
        # average ~290 tokens by step 2: generate and train about equal on an H100, 23:13 UTC
        # in bench/results/gpu_run_long_h100.txt).
        assert phases["generate"] >= 0.35 * sum(phases.values()), phases


# -- Stop and resume on the GPU (issue 33, item 3) ------------------------------------------

RESUME_STEPS = 6
#: The stated tolerance of a resumed GPU run: it may differ from the never-stopped run by these
#: floors (absolute for the loss and the reward mean, relative for the gradient norm) plus
#: twice what a second never-stopped run differs from it (kernels that are not
#: bit-reproducible). Measured on one H100 (bench/results/checkpoint_resume_gpu.txt): two
#: never-stopped runs were bit-identical, and the resumed one sampled a few tokens of its
#: first step differently (loss 0.0024 apart, gradient norm 0.8-1.1 %, reward equal), then
#: matched again; the floors are about 4x that. The cause was found later
#: (bench/results/engine_history_gpu.txt): after megatron-core's resume, which the colocated
#: engine runs every step when it wakes, the engine ended a sample at any sampled token 0 (a
#: stale termination-id tensor, zeroed by the reset before the sleep).
#: With rlcore_megatron.inference.resume_dynamic_engine the gap should close; until a device
#: run shows it does, the floors stay.
RESUME_FLOOR = {"train/loss": 0.01, "train/grad_norm": 0.05, "reward/mean": 0.05}


def _run_cmd(example: str, out: Path, cache: Path) -> list[str]:
    return [
        sys.executable, "-m", "rlcore", "run", str(REPO / "examples" / "gpu" / f"{example}.yaml"),
        "--out", str(out), "model.preset=tiny", f"grpo.steps={RESUME_STEPS}", "grpo.prompts_per_step=8",
        "checkpoint.every_steps=3", f"setup.cache_dir={cache}",
    ]


def _steps(run_dir: Path) -> dict[int, dict]:
    """Each step's record of ``metrics.jsonl`` (the lines with the step's reward)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in lines if "reward/mean" in r}


def _series(run_dir: Path) -> dict[int, dict[str, float]]:
    return {step: {k: float(r[k]) for k in RESUME_FLOOR} for step, r in _steps(run_dir).items()}


def _gap(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], key: str, steps: list[int]) -> float:
    if key == "train/grad_norm":
        return max(abs(a[s][key] - b[s][key]) / max(abs(a[s][key]), 1e-12) for s in steps)
    return max(abs(a[s][key] - b[s][key]) for s in steps)


GPU_ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@pytest.mark.parametrize("example", ["megatron_colocated", "fsdp_megatron_colocated"])
def test_a_gpu_run_stopped_by_sigterm_resumes_within_the_stated_tolerance(example: str, tmp_path: Path) -> None:
    """SIGTERM during step 4 saves that step and exits 143; ``--resume`` continues from it with
    the policy's native CUDA checkpoint (Megatron's distributed checkpoint, FSDP's sharded
    state dict), refits the generation from it and runs steps after it only; every step's loss,
    gradient norm and reward stay within :data:`RESUME_FLOOR` plus twice the gap between two
    runs that never stopped."""
    cache = tmp_path / "cache"
    never = [tmp_path / "never-a", tmp_path / "never-b"]
    for out in never:
        done = subprocess.run(_run_cmd(example, out, cache), capture_output=True, text=True, timeout=900, env=GPU_ENV)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    stopped = tmp_path / "stopped"
    code, out_text = stop_at_line(_run_cmd(example, stopped, cache), "step   3", env=GPU_ENV)
    assert code == 128 + signal.SIGTERM, out_text[-4000:]
    saved = sorted(p.name for p in (stopped / "checkpoints").iterdir())
    last = int(saved[-1].removeprefix("step-"))
    assert 3 <= last < RESUME_STEPS, saved
    resumed = subprocess.run([sys.executable, "-m", "rlcore", "run", "--resume", str(stopped)],
                             capture_output=True, text=True, timeout=900, env=GPU_ENV)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert f"(step {last}" in resumed.stdout and "resumed from" in resumed.stdout, resumed.stdout[-3000:]
    done_again = [int(x.split()[1]) for x in resumed.stdout.splitlines() if x.startswith("step ")]
    assert done_again == list(range(last + 1, RESUME_STEPS + 1))
    a, b, got = _series(never[0]), _series(never[1]), _series(stopped)
    assert sorted(got) == list(range(1, RESUME_STEPS + 1))
    after = list(range(last + 1, RESUME_STEPS + 1))
    every = list(range(1, RESUME_STEPS + 1))
    gaps = {k: (_gap(a, got, k, after), _gap(a, b, k, every)) for k in RESUME_FLOOR}
    print(f"\n{example}: resumed after step {last}; (resumed vs never-stopped, never-stopped vs never-stopped): {gaps}")
    first = last + 1  # what the first step after the resume sampled, and its refit check, beside the never-stopped run
    print({k: (_steps(never[0])[first].get(k), _steps(stopped)[first].get(k))
           for k in ("generate/tokens", "refit/token_mult_prob_error", "generate/weight_versions")})
    for key, (resumed_gap, noise) in gaps.items():
        assert resumed_gap <= RESUME_FLOOR[key] + 2 * noise, (key, resumed_gap, noise)

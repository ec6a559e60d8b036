"""End to end: examples/lora.yaml (the quickstart training LoRA adapters, issue 45) on CPU:
the reward rises, every refit carries the adapters alone to vLLM (which serves them in place)
and is checked, ``rlcore plan`` says what the refit carries, ``rlcore export`` writes the merged model, and a policy
backend that does not train adapters is refused in one line before anything starts."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")
pytest.importorskip("peft")

from rlcore.app.records import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "lora.yaml")
RLCORE = Path(sys.executable).with_name("rlcore")
STEPS = 24


def rlcore(*args: str, timeout: float = 840) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RLCORE), *args], capture_output=True, text=True, cwd=REPO, timeout=timeout)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    done = rlcore(
        "run", EXAMPLE, f"grpo.steps={STEPS}", f"checkpoint.every_steps={STEPS}",
        f"setup.cache_dir={cache}", "--out", str(run_dir),
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return run_dir


def test_the_adapters_train_and_every_adapter_refit_checks(lora_run: Path, tmp_path: Path) -> None:
    steps = [r for r in read_metrics(lora_run / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    rewards = [r["reward/mean"] for r in steps]
    first, last = statistics.fmean(rewards[:4]), statistics.fmean(rewards[-4:])
    assert last > first + 0.1, rewards
    # vLLM samples with base + the adapters it was handed: the sampled tokens' probabilities
    # agree with the policy's as closely as with full weights.
    errors = [r["train/gen_vs_policy_mult_prob_error"] for r in steps]
    assert max(errors) < 1.001, errors
    # Each refit carried the adapters alone: their bytes, as peft saves them.
    done = rlcore("export", str(lora_run), "--to", str(tmp_path / "a"), "--adapter", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        adapter_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # noqa: SIM118
    assert {r["refit/transport"] for r in steps} == {"object_store"}
    assert {r["refit/bytes"] for r in steps} == {adapter_bytes}


def test_the_export_is_the_merged_model(lora_run: Path, cache: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    done = rlcore("export", str(lora_run), "--to", str(out))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    base_dir = next(p.parent for p in cache.glob("**/config.json") if (p.parent / "model.safetensors").exists())
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).state_dict()
    # The base model's names only, no adapter tensor; what the adapters target moved, the
    # rest (embeddings, norms) is the base model's.
    assert sorted(merged) == sorted(base)
    moved = {n for n in base if not torch.equal(merged[n], base[n])}
    assert "lm_head.weight" in moved and "model.layers.0.self_attn.q_proj.weight" in moved
    assert all(n.endswith(("proj.weight", "lm_head.weight")) for n in moved), moved


def test_the_adapter_export_loads_onto_the_base_with_peft_and_computes_the_merged_model(
    lora_run: Path, cache: Path, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlcore.testing.reference import reference_logprobs

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    for target, extra in ((merged_dir, ()), (adapter_dir, ("--adapter",))):
        done = rlcore("export", str(lora_run), "--to", str(target), *extra)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    files = sorted(p.name for p in adapter_dir.iterdir() if not p.name.startswith("."))  # and the publish marker
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and "lm_head" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    batch = [([2, 5, 6], [7, 8, 9]), ([2, 11], [13, 14, 15, 16])]
    want, got = reference_logprobs(merged, batch), reference_logprobs(adapted, batch)
    assert max(abs(x - y) for r, q in zip(want, got, strict=True) for x, y in zip(r, q, strict=True)) < 1e-4


def test_an_adapter_export_of_a_run_without_adapters_is_refused(quickstart: Any, tmp_path: Path) -> None:
    done = rlcore("export", str(quickstart.dir), "--to", str(tmp_path / "a"), "--adapter", timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the checkpoint's run trained every weight (policy backend 'fsdp', no policy.options.lora)" in (
        done.stdout + done.stderr
    )
    assert not (tmp_path / "a").exists()


def test_plan_says_the_refit_carries_the_adapters_or_merged_weights_when_asked() -> None:
    for extra, kind in (((), "adapters"), (("refit.adapters=merged",), "merged")):
        done = rlcore("plan", EXAMPLE, *extra, "--json", timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        content = json.loads(done.stdout)["refit_content"]
        assert content["kind"] == kind and "'fsdp' trains LoRA adapters (rank 8)" in content["why"]


def test_a_policy_that_trains_no_adapters_is_refused_in_one_line(tmp_path: Path) -> None:
    done = rlcore("run", str(REPO / "examples" / "megatron.yaml"), "policy.options.lora.rank=4",
                  "--out", str(tmp_path / "r"), timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    assert errors == [
        "error: policy.options.lora is set but policy backend 'megatron' does not train adapters (its "
        "declaration has no trains_adapters); remove policy.options.lora, or choose a policy backend that "
        "declares it (rlcore plugins --json: trains_adapters)"
    ]
    assert not (tmp_path / "r" / "metrics.jsonl").exists()

"""Helpers of the megatron plugin's tests: tiny models, rank processes, checks run inside ranks.

Functions run by ``torch.multiprocessing`` must live in an importable module
(spawned children import them by name), hence this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcore.handles import SamplingParams
from rlcore.testing.policy_checks import (  # noqa: F401  (re-exported to the tests)
    CLIP_EPS,
    LR,
    check_logprobs,
    check_on_policy_step,
    check_train_step,
    reference_step,
    write_hf_model,
)
from rlcore.testing.reference import (  # noqa: F401  (re-exported to the tests)
    GRPO_ADVANTAGES,
    GRPO_BATCH,
    hf_model,
    max_diff,
    perturbed_old,
    reference_logprobs,
)

#: Shape of the tiny Qwen2 model over rlcore.testing.policy_checks.TINY_SHAPE (vocab 100:
#: padded to 128 at TP=1 and 256 at TP=2).
QWEN2_SHAPE = dict(
    vocab_size=100,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)


def llama_config(vocab: int = 1000, **shape: Any) -> dict[str, Any]:
    """A small Llama ``config.json`` (hidden 128, 2 layers, 4 heads, 2 KV heads; ``shape``
    overrides any key): the GPU tests' model, random weights drawn by each test."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **shape,
    }


def write_tiny_qwen2(directory: Path, seed: int = 0) -> None:
    """A Qwen2 checkpoint with random weights of O(1) logits, random norms and q/k/v biases."""

    def init(model: Any) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            # Norm weights differ from 1 so that swapping two norms would show.
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)

    write_hf_model(directory, "qwen2", seed=seed, init=init, **QWEN2_SHAPE)


@contextlib.contextmanager
def in_process_policy(model_dir: Path, options: Any) -> Iterator[Any]:
    """One MegatronPolicyWorker rank in this process (world size 1, gloo), loaded from
    ``model_dir``; torn down after (its parallel state and process group with it, so
    other workers of the module share them and the next module starts afresh)."""
    from rlcore.runtime.addresses import free_port
    from rlcore_megatron.worker import MegatronPolicyWorker

    w = MegatronPolicyWorker(0, 1)
    w.init_process_group("127.0.0.1", free_port(), "gloo", 60.0)
    try:
        w.load(str(model_dir), "float32", options)
        yield w
    finally:
        w.teardown()


def input_ids(vocab_size: int, batch: int = 2, seq: int = 12, seed: int = 0) -> Any:
    import torch

    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: Path, ids: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


def spawn_ranks(fn: Any, world: int, args: tuple[Any, ...], timeout_s: float) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; kill them all at the timeout."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(fn, args=(world, *args), nprocs=world, join=False)
    end = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > end:
                raise TimeoutError(
                    f"{getattr(fn, '__name__', fn)} x{world} did not finish in {timeout_s}s"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def tp_worker(
    rank: int,
    world: int,
    init_method: str,
    models: list[tuple[str, str]],
    checkpoints: list[tuple[str, str, str]],
    out_file: str,
) -> None:
    """In one TP rank: HF->Megatron logits and round trip per model, then checkpoint loads.

    Rank 0 writes a JSON report to ``out_file``; errors are reported, not raised,
    so that the test shows what failed.
    """
    import torch

    from rlcore_megatron import convert
    from rlcore_megatron.checkpoint import load_checkpoint, read_info
    from rlcore_megatron.parallel import (
        causal_logits,
        destroy_model_parallel,
        init_model_parallel,
        init_process_group,
    )

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    report: dict[str, Any] = {}
    report["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    init_process_group(rank, world, init_method, timeout_s=120)
    try:
        init_model_parallel(world)
        for name, hf_dir in models:
            entry: dict[str, Any] = {}
            try:
                spec = convert.ModelSpec.from_hf(hf_dir)
                t0 = time.perf_counter()
                model = convert.build_gpt_model(spec, world)
                with convert.HFCheckpoint(hf_dir) as ckpt:
                    convert.load_hf_weights(model, ckpt.get, spec, tp_rank=rank, tp_size=world)
                entry["hf_to_megatron_s"] = time.perf_counter() - t0
                ids = input_ids(spec.vocab_size)
                with torch.no_grad():
                    logits = causal_logits(model, ids).cpu()
                ref = hf_logits(Path(hf_dir), ids)
                entry["padded_vocab"] = int(logits.shape[-1])
                entry["logits_max_abs_diff"] = float(
                    (logits[..., : spec.vocab_size] - ref).abs().max()
                )
                entry["logits_abs_max"] = float(ref.abs().max())
                entry["logits_std"] = float(ref.std())
                # Reverse mapping, streamed, against the safetensors file bit for bit.
                t0 = time.perf_counter()
                names, mismatches = [], []
                with convert.HFCheckpoint(hf_dir) as ckpt:
                    for hf_name, tensor in convert.export_hf_weights(model, spec):
                        names.append(hf_name)
                        tensor = tensor.cpu()
                        want = ckpt.get(hf_name) if hf_name in ckpt else None
                        if (
                            want is None
                            or want.dtype != tensor.dtype
                            or want.shape != tensor.shape
                            or not torch.equal(want, tensor)
                        ):
                            mismatches.append(hf_name)
                    entry["export_names_equal"] = sorted(names) == sorted(ckpt.names())
                entry["export_s"] = time.perf_counter() - t0
                entry["export_order_is_hf_names"] = names == convert.hf_names(spec)
                entry["export_mismatches"] = mismatches
                entry["export_count"] = len(names)
            except Exception:
                entry["error"] = traceback.format_exc()
            report[f"model/{name}"] = entry
        for name, path, hf_dir in checkpoints:
            entry = {}
            try:
                info = read_info(path)
                spec = convert.ModelSpec.from_hf(info["hf_config"])
                model = convert.build_gpt_model(
                    spec, world, make_vocab_size_divisible_by=info["make_vocab_size_divisible_by"]
                )
                t0 = time.perf_counter()
                load_checkpoint(model, path)
                entry["load_s"] = time.perf_counter() - t0
                entry["written_at_tp"] = info["tp"]
                ids = input_ids(spec.vocab_size)
                with torch.no_grad():
                    logits = causal_logits(model, ids).cpu()
                ref = hf_logits(Path(hf_dir), ids)
                entry["logits_max_abs_diff"] = float(
                    (logits[..., : spec.vocab_size] - ref).abs().max()
                )
            except Exception:
                entry["error"] = traceback.format_exc()
            report[f"checkpoint/{name}"] = entry
    finally:
        destroy_model_parallel()
    if rank == 0:
        Path(out_file).write_text(json.dumps(report, indent=1))


# ---------------------------------------------------------------------------
# Single-process Hugging Face references of the policy's computations
# ---------------------------------------------------------------------------

BATCH = GRPO_BATCH
ADVANTAGES = GRPO_ADVANTAGES


def tp_generate_worker(
    rank: int, world: int, init_method: str, model_dir: str, out_file: str
) -> None:
    """One rank of a tensor-parallel MegatronGenerationWorker fed the checkpoint's weights.

    Generates with a fixed seed; each rank writes ``out_file.<rank>`` (JSON): the
    samples, or the error it hit (errors are reported, not raised).
    """
    from rlcore_megatron import convert
    from rlcore_megatron.options import MegatronOptions
    from rlcore_megatron.parallel import init_process_group
    from rlcore_megatron.worker import MegatronGenerationWorker

    report: dict[str, Any] = {}
    init_process_group(rank, world, init_method, timeout_s=60)
    g = MegatronGenerationWorker(rank, world)
    try:
        g.start(
            model_dir,
            "float32",
            MegatronOptions(tensor_model_parallel_size=world, max_batch_size=8),
        )
        with convert.HFCheckpoint(model_dir) as ckpt:
            stream = ((n, ckpt.get(n)) for n in convert.hf_names(g.spec))
            convert.load_hf_stream(
                g.model,
                stream,
                g.spec,
                tp_rank=g.tp_rank,
                tp_size=world,
                make_vocab_size_divisible_by=g.divisible,
            )
        g.serving = True
        report["prompts"] = [[2, 5, 6], [2, 11, 14, 9]]
        report["samples"] = g.generate(report["prompts"], SamplingParams(3, 4, 1.0, 5))
    except Exception:
        report["error"] = traceback.format_exc()
    finally:
        g.teardown()
    Path(f"{out_file}.{rank}").write_text(json.dumps(report))

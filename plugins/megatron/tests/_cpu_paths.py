"""Run megatron-core's code paths on CPU with rlcore_megatron's patches, minus one.

Usage: python _cpu_paths.py HF_LLAMA_DIR WORK_ROOT [PATCH ...]

For each PATCH (``all`` = none disabled) a forked child process runs the paths
with ``$RLCORE_MEGATRON_CPU_COMPAT_DISABLE=PATCH``; the parent imports torch,
megatron-core and transformers once, before forking, and applies no patch
itself, so every child starts unpatched. Two children run at a time, each
bounded by a timeout. Stages, in order: seed (model_parallel_cuda_manual_seed),
forward, backward, save + load (dist_checkpointing), generate (static inference
engine). Prints one JSON line: {patch: {stage, error, checks, ...}}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def run_paths(hf_dir: Path, work: Path) -> dict:
    out: dict = {"stage": "setup", "checks": {}}
    try:
        import torch

        from rlcore_megatron import convert, cpu_compat
        from rlcore_megatron.parallel import causal_logits, init_process_group

        init_process_group(0, 1, (work / "rendezvous").as_uri(), timeout_s=60)
        out["applied"] = cpu_compat.apply()
        out["checks"]["apply_is_idempotent"] = cpu_compat.apply() == []
        try:
            torch.cuda.current_device()
            out["checks"]["other_callers_unpatched"] = False
        except (AssertionError, RuntimeError):
            out["checks"]["other_callers_unpatched"] = True
        from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(1)
        out["stage"] = "seed"
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        out["stage"] = "forward"
        spec = convert.ModelSpec.from_hf(hf_dir)
        model = convert.build_gpt_model(spec, 1)
        with convert.HFCheckpoint(hf_dir) as ckpt:
            convert.load_hf_weights(model, ckpt.get, spec)
        ids = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        logits = causal_logits(model, ids)
        out["stage"] = "backward"
        logits.float().pow(2).mean().backward()
        out["checks"]["grads"] = all(p.grad is not None for p in model.parameters())
        out["stage"] = "save"
        (work / "ckpt").mkdir()
        dist_checkpointing.save(model.sharded_state_dict(), str(work / "ckpt"))
        out["stage"] = "load"
        model2 = convert.build_gpt_model(spec, 1)
        model2.load_state_dict(
            dist_checkpointing.load(model2.sharded_state_dict(), str(work / "ckpt")), strict=False
        )
        out["checks"]["loaded_equal"] = all(
            torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
        )
        out["stage"] = "generate"
        from megatron.core.inference.sampling_params import SamplingParams
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlcore_megatron.inference import build_static_engine

        model.eval()
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
        engine = build_static_engine(model, tok, spec, max_batch_size=2, max_sequence_length=32)
        prompts = ["12+3=", "abc"]
        params = SamplingParams(top_k=1, num_tokens_to_generate=5)
        # Compare whole sequences: no stop at EOS (the static path reads this attribute).
        params.no_early_termination = True
        got = [
            r.generated_tokens.tolist()
            for r in engine.generate(prompts=prompts, sampling_params=params)
        ]
        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        want = []
        for p in prompts:
            x = torch.tensor([tok.encode(p, add_special_tokens=False)])
            y = hf.generate(x, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
            want.append(y[0, x.shape[1] :].tolist())
        out["checks"]["greedy_tokens_equal_hf"] = got == want
        out["tokens"] = {"megatron": got, "hf": want}
        out["stage"] = "done"
    except BaseException as err:  # report, do not hide: the test reads it
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()[-3000:]
    return out


CHILD_TIMEOUT_S = 180.0


def main() -> None:
    hf_dir, root, patches = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    # Warm imports, shared by the forked children; nothing here patches anything.
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.inference.engines.static_engine  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import psutil
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from rlcore_megatron import cpu_compat

    assert cpu_compat.applied() == []
    pending, running, results = list(patches), {}, {}
    while pending or running:
        while pending and len(running) < 2:
            patch = pending.pop(0)
            work = root / patch
            work.mkdir(parents=True)
            pid = os.fork()
            if pid == 0:  # child
                code = 1
                try:
                    os.environ[cpu_compat.DISABLE_ENV] = "" if patch == "all" else patch
                    (work / "result.json").write_text(json.dumps(run_paths(hf_dir, work)))
                    code = 0
                finally:
                    # os._exit skips multiprocessing's finalizers: stop the Manager and
                    # resource tracker that dist_checkpointing.save started, or they
                    # outlive us (holding our stdout pipe open).
                    for proc in psutil.Process().children(recursive=True):
                        proc.kill()
                    os._exit(code)
            running[pid] = (patch, time.monotonic())
        time.sleep(0.05)
        for pid, (patch, started) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() - started > CHILD_TIMEOUT_S:
                os.kill(pid, signal.SIGKILL)
                done, status = os.waitpid(pid, 0)
            if done:
                del running[pid]
                file = root / patch / "result.json"
                results[patch] = (
                    json.loads(file.read_text())
                    if file.exists()
                    else {"stage": "killed", "error": f"no result (wait status {status})"}
                )
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()

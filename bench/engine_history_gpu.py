"""Does what megatron-core's dynamic engine served before change what it samples now?

A diagnostic for the resumed-run gap of tests/e2e/test_e2e_gpu.py (a resumed run's first
step sampled a few tokens differently from the run never stopped, on both policy
backends, while two never-stopped runs were bit-identical). One process on cuda:0: a
Megatron policy (random init) feeds a refit-fed Megatron generation over the disk
transport (as plugins/megatron/tests/test_megatron_dynamic_gpu.py does), in ``--dtype``.
The same call (prompts, n, max_tokens, temperature, seed) is made on the same weights:

* ``first``: the engine's first call;
* ``again``: the same call right after;
* ``after_other_calls``: after calls with other prompts and seeds;
* ``after_refit``: after a refit of the same weights (the engine reset);
* ``after_sleep_wake``, ``..._again``: after sleep and wake (megatron-core's ``suspend`` /
  ``resume``), and the call after that;
* ``after_sleep_wake_refit``: after sleep, wake and a refit of the same weights (what a
  colocated step does);
* ``after_a_hold``: after an in-flight refit's hold (``requests_held``: suspend / resume);
* ``fresh_engine``: a new dynamic engine around the same model (what a resumed run has).

Each is compared with ``first``: tokens equal, and the largest logprob difference.

    python bench/engine_history_gpu.py [--dtype bfloat16] [--prompts 8] [--n 8] [--tokens 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def _llama(vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=3)
    args = ap.parse_args()

    import torch

    from rlcore.handles import SamplingParams
    from rlcore.refit.channels import ChannelSpec
    from rlcore.refit.specs import plan_buckets
    from rlcore.runtime.addresses import free_port
    from rlcore_megatron import inference
    from rlcore_megatron.options import MegatronOptions
    from rlcore_megatron.worker import MegatronGenerationWorker, MegatronPolicyWorker

    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps(_llama(1000)))
    policy = MegatronPolicyWorker(0, 1)
    policy.init_process_group("127.0.0.1", free_port(), "nccl", 120.0)
    gen = MegatronGenerationWorker(0, 1)
    policy.load(str(root), args.dtype, MegatronOptions(seed=3), "cuda", random_init=True)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    options = MegatronOptions(max_batch_size=256, max_sequence_length=64, kv_cache_gib=2, seed=3)
    gen.start(str(root), args.dtype, options, "cuda")

    def refit(step: int) -> None:
        spec = ChannelSpec("disk", "history", 2, root=str(root / "refit"), timeout_s=60)
        buckets = plan_buckets(policy.weight_specs(), 1 << 22)
        policy.send_weights(spec, step, buckets)
        gen.receive_weights(spec, step, buckets)

    g = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(3, 1000, (int(k),), generator=g).tolist()]
               for k in torch.randint(4, 20, (args.prompts,), generator=g)]
    params = SamplingParams(args.n, args.tokens, 1.0, 1_000_003 * 7 + 5)

    def call() -> list:
        return gen.generate(prompts, params)

    def flat(groups: list) -> list:
        return [s for group in groups for s in group]

    def compare(name: str, got: list, ref: list) -> None:
        pairs = list(zip(flat(got), flat(ref), strict=True))
        same = [(a, b) for a, b in pairs if a["token_ids"] == b["token_ids"]]
        diff = max((abs(x - y) for a, b in same for x, y in zip(a["logprobs"], b["logprobs"], strict=True)),
                   default=0.0)
        tokens = sum(len(s["token_ids"]) for s in flat(got))
        print(f"{name:>24}: {len(same)}/{len(pairs)} samples equal to first, {tokens} tokens, "
              f"max |logprob diff| over equal samples {diff:.3g}", flush=True)

    refit(1)
    first = call()
    compare("again", call(), first)
    for seed in (11, 12, 13):
        gen.generate([p[::-1] for p in prompts], SamplingParams(args.n, args.tokens, 1.0, seed))
    compare("after_other_calls", call(), first)
    refit(2)
    compare("after_refit", call(), first)
    gen.sleep()
    gen.wake()
    compare("after_sleep_wake", call(), first)
    compare("after_sleep_wake_again", call(), first)
    gen.sleep()
    gen.wake()
    refit(3)
    compare("after_sleep_wake_refit", call(), first)
    with inference.requests_held(gen.engine):  # an in-flight refit's hold, with nothing in flight
        pass
    compare("after_a_hold", call(), first)
    fresh = inference.build_dynamic_engine(
        gen.model, gen.engine.controller.tokenizer, gen.spec, kv_cache_gib_requested=options.kv_cache_gib,
        tp=gen.tp_size, make_vocab_size_divisible_by=gen.divisible, max_batch_size=options.max_batch_size,
        max_sequence_length=options.max_sequence_length, seed=options.seed + 1,
    )
    gen.engine = fresh
    compare("fresh_engine", call(), first)
    compare("fresh_engine_again", call(), first)
    print(f"dtype {args.dtype}, {args.prompts} prompts x {args.n} samples, {args.tokens} tokens, "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")


if __name__ == "__main__":
    main()

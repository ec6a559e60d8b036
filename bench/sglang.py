"""SGLang on this machine, in one run: refit transports against their ceilings, and
generation throughput of SGLang vs vLLM on the same tiny model.

1. Refit: ``bench/refit.py`` with ``examples/sglang.yaml`` (FSDP policy -> SGLang
   server, the same ~86 MiB model as the vLLM figures): per transport, refits
   through the ``rlcore_refit`` hook against the same bytes moved raw over the
   same channel between the same processes (collective: one broadcast received
   by the SGLang server through its own weight-update route, loading nothing).
2. Generation: one vLLM engine (in-process, as ``examples/quickstart.yaml`` runs
   it) and one SGLang server, both on the checkpoint of the run's tiny model,
   in one Ray cluster, measured one after the other on the same requests:
   generated tokens per second (``--prompts`` prompts x ``--n`` samples, up to
   ``--max-tokens`` each, temperature 1, EOS stops a sample).

    python bench/sglang.py                  # both parts
    python bench/sglang.py --skip-refit     # generation only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlcore.handles import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def _context(config: Any, backend: str, options_cls: type, run_dir: Path) -> Any:
    from rlcore.config import resolve_options
    from rlcore.context import InitContext
    from rlcore.declarations import Role
    from rlcore.errors import CancelToken, Deadline
    from rlcore.setup.events import EventBoard

    cancel = CancelToken()
    return InitContext(
        role=Role.GENERATION, backend=backend, config=config,
        options=resolve_options({}, options_cls, section="generation", backend=backend),
        cancel=cancel, deadline=Deadline(600.0, f"init:generation ({backend})"), run_dir=run_dir,
        cache_dir=Path(config.setup.cache_dir), events=EventBoard(cancel),
    )


def generation_throughput(args: argparse.Namespace) -> None:
    import random

    from rlcore.config import load_config
    from rlcore.runtime.cluster import Cluster
    from rlcore_sglang.options import SGLangOptions
    from rlcore_sglang.plugin import rlcore_init_generation as init_sglang
    from rlcore_vllm.options import VLLMOptions
    from rlcore_vllm.plugin import rlcore_init_generation as init_vllm

    rng = random.Random(0)
    prompts = [[2] + [rng.randrange(4, 40) for _ in range(args.prompt_len - 1)] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            REPO / "examples" / "sglang.yaml",
            ["generation.refit_fed=false", f"setup.cache_dir={tmp}/cache"],
        )
        cluster = Cluster(config.cluster).start()
        engines: dict[str, Any] = {}
        try:
            for name, init, opts in (("vllm", init_vllm, VLLMOptions), ("sglang", init_sglang, SGLangOptions)):
                t0 = time.monotonic()
                engines[name] = init(_context(config, name, opts, Path(tmp) / name))
                print(f"{name:<7}: started in {time.monotonic() - t0:.1f}s")
            print(f"workload: {args.prompts} prompts of {args.prompt_len} tokens x n={args.n}, "
                  f"up to {args.max_tokens} new tokens, temperature 1.0; {args.repeats} repeats after a warm-up")
            for name, gen in engines.items():
                gen.generate(prompts, SamplingParams(args.n, args.max_tokens, 1.0, 0))
                rates, tokens = [], []
                for r in range(args.repeats):
                    t0 = time.monotonic()
                    out = gen.generate(prompts, SamplingParams(args.n, args.max_tokens, 1.0, r + 1))
                    took = time.monotonic() - t0
                    count = sum(len(s["token_ids"]) for g in out for s in g)
                    rates.append(count / took)
                    tokens.append(count)
                print(f"{name:<7}: {statistics.median(rates):8.1f} generated tokens/s (median; "
                      f"{statistics.mean(tokens):.0f} tokens per call)")
        finally:
            for gen in engines.values():
                gen.shutdown()
            cluster.shutdown()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-refit", action="store_true")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if not args.skip_refit:
        sys.path.insert(0, str(REPO / "bench"))
        import refit as refit_bench

        print("== refit: FSDP policy -> SGLang server (bench/refit.py --config examples/sglang.yaml)")
        refit_bench.main(["--config", str(REPO / "examples" / "sglang.yaml"), "--repeats", str(args.repeats)])
    if not args.skip_generation:
        print("== generation throughput: SGLang vs vLLM, same tiny model, same requests")
        generation_throughput(args)


if __name__ == "__main__":
    main(sys.argv[1:])

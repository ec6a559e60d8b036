"""What does the OpenAI-compatible endpoint cost in front of an engine?

Sets up a real config whose generation serves ``rlcore.serve.openai_endpoint`` (default:
``examples/megatron.yaml`` with ``generation.options.serve_openai=true``), then,
in one run, generates the same N completions three ways and prints the times as
ratios to the first:

* ``direct``: one ``generation.generate`` call of the N prompts (what the training
  loop does);
* ``endpoint, concurrent``: N chat-completion requests at once (as NeMo Gym sends a
  step's rollouts); the endpoint batches them into few engine calls;
* ``endpoint, one at a time``: N requests in sequence (no batching possible).

    python bench/openai_endpoint.py
    python bench/openai_endpoint.py examples/megatron.yaml grpo.max_new_tokens=16 --prompts 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rlcore.handles import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(REPO / "examples" / "megatron.yaml"))
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import httpx

    from rlcore.config import load_config
    from rlcore.runtime.cluster import Cluster
    from rlcore.setup.prepared import prepare
    from rlcore.setup.registry import load_registry
    from rlcore.setup.runner import run_setup

    config = load_config(args.config, ["generation.options.serve_openai=true", *args.overrides])
    registry = load_registry(config.plugins.allow)
    cluster = Cluster(config.cluster).start()
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            run_setup(
                config, registry, run_dir=Path(tmp), plan=prepare(config, registry).plan
            ) as setup,
        ):
            gen = setup.handles["generation"]
            server = gen.server
            texts = [f"{i % 5}+{(3 * i) % 5}=" for i in range(args.prompts)]
            prompts = [
                server.chat_prompt_ids({"messages": [{"role": "user", "content": t}]})
                for t in texts
            ]
            client = httpx.Client(timeout=600, trust_env=False)
            url = gen.endpoint.base_url + "/chat/completions"

            def ask(text: str) -> int:
                r = client.post(
                    url,
                    json={
                        "model": gen.endpoint.model,
                        "max_tokens": args.max_tokens,
                        "logprobs": True,
                        "messages": [{"role": "user", "content": text}],
                    },
                )
                r.raise_for_status()
                return len(r.json()["choices"][0]["logprobs"]["content"])

            def direct() -> None:
                gen.generate(prompts, SamplingParams(1, args.max_tokens, 1.0, 0))

            def concurrent_requests() -> None:
                with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
                    assert all(n >= 1 for n in pool.map(ask, texts))

            def sequential() -> None:
                for t in texts:
                    ask(t)

            ask(texts[0])  # warm: the first engine call and the HTTP client
            times: dict[str, list[float]] = {"direct": [], "concurrent": [], "sequential": []}
            calls_before = server.batcher.calls
            for _ in range(args.repeats):
                for label, fn in (
                    ("direct", direct),
                    ("concurrent", concurrent_requests),
                    ("sequential", sequential),
                ):
                    t0 = time.perf_counter()
                    fn()
                    times[label].append(time.perf_counter() - t0)
            engine_calls = server.batcher.calls - calls_before
    finally:
        cluster.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    n, r = args.prompts, args.repeats
    print(
        f"config: {Path(args.config).name} ({config.generation.backend} generation, "
        f"{config.generation.workers} worker(s)); {n} prompts x {args.max_tokens} tokens, "
        f"median of {r}"
    )
    print(f"  direct generate():            {med['direct'] * 1e3:8.1f} ms  1.00x")
    print(
        f"  endpoint, {n} concurrent:     {med['concurrent'] * 1e3:8.1f} ms  {med['concurrent'] / med['direct']:.2f}x"
    )
    print(
        f"  endpoint, one at a time:      {med['sequential'] * 1e3:8.1f} ms  {med['sequential'] / med['direct']:.2f}x"
    )
    batched = engine_calls - n * r  # the sequential rounds made one call per request
    print(
        f"  engine calls for {r} concurrent rounds of {n} requests: {batched} "
        f"({n * r / max(batched, 1):.1f} requests per call)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])

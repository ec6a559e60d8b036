"""Refit throughput against the raw ceiling of the same transport, in one run.

Sets up the quickstart's real backends (FSDP policy, vLLM generation) on a
larger locally made model, then for each transport both sides declare: runs
refits through the ``rlcore_refit`` hook, and moves the same number of raw
bytes over the same channel between the very same processes (one gloo
broadcast of a flat buffer; one published file for disk and shared memory).
Prints medians and the ratio refit/ceiling (1.0 = the refit costs nothing on
top of moving the bytes).

    python bench/refit.py                       # CPU: gloo, disk, shared memory
    python bench/refit.py model.tiny.num_layers=4 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = [
    # ~100 MB of float32 weights: big enough that bytes, not call latency, dominate.
    "model.tiny.hidden_size=512",
    "model.tiny.num_heads=16",
    "model.tiny.num_kv_heads=4",
    "model.tiny.num_layers=8",
    "model.tiny.intermediate_size=1408",
    "refit.bucket_mb=32",
]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--config", default=str(REPO / "examples" / "quickstart.yaml"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", default="collective,shared_memory,disk")
    args = parser.parse_args(argv)

    from rlcore.config import load_config
    from rlcore.errors import CancelToken
    from rlcore.runtime.cluster import Cluster
    from rlcore.runtime.waits import ray_get
    from rlcore.setup.registry import load_registry
    from rlcore.setup.runner import refit_context, run_setup

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(args.config, [*DEFAULTS, f"setup.cache_dir={tmp}/cache", *args.overrides])
        registry = load_registry(config.plugins.allow)
        cluster = Cluster(config.cluster).start()
        setup = run_setup(config, registry, run_dir=Path(tmp) / "run")
        try:
            policy, generation = setup.handles["policy"], setup.handles["generation"]
            hook = registry.hook("rlcore_refit", [setup.plugins["policy"], setup.plugins["generation"]])
            cancel = CancelToken()
            nbytes = sum(s.nbytes for s in policy.weight_specs())
            print(f"model: {len(policy.weight_specs())} tensors, {nbytes / 2**20:.1f} MiB "
                  f"({config.model.dtype}); policy {config.policy.backend} x{config.policy.workers}, "
                  f"generation {config.generation.backend} x{config.generation.workers}; one run")
            step = 1000
            for transport in args.transports.split(","):
                refits, ceilings, channel = [], [], 0.0
                for i in range(args.repeats + 1):  # the first opens the channel: reported apart
                    step += 1
                    report = hook(policy=policy, generation=generation,
                                  ctx=refit_context(config, step=step, transport=transport, cancel=cancel,
                                                    sessions=setup.refit_sessions))
                    if i == 0:
                        channel = report.channel_init_time_s
                        continue
                    refits.append(report.weight_sync_time_s)
                    spec = setup.refit_sessions.spec_for(policy, generation, transport)
                    step += 1
                    t0 = time.monotonic()
                    refs = policy.refit_ceiling(spec, step, nbytes) + generation.refit_ceiling(spec, step, nbytes)
                    ray_get(refs, what=f"{transport} ceiling")
                    ceilings.append(time.monotonic() - t0)
                    from rlcore.refit.channels import remove_step

                    remove_step(spec, step)
                r, c = statistics.median(refits), statistics.median(ceilings)
                print(f"{transport:<13}: refit {r * 1e3:7.1f} ms ({nbytes / r / 2**30:5.2f} GiB/s)   "
                      f"raw ceiling {c * 1e3:7.1f} ms ({nbytes / c / 2**30:5.2f} GiB/s)   "
                      f"refit/ceiling throughput {c / r:.2f}   channel init {channel * 1e3:.0f} ms")
        finally:
            setup.shutdown()
            cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])

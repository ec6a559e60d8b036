"""Ray's start with its default local-connect retry against the embedded cluster's.

Starts a plain embedded Ray (``ray.init`` as ``rlcore.runtime.cluster`` calls it, then one
task) in a fresh process, alternately with Ray's defaults and with
:data:`rlcore.runtime.cluster.LOCAL_CONNECT_RETRY`, and prints every start, how many were
"stalled" (a second or more over the round's fastest start: the raylet's first connect to
its own object store came too early and Ray retried it a second later) and the ratio of
the mean starts. Both variants run in the same rounds, so the machine's mood hits both.

    python bench/ray_start.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import ray
t0 = time.monotonic()
ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
         _system_config=json.loads(sys.argv[1]))
ray.get(ray.remote(lambda: 1).remote())
print(time.monotonic() - t0)
ray.shutdown()
"""


def start_s(system_config: dict[str, int]) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(system_config)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from rlcore.runtime.cluster import LOCAL_CONNECT_RETRY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    variants = {"ray defaults": {}, "rlcore (50 ms x 200)": dict(LOCAL_CONNECT_RETRY)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for k in range(args.rounds):
        for name, config in variants.items():
            times[name].append(start_s(config))
        print(f"round {k + 1}: " + "  ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), flush=True)
    fastest = min(min(t) for t in times.values())
    for name, t in times.items():
        stalled = sum(1 for x in t if x >= fastest + 0.9)
        print(f"{name}: mean {statistics.mean(t):.2f}s, median {statistics.median(t):.2f}s, "
              f"stalled (>= fastest + 0.9 s) {stalled} of {len(t)}")
    base, ours = (statistics.mean(t) for t in times.values())
    print(f"mean start, rlcore / ray defaults = {ours / base:.3f}")


if __name__ == "__main__":
    main()

"""What a Ray worker process costs in CPU before it runs an actor's first call.

rlcore's workers are Ray actors, each in a worker process of its own; the bare floor of
``bench/first_step.py`` starts the same worker classes in plain processes. This prints, in
one run on the embedded cluster's settings (:mod:`rlcore.runtime.cluster`):

* **plain**: a fresh ``python -c`` process that unpickles one small argument and reads its
  own CPU time (``time.process_time``, every thread of the process);
* **ray**: an actor's worker process at its first method call, given the same argument
  (the process's CPU from its start: interpreter, ``import ray``, connecting to the
  raylet, receiving the actor, Ray's serialization context), one new actor per round;
* their difference, the per-process tax of running a worker under Ray, and what share
  of a Megatron worker of the CPU example it is (``--worker-cpu-s``, from
  ``bench/results/first_step_cpu.txt``'s ``/proc`` sampling: 2.9-3.1 CPU-s).

    python bench/ray_worker_tax.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import subprocess
import sys
import time

PLAIN = (
    "import pickle, sys, time; pickle.loads(bytes.fromhex(sys.argv[1])); "
    "print(time.process_time())"
)


def plain_cpu_s(arg: bytes) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PLAIN, arg.hex()], capture_output=True, text=True, check=True, timeout=60
    )
    return float(out.stdout.strip())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--worker-cpu-s", type=float, default=3.0)
    args = parser.parse_args(argv)

    import ray

    from rlcore.config import ClusterConfig
    from rlcore.runtime.cluster import Cluster

    @ray.remote(num_cpus=0.5)
    class Probe:
        def cpu_s(self, payload: dict) -> float:
            return time.process_time()

    payload = {"options": {"tensor_model_parallel_size": 2}, "model_dir": "/tmp/model"}
    cluster = Cluster(ClusterConfig(num_cpus=2)).start()
    plain, ray_cpu = [], []
    try:
        time.sleep(3.0)  # let the prestarted workers and Ray's agents settle
        for k in range(args.rounds):
            plain.append(plain_cpu_s(pickle.dumps(payload)))
            actor = Probe.remote()
            ray_cpu.append(ray.get(actor.cpu_s.remote(payload), timeout=120))
            ray.kill(actor)
            print(f"round {k + 1}: plain process {plain[-1]:.3f} CPU-s, Ray worker at its first call {ray_cpu[-1]:.3f} CPU-s", flush=True)
            time.sleep(1.0)
    finally:
        cluster.shutdown()
    p, r = statistics.median(plain), statistics.median(ray_cpu)
    print(f"median: plain {p:.3f} CPU-s, Ray worker {r:.3f} CPU-s; Ray's tax per worker process {r - p:.3f} CPU-s")
    print(
        f"= {(r - p) / args.worker_cpu_s:.1%} of a {args.worker_cpu_s:g} CPU-s worker; three such "
        f"processes on 2 cores: ~{3 * (r - p) / 2:.2f} s of wall time while they start"
    )


if __name__ == "__main__":
    main(sys.argv[1:])

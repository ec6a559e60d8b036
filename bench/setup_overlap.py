"""How much does overlapped setup save, and what does the executor itself cost?

Two modes, each measured in one run (these machines are noisy: compare the
ratios, not the absolute seconds):

* ``synthetic`` (default): the executor runs real plans whose tasks sleep for
  known durations. Sleeping is right here and only here: it measures the
  executor, not a backend. Prints measured total vs critical path vs serial
  sum, and the executor's overhead per task in milliseconds (a 200-task chain
  of no-op tasks and 200 independent ones).
* ``real CONFIG [key=value ...]``: sets up the config's real backends twice in
  one process, overlapped (the plan as the declarations allow) and serial
  (policy, then generation, then env), and prints both totals.

    python bench/setup_overlap.py
    python bench/setup_overlap.py real examples/quickstart.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rlcore.config import load_config
from rlcore.declarations import Artifact, BackendDeclaration, Condition, Need, OverlapSafety, Role
from rlcore.setup.executor import TaskSpec, execute
from rlcore.setup.plan import Edge, Plan
from rlcore.setup.planner import build_plan

P, G, E = Role.POLICY, Role.GENERATION, Role.ENV


def _worked_example() -> Plan:
    megatron = BackendDeclaration(
        name="megatron",
        roles={P, G},
        produces=(Artifact("megatron.checkpoint", atomic=True, role=P),),
        needs=(Need("megatron.checkpoint", role=G, when=(Condition("refit_fed", False),)),),
        refit_fed=True,
        send_transports={"collective"},
        receive_transports={"collective"},
        openai_endpoint=True,
    )
    gym = BackendDeclaration(name="gym", roles={E}, needs=(Need("generation.endpoint", kind="event"),))
    cfg = load_config(None, ["policy.backend=megatron", "generation.backend=megatron", "env.backend=gym", "generation.refit_fed=true"])
    return build_plan(cfg, {P: megatron, G: megatron, E: gym}, accelerator="cpu")


def _colocated_vllm() -> Plan:
    fsdp = BackendDeclaration(name="fsdp", roles={P}, overlap=OverlapSafety(True, True), send_transports={"shared_memory"})
    vllm = BackendDeclaration(name="vllm", roles={G}, overlap=OverlapSafety(True, False), receive_transports={"shared_memory"})
    cfg = load_config(None, ["policy.backend=fsdp", "generation.backend=vllm", "placement.colocated=true"])
    return build_plan(cfg, {P: fsdp, G: vllm}, accelerator="cpu")


def _earliest_finish(plan: Plan, work: dict[str, float]) -> float:
    """The ideal setup time: a task starts when its edges allow, works, then waits for its waits.

    Waits can point forward in topological order (env waits for refit:initial),
    so relax until nothing changes (at most one pass per task).
    """
    finish = dict.fromkeys(plan.names, 0.0)
    for _ in plan.tasks:
        for name in plan.topological_order():
            start = max((finish[p] for p in plan.predecessors(name)), default=0.0)
            waited = [finish[w.producer] for w in plan.waits if w.task == name]
            finish[name] = max([start + work[name], *waited])
    return max(finish.values())


def _run_sleeping(plan: Plan, work: dict[str, float]) -> tuple[float, float, float]:
    """Execute ``plan``: each task sleeps its work, then waits (in-init) for what it needs."""
    import threading

    done = {t.name: threading.Event() for t in plan.tasks}

    def task(name: str):
        def run(_run) -> None:
            time.sleep(work[name])
            for w in plan.waits:
                if w.task == name:
                    done[w.producer].wait(30)
            done[name].set()

        return run

    specs = [TaskSpec(name=t.name, deps=plan.predecessors(t.name), run=task(t.name)) for t in plan.tasks]
    t0 = time.monotonic()
    execute(specs)
    return time.monotonic() - t0, _earliest_finish(plan, work), sum(work.values())


def _overhead_per_task_ms(n: int, chain: bool) -> float:
    specs = [TaskSpec(name=f"t{i}", deps=[f"t{i - 1}"] if chain and i else [], run=lambda _r: None) for i in range(n)]
    t0 = time.monotonic()
    execute(specs)
    return (time.monotonic() - t0) / n * 1e3


def synthetic() -> None:
    cases = [
        ("worked example (megatron+megatron refit-fed+gym)", _worked_example(),
         {"init:policy": 0.6, "init:generation": 0.4, "init:env": 0.5, "refit:initial": 0.1}),
        ("colocated fsdp+vllm (generation first)", _colocated_vllm(),
         {"init:policy": 0.3, "init:generation": 0.4, "refit:initial": 0.05}),
    ]
    print("mode: synthetic (tasks sleep for known durations)")
    for label, plan, durations in cases:
        total, critical, serial = _run_sleeping(plan, durations)
        print(f"{label}:")
        print(f"  measured total {total:.3f}s   critical path {critical:.3f}s   serial sum {serial:.3f}s")
        print(f"  total/critical path {total / critical:.3f}   serial sum/total {serial / total:.2f}x"
              f"   executor delay {(total - critical) * 1e3:.1f} ms")
    chain = statistics.median(_overhead_per_task_ms(200, True) for _ in range(5))
    wide = statistics.median(_overhead_per_task_ms(200, False) for _ in range(5))
    print(f"executor overhead per task: {chain:.3f} ms (200-task chain), {wide:.3f} ms (200 independent tasks)")


def real(config_path: str, overrides: list[str], rounds: int = 2) -> None:
    from rlcore.runtime.cluster import Cluster
    from rlcore.setup.prepared import prepare
    from rlcore.setup.registry import load_registry
    from rlcore.setup.runner import run_setup

    config = load_config(config_path, overrides)
    registry = load_registry(config.plugins.allow)
    overlapped = prepare(config, registry).plan
    inits = [t.name for t in overlapped.tasks if t.name.startswith("init:")]
    serial_edges = tuple(
        Edge(a, b, "bench: serial baseline", 0)
        for a, b in zip(inits, inits[1:], strict=False)
        if not overlapped.has_path(a, b)
    )
    serial = dataclasses.replace(overlapped, edges=overlapped.edges + serial_edges, waits=overlapped.waits)
    cluster = Cluster(config.cluster).start()
    runs: dict[str, list[dict[str, float]]] = {"overlapped": [], "serial": []}
    try:
        # Alternate, serial first: later setups find imports and files warm, and
        # alternating keeps that advantage from favouring one mode.
        for _ in range(rounds):
            for label, plan in (("serial", serial), ("overlapped", overlapped)):
                with tempfile.TemporaryDirectory() as tmp:
                    setup = run_setup(config, registry, run_dir=Path(tmp), plan=plan)
                    setup.shutdown()
                runs[label].append(setup.metrics)
    finally:
        cluster.shutdown()
    key = "timing/setup/total_setup_time_s"
    results = {label: min(ms, key=lambda m: m[key]) for label, ms in runs.items()}  # best of rounds
    o, s = results["overlapped"], results["serial"]
    print(f"mode: real ({config.policy.backend} + {config.generation.backend}"
          f"{' + ' + config.env.backend if config.env.backend else ''}), one run, best of {rounds} rounds each")
    for label, m in results.items():
        tasks = "  ".join(f"{k.split('/')[-1]}={v:.2f}" for k, v in m.items() if k.endswith("_time_s") and ":" in k)
        print(f"  {label:<10} total {m[key]:.2f}s  critical path {m['timing/setup/critical_path_s']:.2f}s  {tasks}")
    print(f"  serial/overlapped = {s[key] / o[key]:.2f}x   overlapped total/critical path = "
          f"{o[key] / o['timing/setup/critical_path_s']:.3f}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="synthetic", choices=["synthetic", "real"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--rounds", type=int, default=2, help="real mode: setups per mode")
    args = parser.parse_args(argv)
    if args.mode == "synthetic":
        synthetic()
    else:
        if not args.rest:
            parser.error("real mode needs a config file")
        real(args.rest[0], args.rest[1:], args.rounds)


if __name__ == "__main__":
    main(sys.argv[1:])

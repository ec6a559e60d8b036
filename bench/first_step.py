"""Time to the first training step, against what the bare backends cost, in one run.

Measures on this machine, one after another (never two at once: they share the cores):

* **floor**: the config's backends started bare and concurrently by a plain script,
  without rlcore and without Ray, the way a careful engineer would by hand: one process
  per worker, each importing the real library and building the real engine or trainer
  on the same model with the same threads (``OMP_NUM_THREADS``) rlcore gives it. The
  floor is the moment the last of them is ready, counted from their launch (interpreter
  start and imports included). Recipes: FSDP (``torch.distributed`` over gloo,
  ``from_pretrained``, FSDP1 per decoder layer, AdamW), vLLM (``vllm.LLM`` in-process,
  dummy weights for a refit-fed engine), Megatron (the plugin's worker class, called
  directly in plain processes: megatron-core has no public one-call trainer to start);
* **Ray's start**: a plain ``python -c 'import ray; ray.init(...)'`` with the embedded
  cluster's settings, from launch to ``ray.init`` returning;
* **rlcore**: ``rlcore run CONFIG grpo.steps=1``: its setup critical path
  (``timing/setup/critical_path_s`` of ``metrics.jsonl``), its own Ray start
  (``timing/setup/cluster_start_time_s``), and the wall time from the command to the
  first finished step (the step's line in ``metrics.jsonl``: train, refit and probe done).

Prints ``critical path / floor`` (goal <= 1.10) and ``command-to-first-step / (Ray start
+ floor)`` (goal <= 1.25) per round; ``--repeat N`` runs N rounds (floor, Ray, rlcore) in
one invocation. ``--twice`` runs rlcore twice per round on a fresh cache directory and
reports the second (warm) run: the tiny model, a published conversion and engine caches
are then there.

    python bench/first_step.py                                  # quickstart
    python bench/first_step.py --repeat 3 --write bench/results/first_step_cpu.txt
    python bench/first_step.py --twice --config examples/megatron.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
READY = "FIRST_STEP_READY"


# ----------------------------------------------------------------- the bare workers
# Run in their own processes (``--worker KIND``); they import no part of rlcore.


def _ready(**info: object) -> None:
    print(READY, json.dumps({"t": time.time(), **info}), flush=True)


def bare_fsdp(rank: int, world: int, port: int, model_dir: str, dtype: str) -> None:
    """One FSDP rank as a hand-written trainer would start it."""
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    layers = {type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layers),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    torch.optim.AdamW(model.parameters(), lr=0.0)
    dist.barrier()
    _ready(rank=rank)
    dist.destroy_process_group()


def bare_vllm(model_dir: str, dtype: str, refit_fed: bool, max_model_len: int) -> None:
    """One in-process vLLM engine as ``vllm.LLM`` is documented to start."""
    from vllm import LLM

    kwargs = {"load_format": "dummy"} if refit_fed else {}
    LLM(model=model_dir, dtype=dtype, seed=0, max_model_len=max_model_len, enforce_eager=True, **kwargs)
    _ready()
    os._exit(0)  # the in-process engine has no quick teardown; the floor is measured


def bare_megatron(
    rank: int, world: int, port: int, role: str, model_dir: str, dtype: str, options: dict,
    checkpoint: str | None = None, padded_vocab_size: int | None = None,
) -> None:
    """A Megatron policy rank or generation engine. megatron-core has no one-call trainer or
    engine to start by hand, so this calls the plugin's worker class directly in a plain
    process: torch.distributed over gloo set up here, no Ray, no setup plan, no rlcore run."""
    import torch.distributed as dist

    from rlcore_megatron.handle import _options
    from rlcore_megatron.worker import MegatronGenerationWorker, MegatronPolicyWorker

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    opts = _options(options, role)
    if role == "policy":
        MegatronPolicyWorker(rank, world).load(model_dir, dtype, opts, "cpu")
    else:
        worker = MegatronGenerationWorker(rank, world)
        worker.start(model_dir, dtype, opts, "cpu", padded_vocab_size=padded_vocab_size)
        if checkpoint:  # the published conversion, as a run that is not refit-fed loads it
            worker.load_checkpoint(checkpoint)
    dist.barrier()
    _ready(rank=rank, role=role)
    os._exit(0)


def _worker_main(argv: list[str]) -> None:
    kind, payload = argv[0], json.loads(argv[1])
    {"fsdp": bare_fsdp, "vllm": bare_vllm, "megatron": bare_megatron}[kind](**payload)


# ----------------------------------------------------------------- the parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(kind: str, payload: dict, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, __file__, "--worker", kind, json.dumps(payload)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _floor_processes(config, model_dir: str) -> list[tuple[str, str, dict, dict]]:
    """(label, kind, payload, env) of every bare worker the config's backends need."""
    out = []
    pol, gen = config.policy, config.generation
    threads = lambda section: str(max(1, int(section.devices_per_worker)))  # noqa: E731
    base = {"TOKENIZERS_PARALLELISM": "false"}
    dtype = config.model.dtype
    if pol.backend == "fsdp":
        port = _free_port()
        for r in range(pol.workers):
            out.append((f"fsdp[{r}]", "fsdp", dict(rank=r, world=pol.workers, port=port, model_dir=model_dir, dtype=dtype), {**base, "OMP_NUM_THREADS": threads(pol)}))
    if gen.backend == "vllm":
        opts = dict(gen.options or {})
        env = {**base, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": threads(gen),
               "VLLM_CPU_KVCACHE_SPACE": str(opts.get("kv_cache_gib", 1)), "VLLM_LOGGING_LEVEL": "WARNING"}
        for r in range(gen.workers):
            out.append((f"vllm[{r}]", "vllm", dict(model_dir=model_dir, dtype=dtype, refit_fed=bool(gen.refit_fed), max_model_len=int(opts.get("max_model_len", 512))), env))
    for role, section in (("policy", pol), ("generation", gen)):
        if section.backend == "megatron":
            out += _megatron_floor(config, role, section, model_dir, {**base, "OMP_NUM_THREADS": threads(section)})
    known = {"fsdp", "vllm", "megatron"}
    for section in (pol, gen):
        if section.backend not in known:
            raise SystemExit(f"no bare recipe for backend {section.backend!r} (have {sorted(known)})")
    return out


def _megatron_floor(config, role, section, model_dir, env) -> list[tuple[str, str, dict, dict]]:
    checkpoint, padded = None, None
    if role == "generation" and not section.refit_fed:
        checkpoint, padded = _published_checkpoint(config, model_dir)
    port = _free_port()
    env = {**env, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    payload = dict(world=section.workers, port=port, role=role, model_dir=model_dir,
                   dtype=config.model.dtype, options=dict(section.options or {}), checkpoint=checkpoint,
                   padded_vocab_size=padded)
    return [(f"megatron-{role}[{r}]", "megatron", {**payload, "rank": r}, env) for r in range(section.workers)]


def _published_checkpoint(config, model_dir: str) -> tuple[str | None, int | None]:
    """The converted checkpoint a generation that is not refit-fed loads (if published) and
    the padded vocabulary it was written with (the policy's tensor-parallel size)."""
    from rlcore.config import cache_dir
    from rlcore.publish import is_complete
    from rlcore_megatron.checkpoint import checkpoint_key, checkpoint_path
    from rlcore_megatron.convert import ModelSpec
    from rlcore_megatron.handle import _options

    policy = _options(config.policy.options, "policy")
    key = checkpoint_key(model_dir, policy, dtype=config.model.dtype)
    path = checkpoint_path(cache_dir(config), key)
    padded = ModelSpec.from_hf(model_dir).padded_vocab_size(
        policy.tensor_model_parallel_size, policy.make_vocab_size_divisible_by
    )
    return (str(path) if is_complete(path) else None), padded


def measure_floor(config, model_dir: str) -> dict[str, float]:
    """Start every bare worker at once; seconds from launch to each one's ready line."""
    specs = _floor_processes(config, model_dir)
    t0 = time.time()
    procs = [(label, _launch(kind, payload, env)) for label, kind, payload, env in specs]
    ready: dict[str, float] = {}
    try:
        for label, p in procs:
            assert p.stdout is not None
            for line in p.stdout:
                if line.startswith(READY):
                    ready[label] = json.loads(line.split(" ", 1)[1])["t"] - t0
                    break
            if label not in ready:
                raise SystemExit(f"bare worker {label} exited ({p.wait()}) before it was ready")
    finally:
        for _, p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return ready


RAY_START = """
import time, ray
ray.init(address="local", num_cpus={cpus}, include_dashboard=False, _node_ip_address="127.0.0.1")
print({ready!r}, time.time(), flush=True)
ray.shutdown()
"""


def measure_ray(num_cpus: int) -> float:
    """A plain script's Ray start: launch to ``ray.init`` returned (``import ray`` included)."""
    t0 = time.time()
    out = subprocess.run(
        [PY, "-c", RAY_START.format(cpus=num_cpus, ready=READY)],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith(READY))
    return float(line.split()[1]) - t0


def _source_env(root: str | None) -> dict[str, str]:
    """The environment that makes ``rlcore`` and its plugins import from the source tree
    ``root`` (another checkout, e.g. the commit before a change) instead of this one."""
    if root is None:
        return dict(os.environ)
    paths = [root, *sorted(str(p) for p in Path(root, "plugins").iterdir() if p.is_dir())]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}


def measure_rlcore(
    config_path: str, overrides: list[str], out_dir: Path, root: str | None = None
) -> dict[str, float]:
    """``rlcore run CONFIG grpo.steps=1``: setup figures and command-to-first-step."""
    cmd = [str(Path(PY).with_name("rlcore")), "run", config_path, "--out", str(out_dir), "grpo.steps=1", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_source_env(root))
    t_exit = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    setup = next(m for m in lines if "timing/setup/critical_path_s" in m)
    step1 = next(m for m in lines if m.get("step") == 1 and "timing/step_time_s" in m)
    return {
        "critical_path_s": setup["timing/setup/critical_path_s"],
        "total_setup_s": setup["timing/setup/total_setup_time_s"],
        "ray_in_run_s": setup["timing/setup/cluster_start_time_s"],
        "first_step_s": step1["time"] - t0,
        "exit_s": t_exit,
    }


def _fmt(figures: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.2f}" for k, v in figures.items())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the config")
    parser.add_argument("--config", default="examples/quickstart.yaml")
    parser.add_argument("--repeat", type=int, default=1, help="rounds (floor, Ray, rlcore)")
    parser.add_argument("--twice", action="store_true", help="rlcore twice per round on a fresh cache; report the second")
    parser.add_argument("--write", default=None, help="append the report to this file")
    parser.add_argument(
        "--baseline", default=None, metavar="DIR",
        help="also run rlcore from this source tree in every round (e.g. `git archive` of the commit before a change)",
    )
    args = parser.parse_args(argv)

    from rlcore.config import cache_dir, load_config
    from rlcore.tinymodel import ensure_model

    scratch = Path(tempfile.mkdtemp(prefix="first-step-"))
    overrides = list(args.overrides)
    config = load_config(args.config, overrides)
    command = "python bench/first_step.py " + shlex.join(argv)
    report = [f"$ {command}", f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"]

    def say(line: str) -> None:
        print(line, flush=True)
        report.append(line)

    trees = {"rlcore": None, **({"baseline": args.baseline} if args.baseline else {})}

    rows = []
    for k in range(args.repeat):
        # With --twice, every tree first runs once on a fresh cache of its own (cold); the
        # floor then starts from what that run published (the bare Megatron generation of a
        # run that is not refit-fed loads the converted checkpoint), and the reported runs
        # are the second ones (warm).
        run_overrides = {tag: list(overrides) for tag in trees}
        if args.twice:
            for tag in trees:
                run_overrides[tag].append(f"setup.cache_dir={scratch / f'cache-{k}-{tag}'}")
                cold = measure_rlcore(args.config, run_overrides[tag], scratch / f"run-{k}-{tag}-cold", trees[tag])
                say(f"round {k + 1}: {tag} cold (1st) run: {_fmt(cold)}")
        floor_config = load_config(args.config, run_overrides["rlcore"])
        model_dir = str(ensure_model(floor_config.model, cache_dir(floor_config)))
        floor_each = measure_floor(floor_config, model_dir)
        floor = max(floor_each.values())
        ray_s = measure_ray(int(config.cluster.num_cpus or os.cpu_count() or 1))
        say(f"round {k + 1}: floor {floor:.2f}s ({', '.join(f'{n} {t:.1f}' for n, t in floor_each.items())}), Ray start {ray_s:.2f}s")
        row = {"floor_s": floor, "ray_s": ray_s}
        # Alternate which tree runs first: the machine's load drifts within a round.
        for tag in (list(trees) if k % 2 == 0 else list(trees)[::-1]):
            run = measure_rlcore(args.config, run_overrides[tag], scratch / f"run-{k}-{tag}", trees[tag])
            row[f"{tag} cp/floor"] = run["critical_path_s"] / floor
            row[f"{tag} first_step/(ray+floor)"] = run["first_step_s"] / (ray_s + floor)
            say(f"round {k + 1}: {tag}{' (warm, 2nd run)' if args.twice else ''}: {_fmt(run)}")
            say(f"round {k + 1}: {tag}: critical path / floor = {row[f'{tag} cp/floor']:.3f} (goal <= 1.10); "
                f"command-to-first-step / (Ray start + floor) = {row[f'{tag} first_step/(ray+floor)']:.3f} (goal <= 1.25)")
        rows.append(row)
    if len(rows) > 1:
        for key in [k for k in rows[0] if "/" in k]:
            vals = [r[key] for r in rows]
            say(f"{key}: median {statistics.median(vals):.3f}, min {min(vals):.3f}, max {max(vals):.3f} over {len(vals)} rounds")
    say(f"# run directories under {scratch}")
    if args.write:
        with open(args.write, "a") as f:
            f.write("\n".join(report) + "\n\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2:])
    else:
        main(sys.argv[1:])

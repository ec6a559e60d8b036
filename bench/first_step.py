"""Time to the first training step, against what the bare backends cost, in one run.

Measures on this machine, one after another (never two at once: they share the cores):

* **floor**: the config's backends started bare and concurrently by a plain script,
  without rlcore and without Ray, the way a careful engineer would by hand: one process
  per worker or server, each importing the real library and building the real engine,
  trainer or server on the same model with the same threads (``OMP_NUM_THREADS``) and
  environment rlcore gives it, each in a process group of its own. A process prints a
  ready line when it is ready; a server cannot, so a small watcher started beside it
  prints the line once the server's ``GET /health`` answers 200 (polled every 50 ms;
  rlcore's worker waits on the same route). The floor is the moment the last of them is
  ready, counted from their launch (interpreter start and imports included). Then every
  process group is ended (SIGTERM, SIGKILL after a grace) and checked gone. Recipes:

  - FSDP: ``torch.distributed`` over gloo, ``from_pretrained``, FSDP1 per decoder layer,
    AdamW;
  - vLLM in-process (``vllm.LLM``), dummy weights for a refit-fed engine, on CPU the
    plugin's KV cache size (``kv_cache_memory_bytes``);
  - vLLM server mode (``generation.options.serve_openai``): ``python -m
    vllm.entrypoints.openai.api_server --model M --served-model-name N --dtype D --seed 0
    --max-model-len L [--enforce-eager] [--load-format dummy] [--kv-cache-memory-bytes B]
    --host 127.0.0.1 --port P``
    per worker, with the environment the plugin gives it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    ``VLLM_LOGGING_LEVEL``, ``VLLM_SERVER_DEV_MODE=1``,
    ``OMP_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``). Both vLLM recipes leave out rlcore's
    weight-transfer engine: no ``--weight-transfer-config``, and ``VLLM_PLUGINS`` names
    every installed vLLM plugin but rlcore's (vLLM would otherwise import it at start);
  - SGLang: ``python -m sglang.launch_server ARGS --host 127.0.0.1 --port P`` from the
    SGLang venv, one per generation worker. ARGS come from the plugin's own argument
    builder (``rlcore_sglang.worker.launch_args``, called in this parent); the
    environment is the one ``SGLangWorker.start`` gives its server, copied here
    (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, ``OMP_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``,
    on CPU ``SGLANG_USE_CPU_ENGINE=`` and ``RLCORE_SGLANG_SEEDS=1``), with the plugin's
    ``rlcore_sglang/site`` as ``PYTHONPATH``: SGLang does not start on CPU without its
    ``sitecustomize`` (torchvision's op schemas), which also adds per-request seeds;
  - NeMo Gym: Gym's head server and the env's servers from the Gym venv, started with
    Gym's ``RunHelper`` as the plugin's launcher drives it: the same spec
    (``rlcore_nemo_gym.servers.LaunchSpec``), the launcher's own config builder and venv
    farm (``rlcore_nemo_gym/launcher.py``, loaded from its file: it imports nothing of
    rlcore), its patches (no Ray; readiness polled every 0.2 s, not 3 s), ``python -I``,
    the launcher's environment (``PYTHONPATH`` its ``_gym_site``, ``RLCORE_GYM_NO_RAY=1``,
    Ray kept on loopback), its niceness and a private working directory. Ready when
    ``RunHelper.start`` returns (every server answers): what the plugin waits for before
    it writes the generation endpoint. Gym's model server reads the endpoint only when a
    request comes and Gym's own endpoint probe is off, so Gym needs no endpoint to be ready;
  - Megatron (policy and generation): the plugin's worker class, called directly in
    plain processes (megatron-core has no public one-call trainer or engine to start).
    rlcore's OpenAI-compatible endpoint in front of an engine (Megatron's
    ``serve_openai``, SGLang's ``endpoint: rlcore``) is a thread in rlcore's driver, no
    process of its own: the floor starts the engines only;
  - the arithmetic env is an object in the driver: no process.

  Of rlcore, the bare processes use only Megatron's worker classes, SGLang's ``site``
  directory and the Gym launcher's functions; this parent reads the plugins' option
  classes and argument builders to write their command lines;
* **Ray's start**: a plain ``python -c 'import ray; ray.init(...)'`` with the embedded
  cluster's settings, from launch to ``ray.init`` returning;
* **the floor as plain Ray actors** (``--floor-on-ray``, configs whose floor is worker
  processes only, e.g. Megatron's): the same recipes, each in a Ray actor of the embedded
  cluster rlcore starts (same settings, the CPUs rlcore gives each worker), no rlcore;
  from the actors' request to the last one ready. What Ray's start of its worker processes
  adds to the floor on this machine, and rlcore's critical path against it;
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
    python bench/first_step.py --config examples/sglang_nemo_gym.yaml
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
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
PY = sys.executable
READY = "FIRST_STEP_READY"
HOST = "127.0.0.1"
BASE_ENV = {"TOKENIZERS_PARALLELISM": "false"}
#: Backends with a bare recipe, by section (the arithmetic env has no process).
KNOWN = {
    "policy": {"fsdp", "megatron"},
    "generation": {"vllm", "sglang", "megatron"},
    "env": {"arithmetic", "nemo_gym"},
}


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
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=layers
        ),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    torch.optim.AdamW(model.parameters(), lr=0.0)
    dist.barrier()
    _ready(rank=rank)
    dist.destroy_process_group()


def bare_vllm(
    model_dir: str, dtype: str, refit_fed: bool, max_model_len: int, kv_cache_bytes: int | None
) -> None:
    """One in-process vLLM engine as ``vllm.LLM`` is documented to start."""
    from vllm import LLM

    kwargs: dict[str, Any] = {"load_format": "dummy"} if refit_fed else {}
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    LLM(
        model=model_dir,
        dtype=dtype,
        seed=0,
        max_model_len=max_model_len,
        enforce_eager=True,
        **kwargs,
    )
    _ready()
    os._exit(0)  # the in-process engine has no quick teardown; the floor is measured


def bare_megatron(
    rank: int,
    world: int,
    port: int,
    role: str,
    model_dir: str,
    dtype: str,
    options: dict,
    checkpoint: str | None = None,
    padded_vocab_size: int | None = None,
) -> None:
    """A Megatron policy rank or generation engine. megatron-core has no one-call trainer or
    engine to start by hand, so this calls the plugin's worker class directly in a plain
    process: torch.distributed set up here (gloo, NCCL on a GPU host), no Ray, no setup
    plan, no rlcore run."""
    import torch.distributed as dist

    from rlcore_megatron.handle import _options
    from rlcore_megatron.worker import MegatronGenerationWorker, MegatronPolicyWorker

    device = "cuda" if _cuda() else "cpu"  # on a GPU host every bare rank uses its first GPU
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    opts = _options(options, role)
    if role == "policy":
        MegatronPolicyWorker(rank, world).load(model_dir, dtype, opts, device)
    else:
        worker = MegatronGenerationWorker(rank, world)
        worker.start(model_dir, dtype, opts, device, padded_vocab_size=padded_vocab_size)
        if checkpoint:  # the published conversion, as a run that is not refit-fed loads it
            worker.load_checkpoint(checkpoint)
    dist.barrier()
    _ready(rank=rank, role=role)
    os._exit(0)


def _load_module(name: str, path: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bare_gym(spec: dict[str, Any], launcher: str) -> None:
    """NeMo Gym's head server and the env's servers (run by the Gym venv's python), started
    with Gym's ``RunHelper`` as rlcore-nemo-gym's launcher starts them: the launcher's
    config builder, venv farm and patches (its file imports nothing of rlcore). Ready when
    every server answers; they stay up until stdin closes or the group is signalled."""
    gl = _load_module("rlcore_gym_launcher", launcher)
    if spec.get("nice"):
        os.nice(
            int(spec["nice"])
        )  # as the launcher: Gym's start has slack, inherited by its servers
    import nemo_gym.cli.env as gym_env
    from nemo_gym.global_config import GlobalConfigDictParserConfig, get_global_config_dict
    from omegaconf import DictConfig

    config_file = gl.check_config(spec, gl._gym_root())
    gym_env.initialize_ray = lambda: None
    gym_env.sleep = lambda seconds: time.sleep(min(seconds, gl.POLL_S))
    parser = GlobalConfigDictParserConfig(
        initial_global_config_dict=DictConfig(gl.gym_config(spec, config_file)),
        skip_load_from_cli=True,
        skip_load_from_dotenv=True,
    )
    config = get_global_config_dict(global_config_dict_parser_config=parser)
    gl.build_farm(Path(spec["farm_dir"]), gl._servers(config))
    helper = gym_env.RunHelper()
    helper.start(parser)
    _ready()
    sys.stdin.read()  # until the parent closes it (or is gone)
    helper.shutdown()


def watch_health(url: str, timeout_s: float = 900.0, poll_s: float = 0.05) -> None:
    """A server's ready line (``--watch URL``): printed once ``GET url`` answers 200."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with opener.open(url, timeout=5) as r:
                if r.status == 200:
                    _ready(url=url)
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(poll_s)
    sys.exit(f"{url} did not answer 200 within {timeout_s:g}s")


def _worker_main(argv: list[str]) -> None:
    kind, payload = argv[0], json.loads(argv[1])
    {"fsdp": bare_fsdp, "vllm": bare_vllm, "megatron": bare_megatron, "gym": bare_gym}[kind](
        **payload
    )


# ----------------------------------------------------------------- the floor's processes


@dataclass
class Bare:
    """One process of the floor: its command line and whole environment. ``health``: a
    server's ``/health`` URL, which a watcher polls (``None``: it prints its ready line)."""

    label: str
    argv: list[str]
    env: dict[str, str]
    health: str | None = None
    cwd: str | None = None


def free_port() -> int:
    """rlcore's :func:`rlcore.runtime.addresses.free_port`, imported when called: the bare Gym
    process runs this file from Gym's venv, which has no rlcore."""
    from rlcore.runtime.addresses import free_port as core_free_port

    return core_free_port()


def _threads(section: Any) -> str:
    return str(max(1, int(section.devices_per_worker)))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _worker(
    label: str,
    kind: str,
    payload: dict[str, Any],
    env: dict[str, str],
    python: str = PY,
    flags: Sequence[str] = (),
) -> Bare:
    """A bare worker: this file run as ``--worker KIND PAYLOAD``."""
    argv = [python, *flags, str(HERE), "--worker", kind, json.dumps(payload)]
    return Bare(label, argv, {**os.environ, **env})


def _server(label: str, argv: list[str], env: dict[str, str], port: int) -> Bare:
    """A server binding ``HOST:port``, ready when its ``/health`` answers 200."""
    return Bare(
        label,
        [*argv, "--host", HOST, "--port", str(port)],
        {**os.environ, **env},
        health=f"http://{HOST}:{port}/health",
    )


def _check_known(config: Any) -> None:
    for section, known in KNOWN.items():
        backend = getattr(config, section).backend
        if backend not in known:
            raise SystemExit(
                f"no bare recipe for {section} backend {backend!r} (have {sorted(known)})"
            )


def _floor_processes(config: Any, model_dir: str, workdir: Path) -> list[Bare]:
    """Every bare process the config's backends need."""
    _check_known(config)
    pol, gen = config.policy, config.generation
    out: list[Bare] = []
    if pol.backend == "fsdp":
        port = free_port()
        env = {**BASE_ENV, "OMP_NUM_THREADS": _threads(pol)}
        for r in range(pol.workers):
            payload = dict(
                rank=r, world=pol.workers, port=port, model_dir=model_dir, dtype=config.model.dtype
            )
            out.append(_worker(f"fsdp[{r}]", "fsdp", payload, env))
    if gen.backend == "vllm":
        out += _vllm_floor(config, model_dir)
    if gen.backend == "sglang":
        out += _sglang_floor(config, model_dir)
    for role, section in (("policy", pol), ("generation", gen)):
        if section.backend == "megatron":
            env = {**BASE_ENV, "OMP_NUM_THREADS": _threads(section)}
            out += _megatron_floor(config, role, section, model_dir, env)
    if config.env.backend == "nemo_gym":
        out.append(_gym_floor(config, workdir))
    return out


def _vllm_plugins_but_rlcore() -> str:
    """``VLLM_PLUGINS`` naming every installed vLLM plugin except rlcore's weight-transfer engine."""
    from importlib.metadata import distributions

    names = {e.name for d in distributions() for e in d.entry_points if e.group.startswith("vllm.")}
    names.discard("rlcore_weight_transfer")
    return ",".join(sorted(names))


def _vllm_floor(config: Any, model_dir: str) -> list[Bare]:
    """vLLM engines: in-process ``vllm.LLM``, or vLLM's OpenAI server (``serve_openai``)."""
    from rlcore_vllm.options import VLLMOptions
    from rlcore_vllm.worker import kv_cache_bytes

    gen = config.generation
    o = VLLMOptions(**dict(gen.options or {}))
    kv_bytes = None if _cuda() else kv_cache_bytes(o.kv_cache_gib)  # the plugin's engine argument
    env = {
        **BASE_ENV,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": _threads(gen),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_PLUGINS": _vllm_plugins_but_rlcore(),
    }
    if not o.serve_openai:
        payload = dict(
            model_dir=model_dir,
            dtype=config.model.dtype,
            refit_fed=bool(gen.refit_fed),
            max_model_len=o.max_model_len,
            kv_cache_bytes=kv_bytes,
        )
        return [_worker(f"vllm[{r}]", "vllm", payload, env) for r in range(gen.workers)]
    argv = [
        PY,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        o.served_model_name,
        "--dtype",
        config.model.dtype,
        "--seed",
        "0",
        "--max-model-len",
        str(o.max_model_len),
    ]
    argv += ["--enforce-eager"] if o.enforce_eager else []
    argv += ["--load-format", "dummy"] if gen.refit_fed else []
    argv += ["--gpu-memory-utilization", str(o.gpu_memory_utilization)] if _cuda() else []
    argv += ["--kv-cache-memory-bytes", str(kv_bytes)] if kv_bytes is not None else []
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return [
        _server(f"vllm-server[{r}]", argv, env, o.port + r if o.port else free_port())
        for r in range(gen.workers)
    ]


def _sglang_floor(config: Any, model_dir: str) -> list[Bare]:
    """One ``sglang.launch_server`` per worker, with the plugin's arguments and environment."""
    from rlcore_sglang.options import SGLangOptions
    from rlcore_sglang.server import SITE_DIR, find_sglang_python
    from rlcore_sglang.worker import launch_args, server_env

    gen = config.generation
    o = SGLangOptions(**dict(gen.options or {}))
    python, cuda = str(find_sglang_python(o.python)), _cuda()
    # The worker's server environment; ServerProcess puts the site directory on PYTHONPATH.
    env = {**server_env(int(_threads(gen)), cuda=cuda), "PYTHONPATH": str(SITE_DIR)}
    out = []
    for r in range(gen.workers):
        args = launch_args(
            model_dir,
            dtype=config.model.dtype,
            refit_fed=bool(gen.refit_fed),
            options=o,
            seed=r,
            cuda=cuda,
        )  # seed + rank, the worker's seed being 0
        argv = [python, "-m", "sglang.launch_server", *args]
        out.append(_server(f"sglang[{r}]", argv, env, o.port + r if o.port else free_port()))
    return out


def _gym_floor(config: Any, workdir: Path) -> Bare:
    """Gym's servers for the config's env, from the Gym venv, as the plugin's launcher starts them."""
    from rlcore_nemo_gym.options import NemoGymOptions
    from rlcore_nemo_gym.servers import LAUNCHER, LaunchSpec, find_gym_python, launcher_env

    o = NemoGymOptions(**dict(config.env.options or {}))
    gym_dir = workdir / "nemo_gym"
    gym_dir.mkdir(parents=True, exist_ok=True)
    spec = LaunchSpec.from_options(
        o,
        model_name=o.model_name,
        api_key=o.api_key,
        head_port=o.head_port or free_port(),
        workdir=gym_dir,
    )
    env = launcher_env()
    payload = {"spec": spec.to_json(), "launcher": str(LAUNCHER)}
    python = str(find_gym_python(o.gym_python))
    bare = _worker("nemo_gym", "gym", payload, {}, python=python, flags=["-I"])
    return Bare(bare.label, bare.argv, env, cwd=str(gym_dir))


def _megatron_floor(
    config: Any, role: str, section: Any, model_dir: str, env: dict[str, str]
) -> list[Bare]:
    checkpoint, padded = None, None
    if role == "generation" and not section.refit_fed:
        checkpoint, padded = _published_checkpoint(config, model_dir)
    port = free_port()
    env = {**env, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    payload = dict(
        world=section.workers,
        port=port,
        role=role,
        model_dir=model_dir,
        dtype=config.model.dtype,
        options=dict(section.options or {}),
        checkpoint=checkpoint,
        padded_vocab_size=padded,
    )
    return [
        _worker(f"megatron-{role}[{r}]", "megatron", {**payload, "rank": r}, env)
        for r in range(section.workers)
    ]


def _published_checkpoint(config: Any, model_dir: str) -> tuple[str | None, int | None]:
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


# ----------------------------------------------------------------- running the floor


@dataclass
class Started:
    """A launched :class:`Bare`: its process (a group leader), the process that prints its
    ready line (itself, or its watcher) and the log of its stderr (a server: all output)."""

    bare: Bare
    proc: subprocess.Popen
    reporter: subprocess.Popen
    log: Path


def _start(bare: Bare, logs: Path) -> Started:
    """Launch ``bare`` in a process group of its own (and its watcher, for a server)."""
    log = logs / f"{bare.label}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            bare.argv,
            env=bare.env,
            cwd=bare.cwd,
            stdin=subprocess.DEVNULL
            if bare.health
            else subprocess.PIPE,  # Gym's servers stop at EOF
            stdout=out if bare.health else subprocess.PIPE,
            stderr=out,
            start_new_session=True,
            text=True,
        )
    if bare.health is None:
        return Started(bare, proc, proc, log)
    watcher = subprocess.Popen(
        [PY, str(HERE), "--watch", bare.health],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    return Started(bare, proc, watcher, log)


def _read_ready(s: Started, t0: float, ready: dict[str, float]) -> threading.Thread:
    """A thread that records ``s``'s ready time (seconds after ``t0``) and drains its stdout."""

    def read() -> None:
        assert s.reporter.stdout is not None
        for line in s.reporter.stdout:
            if line.startswith(READY) and s.bare.label not in ready:
                ready[s.bare.label] = json.loads(line.split(" ", 1)[1])["t"] - t0

    thread = threading.Thread(target=read, name=f"ready-{s.bare.label}", daemon=True)
    thread.start()
    return thread


def _wait_all(
    started: list[Started],
    readers: list[threading.Thread],
    ready: dict[str, float],
    timeout_s: float = 900.0,
) -> None:
    """Until every process is ready; exits naming one that ended (or died) before it was."""
    end = time.monotonic() + timeout_s
    while len(ready) < len(started):
        for s, reader in zip(started, readers, strict=True):
            if s.bare.label not in ready and (not reader.is_alive() or s.proc.poll() is not None):
                reader.join(5.0)  # its ready line may still be in the pipe
                if s.bare.label not in ready:
                    tail = "\n".join(s.log.read_text(errors="replace").splitlines()[-30:])
                    raise SystemExit(
                        f"bare process {s.bare.label} exited ({s.proc.poll()}) before it "
                        f"was ready; end of {s.log}:\n{tail}"
                    )
        if time.monotonic() > end:
            late = [s.bare.label for s in started if s.bare.label not in ready]
            raise SystemExit(
                f"bare processes {late} not ready after {timeout_s:g}s (logs in {started[0].log.parent})"
            )
        time.sleep(0.05)


def _stop_all(started: list[Started], grace_s: float = 10.0) -> None:
    """End every process group (SIGTERM, SIGKILL after ``grace_s``); warn of any that survives."""
    from rlcore.runtime.proc import group_members, stop_group

    for s in started:
        for p in dict.fromkeys([s.proc, s.reporter]):
            if not stop_group(p.pid, grace_s, reap=[p], what=f"bare {s.bare.label}"):
                print(
                    f"warning: bare {s.bare.label} left processes {group_members(p.pid)}",
                    file=sys.stderr,
                    flush=True,
                )
            if p.stdin is not None:
                p.stdin.close()


def measure_floor(config: Any, model_dir: str, workdir: Path) -> dict[str, float]:
    """Start every bare process at once; seconds from launch to each one's ready line.
    Their process groups are ended before it returns (logs under ``workdir``)."""
    specs = _floor_processes(config, model_dir, workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started: list[Started] = []
    ready: dict[str, float] = {}
    t0 = time.time()
    try:
        for bare in specs:
            started.append(_start(bare, workdir))
        readers = [_read_ready(s, t0, ready) for s in started]
        _wait_all(started, readers, ready)
    finally:
        _stop_all(started)
    return {s.bare.label: ready[s.bare.label] for s in started}


class _Ended(Exception):
    """A bare recipe ending its process (``os._exit``) inside a Ray actor."""


def _run_as_actor(kind: str, payload: dict[str, Any]) -> float:
    """Run one bare worker recipe in this (Ray worker) process; when it is ready, return
    the moment (``time.monotonic``: one clock for every process of the machine)."""
    real_exit = os._exit

    def ended(code: int) -> None:
        raise _Ended(code)

    os._exit = ended  # the recipes end their process when ready; an actor returns instead
    try:
        _worker_main([kind, json.dumps(payload)])
    except _Ended:
        pass
    finally:
        os._exit = real_exit
    return time.monotonic()


class _BareActor:
    """A Ray actor that runs one bare recipe (rlcore's workers are actors too)."""

    def run(self, kind: str, payload: dict[str, Any]) -> float:
        return _run_as_actor(kind, payload)


def measure_floor_on_ray(config: Any, model_dir: str, workdir: Path) -> dict[str, float]:
    """The floor's worker processes as plain Ray actors, without rlcore: the embedded
    cluster rlcore starts (same settings), one actor per bare worker with the CPUs rlcore
    gives it, the bare processes' environment, each running the bare recipe. Seconds from
    the actors' request (Ray already up, as rlcore's setup begins) to each one's ready.
    Only for floors made of worker processes alone (no servers): Megatron's example."""
    import ray

    from rlcore.config import ClusterConfig
    from rlcore.runtime.cluster import Cluster

    specs = _floor_processes(config, model_dir, workdir)
    if any(b.health is not None or "--worker" not in b.argv for b in specs):
        raise SystemExit("--floor-on-ray: this config's floor has servers; use a config of workers only")
    # The bare processes' environment, given to Ray's processes as rlcore gives its own
    # (the driver's environment when the cluster starts, not a runtime_env, so the workers
    # Ray starts ahead of time serve the actors).
    env: dict[str, str] = {}
    for bare in specs:
        for k, v in bare.env.items():
            if os.environ.get(k) != v:
                if env.setdefault(k, v) != v:
                    raise SystemExit(f"--floor-on-ray: the bare processes differ in {k}")
    cpus = int(config.cluster.num_cpus or os.cpu_count() or 1)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        cluster = Cluster(ClusterConfig(num_cpus=cpus)).start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        actor_class = ray.remote(_BareActor)
        t0 = time.monotonic()
        refs = {}
        for bare in specs:
            at = bare.argv.index("--worker")
            kind, payload = bare.argv[at + 1], json.loads(bare.argv[at + 2])
            section = getattr(config, payload.get("role", "policy"))
            actor = actor_class.options(num_cpus=float(section.devices_per_worker)).remote()
            refs[bare.label] = actor.run.remote(kind, payload)
        return {label: ray.get(ref, timeout=600) - t0 for label, ref in refs.items()}
    finally:
        cluster.shutdown()


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
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
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
    """``rlcore run CONFIG grpo.steps=1``: setup figures and command-to-first-step. From
    another source tree ``root``, a relative ``config_path`` is that tree's own file."""
    if (
        root is not None
        and not Path(config_path).is_absolute()
        and Path(root, config_path).exists()
    ):
        config_path = str(Path(root, config_path))
    cmd = [
        str(Path(PY).with_name("rlcore")),
        "run",
        config_path,
        "--out",
        str(out_dir),
        "grpo.steps=1",
        *overrides,
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_source_env(root))
    t_exit = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
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
    parser.add_argument(
        "--twice",
        action="store_true",
        help="rlcore twice per round on a fresh cache; report the second",
    )
    parser.add_argument("--write", default=None, help="append the report to this file")
    parser.add_argument(
        "--floor-on-ray",
        action="store_true",
        help="also measure the floor's workers as plain Ray actors (no rlcore): what Ray's start of "
        "its worker processes costs on this machine (configs whose floor has no servers)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also run rlcore from this source tree in every round (e.g. `git archive` of the commit before a change)",
    )
    args = parser.parse_args(argv)

    from rlcore.config import cache_dir, load_config
    from rlcore.models.tiny import ensure_model

    scratch = Path(tempfile.mkdtemp(prefix="first-step-"))
    overrides = list(args.overrides)
    config = load_config(args.config, overrides)
    command = "python bench/first_step.py " + shlex.join(argv)
    report = [
        f"$ {command}",
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
    ]

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
                cold = measure_rlcore(
                    args.config, run_overrides[tag], scratch / f"run-{k}-{tag}-cold", trees[tag]
                )
                say(f"round {k + 1}: {tag} cold (1st) run: {_fmt(cold)}")
        floor_config = load_config(args.config, run_overrides["rlcore"])
        model_dir = str(ensure_model(floor_config.model, cache_dir(floor_config)))
        floor_each = measure_floor(floor_config, model_dir, scratch / f"floor-{k}")
        floor = max(floor_each.values())
        ray_s = measure_ray(int(config.cluster.num_cpus or os.cpu_count() or 1))
        say(
            f"round {k + 1}: floor {floor:.2f}s ({', '.join(f'{n} {t:.1f}' for n, t in floor_each.items())}), Ray start {ray_s:.2f}s"
        )
        row = {"floor_s": floor, "ray_s": ray_s}
        if args.floor_on_ray:
            on_ray = measure_floor_on_ray(floor_config, model_dir, scratch / f"floor-ray-{k}")
            row["floor_on_ray_s"] = max(on_ray.values())
            say(
                f"round {k + 1}: floor as plain Ray actors {row['floor_on_ray_s']:.2f}s "
                f"({', '.join(f'{n} {t:.1f}' for n, t in on_ray.items())}) = "
                f"{row['floor_on_ray_s'] / floor:.3f}x the floor"
            )
        # Alternate which tree runs first: the machine's load drifts within a round.
        for tag in list(trees) if k % 2 == 0 else list(trees)[::-1]:
            run = measure_rlcore(
                args.config, run_overrides[tag], scratch / f"run-{k}-{tag}", trees[tag]
            )
            row[f"{tag} cp/floor"] = run["critical_path_s"] / floor
            row[f"{tag} first_step/(ray+floor)"] = run["first_step_s"] / (ray_s + floor)
            if args.floor_on_ray:
                row[f"{tag} cp/floor_on_ray"] = run["critical_path_s"] / row["floor_on_ray_s"]
            say(f"round {k + 1}: {tag}{' (warm, 2nd run)' if args.twice else ''}: {_fmt(run)}")
            say(
                f"round {k + 1}: {tag}: critical path / floor = {row[f'{tag} cp/floor']:.3f} (goal <= 1.10); "
                f"command-to-first-step / (Ray start + floor) = {row[f'{tag} first_step/(ray+floor)']:.3f} (goal <= 1.25)"
                + (f"; critical path / floor as Ray actors = {row[f'{tag} cp/floor_on_ray']:.3f}" if args.floor_on_ray else "")
            )
        rows.append(row)
    if len(rows) > 1:
        for key in [k for k in rows[0] if "/" in k]:
            vals = [r[key] for r in rows]
            say(
                f"{key}: median {statistics.median(vals):.3f}, min {min(vals):.3f}, max {max(vals):.3f} over {len(vals)} rounds"
            )
    say(f"# run directories under {scratch}")
    if args.write:
        with open(args.write, "a") as f:
            f.write("\n".join(report) + "\n\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--watch":
        watch_health(sys.argv[2])
    else:
        main(sys.argv[1:])

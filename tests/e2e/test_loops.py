"""``examples/loops/``: loops of other algorithms on ``rlcore.open`` (issue 29, items 3 and 4).

In the default suite both loops run on the quickstart (FSDP + vLLM + arithmetic) one after
the other in this process, as a notebook would open two sessions: each must train (every
step recorded, reward and loss finite), check every refit (the first one on step 1's
samples, the last on the probe batch, all within ``refit.max_mult_prob_error``), write its
run directory, and leave nothing running or registered once its block is left (no Ray, no
worker process or actor, no placement record, no liveness watch, the signal handlers as they
were). A script refuses bad input before anything starts. Soak (``pytest -m soak``): each
loop unchanged on another policy/generation pair by config alone (Megatron + Megatron,
FSDP + SGLang), a loop script stopped by SIGINT, and two sessions joining an existing cluster.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest

from rlcore.app.records import read_metrics
from rlcore.testing.harness import LeakCheck

REPO = Path(__file__).resolve().parents[2]
LOOPS = REPO / "examples" / "loops"
NAMES = ("loo_reinforce", "multi_turn")
SMALL = ["grpo.prompts_per_step=4", "grpo.samples_per_prompt=4"]
MARKER = "RLCORE_LOOP_TEST"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"rlcore_loop_{name}", LOOPS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_run(run_dir: Path, steps: int) -> list[dict[str, Any]]:
    """The run trained ``steps`` steps, checked every refit within the limit and ended well."""
    records = read_metrics(run_dir / "metrics.jsonl")
    assert records[0]["step"] == 0 and records[0]["timing/setup/total_setup_time_s"] > 0  # the setup's line
    lines = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in lines] == list(range(1, steps + 1)), records
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["train/loss"]) for r in lines), lines
    # Session.train's metrics, recorded as the loop got them: rlcore run's names, every one.
    train = {"train/loss", "train/grad_norm", "train/clip_fraction", "train/tokens", "train/lr"}
    assert all(train <= set(r) and not {"loss", "grad_norm"} & set(r) for r in lines), lines
    checked = {r["refit/checked_step"]: r["refit/token_mult_prob_error"] for r in records if "refit/checked_step" in r}
    assert sorted(checked) == list(range(steps + 1)), records  # refit:initial, every step's
    assert all(1.0 <= e < 1.05 for e in checked.values()), checked
    status = json.loads((run_dir / "run.json").read_text())
    assert (status["status"], status["steps_done"]) == ("finished", steps), status
    spans = {e["name"] for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"}
    assert {"cluster start", "init:policy", "init:generation", "refit:initial"} <= spans, spans
    for name in ("config.yaml", "placement.json", "setup_timeline.png", "reward.png"):
        assert (run_dir / name).is_file(), name
    return lines


def _clean(placed_before: list[dict[str, Any]], handlers: dict[int, Any]) -> list[str]:
    """What a session left registered in this process."""
    import ray

    from rlcore.runtime.liveness import LIVENESS
    from rlcore.runtime.placed import placed_groups

    left = []
    if ray.is_initialized():
        left.append("Ray still connected")
    if placed_groups() != placed_before:
        left.append(f"placement records {placed_groups()[len(placed_before):]}")
    if LIVENESS._groups:
        left.append(f"liveness watches {list(LIVENESS._groups)}")
    now = {sig: signal.getsignal(sig) for sig in handlers}
    if now != handlers:
        left.append(f"signal handlers {now}")
    return left


# ---------------------------------------------------------------- the default suite


def test_the_loops_are_short() -> None:
    for name in NAMES:
        lines = (LOOPS / f"{name}.py").read_text().splitlines()
        assert len(lines) < 100, f"{name}.py has {len(lines)} lines"


@pytest.mark.parametrize("name", NAMES)
def test_a_loop_script_refuses_bad_input_before_anything_starts(tmp_path: Path, name: str) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(LOOPS / f"{name}.py"), "grpo.prompts_per_step=0", "--steps", "1", "--out", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and "grpo.prompts_per_step" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_both_loops_run_in_one_process_and_leave_nothing_behind(tmp_path: Path) -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    from rlcore.runtime.placed import placed_groups

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    placed_before = placed_groups()
    cache = tmp_path / "cache"
    for name in NAMES:  # the second is a second rlcore.open in the same process
        leaks = LeakCheck()
        argv = [f"setup.cache_dir={cache}", *SMALL, "--steps", "2", "--out", str(tmp_path / name)]
        t0 = time.monotonic()
        assert _module(name).main(argv) == 0
        print(f"{name}: {time.monotonic() - t0:.1f}s")
        lines = _check_run(tmp_path / name, 2)
        if name == "multi_turn":  # the env answered and the model spoke again
            assert all(1.0 < r["turns/mean"] <= 2.0 for r in lines), lines
        assert leaks.problems(10.0) == []
        assert _clean(placed_before, handlers) == []


# ---------------------------------------------------------------- soak


def _script(name: str, config: str, tmp_path: Path, *extra: str, steps: int = 2, marker: str = "") -> subprocess.Popen[str]:
    """``python examples/loops/NAME.py CONFIG ...`` in its own session, ``marker`` in the
    environment of every process of the run."""
    return subprocess.Popen(
        [sys.executable, str(LOOPS / f"{name}.py"), str(REPO / "examples" / config),
         f"setup.cache_dir={tmp_path / 'cache'}", *SMALL, *extra, "--steps", str(steps),
         "--out", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, MARKER: marker or uuid.uuid4().hex}, start_new_session=True,
    )


def _marked(marker: str) -> list[str]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            continue
    return found


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", ["megatron.yaml", "sglang.yaml"])
@pytest.mark.parametrize("name", NAMES)
def test_a_loop_runs_unchanged_on_another_pair(tmp_path: Path, name: str, config: str) -> None:
    pytest.importorskip("rlcore_megatron" if config == "megatron.yaml" else "rlcore_sglang")
    proc = _script(name, config, tmp_path)
    output, _ = proc.communicate(timeout=840)
    assert proc.returncode == 0, output[-4000:]
    _check_run(tmp_path / "run", 2)
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    backend = "megatron" if config == "megatron.yaml" else "sglang"
    assert any(backend in g["group"] for g in placement["groups"]), placement


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_a_loop_script_stopped_by_sigint_ends_cleanly(tmp_path: Path) -> None:
    pytest.importorskip("rlcore_vllm")
    marker = uuid.uuid4().hex
    proc = _script("loo_reinforce", "quickstart.yaml", tmp_path, steps=500, marker=marker)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if re.match(r"step +2 ", line):
                break
        os.kill(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "\n".join(lines) + "\n" + rest
    assert proc.returncode == 130, output[-4000:]
    assert re.search(r"^interrupted \(SIGINT\) during step \d+; shut down: .*Ray cluster", output, re.M), output[-4000:]
    assert "Traceback" not in output
    while _marked(marker) and time.monotonic() < exited + 5:
        time.sleep(0.1)
    assert _marked(marker) == []
    status = json.loads((tmp_path / "run" / "run.json").read_text())
    assert status["status"] == "interrupted" and status["steps_done"] >= 2, status


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_two_sessions_on_an_existing_cluster_leave_it_as_they_found_it(tmp_path: Path) -> None:
    pytest.importorskip("rlcore_vllm")
    from ray.cluster_utils import Cluster

    existing = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        from rlcore.runtime.placed import placed_groups

        placed_before = placed_groups()
        for name in NAMES:
            argv = [f"cluster.address={existing.address}", f"setup.cache_dir={tmp_path / 'cache'}", *SMALL,
                    "--steps", "1", "--out", str(tmp_path / name)]
            assert _module(name).main(argv) == 0
            _check_run(tmp_path / name, 1)
            assert _clean(placed_before, handlers) == []
            # The job's workers are gone; the cluster is not.
            workers = [p for p in psutil.process_iter(["cmdline"])
                       if any(w in " ".join(p.info["cmdline"] or []) for w in ("FSDPWorker", "VLLMWorker"))]
            deadline = time.monotonic() + 15
            while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers), workers
            assert existing.head_node.remaining_processes_alive()  # the cluster stays up
    finally:
        existing.shutdown()


class SkipRefit:
    """Test-only plugin: the refit of step 1 reports success and sends nothing (tryfirst,
    and ``rlcore_refit`` is firstresult), so the engine keeps the weights of step 0."""

    @staticmethod
    def rlcore_refit(policy: Any, generation: Any, ctx: Any) -> Any:
        from rlcore.handles import RefitReport

        return RefitReport(ctx.step, "skipped", 0, 0, 0.0) if ctx.step == 1 else None


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_a_refit_that_never_reached_the_engine_leaves_the_block_naming_it(tmp_path: Path) -> None:
    """A refit that reports success and sends nothing: the engine's weight version (it declares
    them) names it at the refit itself, before a refit check could (tests/app/test_diagnose.py
    holds the check's diagnosis of an engine that did not apply the weights)."""
    pytest.importorskip("rlcore_vllm")
    import rlcore
    from rlcore.errors import RefitError
    from rlcore.hookspecs import hookimpl

    plugin = SkipRefit()
    plugin.rlcore_refit = hookimpl(tryfirst=True)(SkipRefit.rlcore_refit)  # type: ignore[method-assign]
    overrides = {"setup.cache_dir": str(tmp_path / "cache"), "grpo.learning_rate": 0.5, "grpo.prompts_per_step": 4}
    with pytest.raises(RefitError) as info:  # noqa: PT012 - the loop is the subject
        with rlcore.open(None, overrides, out=tmp_path / "run", quiet=True, extra_plugins=[("skip", plugin)]) as s:
            loo = _module("loo_reinforce")
            for step in (1, 2):
                groups = s.rollouts(step)
                batch = [(r["prompt_ids"], r["token_ids"]) for g in groups for r in g]
                old = s.policy.logprobs(batch)
                s.check_refit(step - 1, generation_logprobs=[r["logprobs"] for g in groups for r in g],
                              policy_logprobs=old, sampled_by=step)
                s.train(step, batch, [a for g in groups for a in loo.loo_advantages([r["reward"] for r in g])], old)
                s.refit(step)
                s.record({"reward/mean": 0.0}, step)
    text = str(info.value)
    assert "after the refit of step 1, generation backend 'vllm' reports engine 0 holds version 0, not 1" in text, text
    status = json.loads((tmp_path / "run" / "run.json").read_text())
    assert status["status"] == "failed" and "RefitError" in status["error"] and status["steps_done"] == 0  # step 1 never recorded

"""Fixtures of the megatron plugin's tests.

The expensive work (processes that import megatron-core, converters, TP ranks)
runs once per session in fixtures that record what they observe; the tests
assert on those records. Every process is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from _megatron_helpers import spawn_ranks, tp_worker, write_tiny_qwen2  # noqa: E402

#: Upper bound of one converter or rank process run.
PROCESS_TIMEOUT_S = 240.0


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlcore.testing.fixtures import tiny_model_dir

    return tiny_model_dir(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2")
    write_tiny_qwen2(path)
    return path


def _script(hf_dir: Path, cache: Path, tp: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(HERE / "_convert_script.py"),
        str(hf_dir),
        str(cache),
        str(tp),
        *extra,
    ]


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=PROCESS_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"converter script failed ({proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _alive(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _cmdline(proc: Any) -> list[str]:
    try:
        return list(proc.cmdline())
    except Exception:
        return []


def _status(proc: Any) -> str:
    try:
        return str(proc.status())
    except Exception as err:
        return type(err).__name__


def _kill_scenario(hf_dir: Path, cache: Path, tp: int) -> dict[str, Any]:
    """SIGKILL a converter mid-write, look at what is left, then convert again."""
    import psutil

    from rlcore.publish import is_complete
    from rlcore_megatron.checkpoint import checkpoint_key, checkpoint_path

    rec: dict[str, Any] = {}
    destination = checkpoint_path(cache, checkpoint_key(hf_dir, _options(tp)))
    signal_file = cache.parent / f"{cache.name}.signal"
    proc = subprocess.Popen(
        _script(hf_dir, cache, tp, str(signal_file)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + PROCESS_TIMEOUT_S
        while not signal_file.exists():
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < end, "the converter never started writing"
            time.sleep(0.005)
        parent = psutil.Process(proc.pid)
        ranks, descendants = parent.children(), parent.children(recursive=True)
        # Read the ranks' state before the kill: right after it they start exiting.
        rank_state = [(p.pid, _status(p), " ".join(_cmdline(p))) for p in ranks]
        os.kill(proc.pid, signal.SIGKILL)
        converters = [p.pid for p in descendants]
        rec["ranks_alive_at_kill"] = sum(
            1 for _, status, cmd in rank_state if "_convert_worker" in cmd and status != "zombie"
        )
        rec["children_at_kill"] = [(pid, status, cmd[:90]) for pid, status, cmd in rank_state]
        rec["descendants_at_kill"] = len(converters)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    staging = Path(signal_file.read_text())
    rec["staging_files_at_kill"] = (
        sorted(p.name for p in staging.iterdir()) if staging.exists() else []
    )
    rec["destination_exists_after_kill"] = destination.exists()
    rec["complete_after_kill"] = is_complete(destination)
    end = time.monotonic() + 15
    while _alive(converters) and time.monotonic() < end:
        time.sleep(0.05)
    rec["descendants_alive_after_kill"] = _alive(converters)
    rerun = _result(
        subprocess.Popen(
            _script(hf_dir, cache, tp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    )
    rec["rerun_path"] = rerun["path"]
    rec["rerun_elapsed_s"] = rerun["elapsed_s"]
    rec["destination"] = str(destination)
    rec["complete_after_rerun"] = is_complete(destination)
    rec["cache_entries"] = sorted(os.listdir(destination.parent))
    return rec


def _concurrent_scenario(hf_dir: Path, cache: Path, tp: int) -> dict[str, Any]:
    """Two processes convert the same model at the same time."""
    from rlcore.publish import is_complete

    procs = [
        subprocess.Popen(
            _script(hf_dir, cache, tp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [_result(p) for p in procs]
    paths = [r["path"] for r in results]
    return {
        "paths": paths,
        "elapsed_s": [r["elapsed_s"] for r in results],
        "complete": is_complete(Path(paths[0])),
        "cache_entries": sorted(os.listdir(Path(paths[0]).parent)),
    }


def _options(tp: int) -> Any:
    from rlcore_megatron.options import MegatronOptions

    return MegatronOptions(tensor_model_parallel_size=tp)


@pytest.fixture(scope="session")
def publish_runs(
    tmp_path_factory: pytest.TempPathFactory, llama_dir: Path, qwen2_dir: Path
) -> dict[str, Any]:
    """Qwen2 at TP=2: converter killed mid-write, then rerun; Llama at TP=1: two concurrent converters."""
    root = tmp_path_factory.mktemp("publish")
    return {
        "killed": _kill_scenario(qwen2_dir, root / "cache-killed", tp=2),
        "concurrent": _concurrent_scenario(llama_dir, root / "cache-concurrent", tp=1),
    }


_reports: dict[int, dict[str, Any]] = {}


@pytest.fixture(scope="session")
def tp_report(
    tmp_path_factory: pytest.TempPathFactory,
    llama_dir: Path,
    qwen2_dir: Path,
    publish_runs: dict[str, Any],
) -> Any:
    """``tp_report(tp)``: what TP ranks measured (logits, round trip, checkpoint loads); cached."""

    def get(tp: int) -> dict[str, Any]:
        if tp not in _reports:
            work = tmp_path_factory.mktemp(f"tp{tp}")
            out = work / "report.json"
            models = [("llama", str(llama_dir)), ("qwen2", str(qwen2_dir))]
            checkpoints = [
                ("llama-tp1", publish_runs["concurrent"]["paths"][0], str(llama_dir)),
                ("qwen2-tp2", publish_runs["killed"]["rerun_path"], str(qwen2_dir)),
            ]
            t0 = time.monotonic()
            spawn_ranks(
                tp_worker,
                tp,
                ((work / "rendezvous").as_uri(), models, checkpoints, str(out)),
                timeout_s=PROCESS_TIMEOUT_S,
            )
            report = json.loads(out.read_text())
            report["wall_s"] = time.monotonic() - t0
            _reports[tp] = report
        return _reports[tp]

    return get

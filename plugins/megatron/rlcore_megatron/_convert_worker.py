"""One tensor-parallel rank of a Hugging Face -> Megatron conversion (a child process).

Started by :func:`rlcore_megatron.checkpoint.convert_to_directory` as
``python -m rlcore_megatron._convert_worker RANK JOB_JSON``.

It dies with its parent, and takes its own children along: megatron-core's
``dist_checkpointing.save`` starts a ``multiprocessing`` Manager (spawn
context, with a resource tracker) and forked writer processes, which would
otherwise outlive a killed rank forever. SIGTERM (sent by the parent on
cancellation, or by the kernel when the parent dies: ``PR_SET_PDEATHSIG``) and
a watchdog thread that notices a new parent pid both kill every descendant and
exit at once.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def _kill_descendants_and_exit(code: int) -> None:
    import psutil

    try:
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    finally:
        os._exit(code)


def _die_with_parent(parent_pid: int) -> None:
    """Exit, killing every descendant, on SIGTERM or when the parent process is gone."""
    signal.signal(signal.SIGTERM, lambda *_: _kill_descendants_and_exit(128 + signal.SIGTERM))
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    # The signal handler runs only between bytecodes of the main thread; this thread
    # also covers a main thread blocked in C and systems without PR_SET_PDEATHSIG.
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        _kill_descendants_and_exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def convert_rank(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rlcore_megatron import convert
    from rlcore_megatron.checkpoint import INFO_FORMAT, INFO_NAME
    from rlcore_megatron.parallel import (
        destroy_model_parallel,
        init_model_parallel,
        init_process_group,
    )

    tp = int(job["tp"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    t0 = time.monotonic()
    init_process_group(rank, tp, job["init_method"], timeout_s=job["timeout_s"])
    try:
        init_model_parallel(tp, seed=int(job["seed"]))
        hf_dir = Path(job["hf_dir"])
        spec = convert.ModelSpec.from_hf(hf_dir)
        divisible = int(job["make_vocab_size_divisible_by"])
        model = convert.build_gpt_model(
            spec, tp, dtype=job["dtype"], make_vocab_size_divisible_by=divisible
        )
        with convert.HFCheckpoint(hf_dir) as ckpt:
            convert.load_hf_weights(
                model,
                ckpt.get,
                spec,
                tp_rank=rank,
                tp_size=tp,
                make_vocab_size_divisible_by=divisible,
            )
        t_load = time.monotonic() - t0
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(model.sharded_state_dict(), job["out_dir"])
        torch.distributed.barrier()
        info = {
            "format": INFO_FORMAT,
            "recipe": convert.RECIPE_VERSION,
            "source": str(hf_dir),
            "tp": tp,
            "dtype": job["dtype"],
            "make_vocab_size_divisible_by": divisible,
            "padded_vocab_size": spec.padded_vocab_size(tp, divisible),
            "checkpoint_format": "torch_dist",
            "hf_config": json.loads((hf_dir / "config.json").read_text()),
            "megatron_core": _megatron_version(),
            "load_time_s": round(t_load, 3),
            "convert_time_s": round(time.monotonic() - t0, 3),
        }
        if rank == 0:
            tmp = Path(job["out_dir"]) / (INFO_NAME + ".tmp")
            tmp.write_text(json.dumps(info, indent=1, sort_keys=True))
            os.replace(tmp, Path(job["out_dir"]) / INFO_NAME)
        torch.distributed.barrier()
        return info
    finally:
        destroy_model_parallel()


def _megatron_version() -> str:
    from importlib.metadata import version

    try:
        return version("megatron-core")
    except Exception:  # pragma: no cover - not installed as a distribution
        return "unknown"


def main(argv: list[str]) -> int:
    rank, job = int(argv[1]), json.loads(argv[2])
    _die_with_parent(int(job["parent_pid"]))
    info = convert_rank(rank, job)
    print(f"rank {rank}: converted in {info['convert_time_s']:.2f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

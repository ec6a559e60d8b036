"""Checkpoint cost: save and load times and sizes, and what a save blocks of the step, with
the save serial, overlapped beside the next rollouts, and staged (the loop waits only for the
copy to host memory), measured in one run.

Runs ``python -m rlcore run CONFIG checkpoint.every_steps=1`` in each mode (``--modes``; the
order turns every round, so drift in the machine's load falls on all), reads each run's
``metrics.jsonl``:

* ``checkpoint/save_time_s``, ``checkpoint/bytes``, and for staged saves
  ``checkpoint/stage_time_s`` and ``checkpoint/host_bytes`` (the host copy) of every save;
* ``timing/checkpoint_time_s``: what each step waited for saves, over ``timing/step_time_s``;

then resumes the last run (``--resume``) with one step more and reads
``checkpoint/load_time_s``. Prints ``step_time_overlap_over_serial`` and
``step_time_staged_over_serial`` (mean step time with a save after every step; below 1: the
mode hides part of the save), ``blocked_share_*`` and, for staged saves,
``staged_blocked_over_host_copy``: what a save blocked the loop (the mean per step) over
one copy of the same bytes from the device into pinned host memory, timed here (on a machine
without CUDA, a host-to-host copy: a CPU figure, labelled so); issue 44's goal is <= 2.0.
``--write`` appends the figures with the command to a file.

    python bench/checkpoint.py --config examples/quickstart.yaml --steps 8 --rounds 2 \\
        --write bench/results/checkpoint_cpu.txt
    python3 bench/checkpoint.py --config examples/gpu/fsdp_megatron_colocated.yaml --steps 6 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIRST_MEASURED = 3
ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "rlcore", "run", *args]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def figures(lines: list[dict[str, Any]]) -> dict[str, float]:
    saves = [m for m in lines if "checkpoint/save_time_s" in m]
    # Steps 1 and 2 are left out in both modes: the first save is the slowest (the backend's
    # save plans are made then), and it falls in step 1 when saves are serial but in step 2
    # (the wait before its first policy call) when they overlap.
    steps = [m for m in lines if m.get("step", 0) >= FIRST_MEASURED and "timing/step_time_s" in m]
    blocked = sum(m["timing/checkpoint_time_s"] for m in steps)
    return {
        "save_s_median": statistics.median(m["checkpoint/save_time_s"] for m in saves),
        "mib": statistics.median(m["checkpoint/bytes"] for m in saves) / 2**20,
        "blocked_share": blocked / sum(m["timing/step_time_s"] for m in steps),
        "blocked_s_mean": blocked / len(steps),
        "step_s_median": statistics.median(m["timing/step_time_s"] for m in steps),
        "step_s_mean": statistics.fmean(m["timing/step_time_s"] for m in steps),
    }


#: The overrides of each mode.
MODES = {
    "serial": ["checkpoint.overlap=false", "checkpoint.staged=false"],
    "overlap": ["checkpoint.overlap=true", "checkpoint.staged=false"],
    "staged": ["checkpoint.overlap=true", "checkpoint.staged=true"],
}


def host_copy_s(nbytes: int) -> tuple[float, str]:
    """Seconds of one copy of ``nbytes`` into pinned host memory from the device (median of
    5), and what was copied."""
    import time

    import torch

    cuda = torch.cuda.is_available()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), ("device to pinned host" if cuda else "host to host (no CUDA: a CPU figure)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/quickstart.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--write", default=None)
    p.add_argument("extra", nargs="*", help="key=value overrides for every run")
    p.add_argument("--modes", default="serial,overlap,staged")
    a = p.parse_args()
    if a.steps < FIRST_MEASURED:
        p.error(f"--steps must be at least {FIRST_MEASURED} (steps 1 and 2 are not measured)")
    modes = a.modes.split(",")
    if "serial" not in modes or any(m not in MODES for m in modes):
        p.error(f"--modes: a comma list of {sorted(MODES)} with serial among them")
    got: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    host: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rlcore-bench-ckpt-") as tmp:
        last = Path(tmp)
        for r in range(a.rounds):
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            for i, mode in enumerate(order):
                last = Path(tmp) / f"r{r}-{mode}"
                run([a.config, f"grpo.steps={a.steps}", "checkpoint.every_steps=1", *MODES[mode], *a.extra,
                     "--out", str(last)])
                lines = records(last)
                got[mode].append(figures(lines))
                host += [m["checkpoint/host_bytes"] for m in lines if "checkpoint/host_bytes" in m]
                if r < a.rounds - 1 or i < len(order) - 1:
                    shutil.rmtree(last / "checkpoints")  # GBs each on a GPU model; only the last run is resumed
        run(["--resume", str(last), f"grpo.steps={a.steps + 1}", *a.extra])
        load_s = next(m["checkpoint/load_time_s"] for m in records(last) if "checkpoint/load_time_s" in m)
    mean = {k: {f: statistics.fmean(x[f] for x in v) for f in v[0]} for k, v in got.items()}
    serial = mean["serial"]
    lines = []
    for mode in [m for m in modes if m != "serial"]:
        ratio = mean[mode]["blocked_share"] / serial["blocked_share"] if serial["blocked_share"] else float("nan")
        lines += [f"step_time_{mode}_over_serial: {mean[mode]['step_s_mean'] / serial['step_s_mean']:.3f}",
                  f"blocked_share_{mode}_over_serial: {ratio:.3f}"]
    if "staged" in mean and host:
        nbytes = int(statistics.median(host))
        copy_s, what = host_copy_s(nbytes)
        lines.append(f"staged_blocked_over_host_copy: {mean['staged']['blocked_s_mean'] / copy_s:.2f}")
        lines.append(f"  a copy of the staged {nbytes / 2**20:.1f} MiB ({what}): {copy_s * 1e3:.1f} ms; "
                     f"the staged save blocked {mean['staged']['blocked_s_mean'] * 1e3:.1f} ms a step")
    for mode in modes:
        m = mean[mode]
        lines.append(f"  {mode + ':':8} save {m['save_s_median']:.3f} s, {m['mib']:.1f} MiB, blocks "
                     f"{m['blocked_share']:.1%} of a step ({m['blocked_s_mean'] * 1e3:.1f} ms of {m['step_s_median']:.2f} s)")
    lines += [f"  load (resume): {load_s:.3f} s",
              f"  ({a.rounds} rounds x {a.steps} steps, a save after every step, {a.config} {' '.join(a.extra)})"]
    print("\n".join(lines))
    if a.write:
        with open(a.write, "a", encoding="utf-8") as f:
            f.write("$ " + shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]) + "\n" + "\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()

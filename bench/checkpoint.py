"""Checkpoint cost: save and load times and sizes, and the share of a step saving blocks,
with the save overlapped beside the next rollouts and without, measured in one run.

Runs ``python -m rlcore run CONFIG checkpoint.every_steps=1`` with ``checkpoint.overlap``
true and false (alternating per round, so drift in the machine's load falls on both), reads
each run's ``metrics.jsonl``:

* ``checkpoint/save_time_s`` and ``checkpoint/bytes`` of every save;
* ``timing/checkpoint_time_s``: what each step waited for saves, over ``timing/step_time_s``
  (the share of the step saving blocks);

then resumes the last run (``--resume``) with one step more and reads
``checkpoint/load_time_s``. Prints ``step_time_overlap_over_serial: X`` (mean step time with
a save after every step, overlapped over serial; below 1: the overlap hides part of the save)
and ``blocked_share_overlap_over_serial`` with the figures under them; ``--write`` appends
them with the command to a file.

    python bench/checkpoint.py --config examples/quickstart.yaml --steps 8 --rounds 2 \\
        --write bench/results/checkpoint_cpu.txt
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
        "step_s_median": statistics.median(m["timing/step_time_s"] for m in steps),
        "step_s_mean": statistics.fmean(m["timing/step_time_s"] for m in steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/quickstart.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--write", default=None)
    p.add_argument("extra", nargs="*", help="key=value overrides for every run")
    a = p.parse_args()
    if a.steps < FIRST_MEASURED:
        p.error(f"--steps must be at least {FIRST_MEASURED} (steps 1 and 2 are not measured)")
    got: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="rlcore-bench-ckpt-") as tmp:
        last = Path(tmp)
        last_overlap = (a.rounds - 1) % 2 == 1  # the mode each round ends with
        for r in range(a.rounds):
            for overlap in ([True, False] if r % 2 == 0 else [False, True]):
                last = Path(tmp) / f"r{r}-{overlap}"
                run([a.config, f"grpo.steps={a.steps}", "checkpoint.every_steps=1", f"checkpoint.overlap={overlap}",
                     *a.extra, "--out", str(last)])
                got[overlap].append(figures(records(last)))
                if r < a.rounds - 1 or overlap != last_overlap:
                    shutil.rmtree(last / "checkpoints")  # GBs each on a GPU model; only the last run is resumed
        run(["--resume", str(last), f"grpo.steps={a.steps + 1}", *a.extra])
        load_s = next(m["checkpoint/load_time_s"] for m in records(last) if "checkpoint/load_time_s" in m)
    mean = {k: {f: statistics.fmean(x[f] for x in v) for f in v[0]} for k, v in got.items()}
    ratio = mean[True]["blocked_share"] / mean[False]["blocked_share"] if mean[False]["blocked_share"] else float("nan")
    lines = [
        f"step_time_overlap_over_serial: {mean[True]['step_s_mean'] / mean[False]['step_s_mean']:.3f}",
        f"blocked_share_overlap_over_serial: {ratio:.3f}",
        f"  serial:  save {mean[False]['save_s_median']:.3f} s, {mean[False]['mib']:.1f} MiB, "
        f"blocks {mean[False]['blocked_share']:.1%} of a step ({mean[False]['step_s_median']:.2f} s)",
        f"  overlap: save {mean[True]['save_s_median']:.3f} s, {mean[True]['mib']:.1f} MiB, "
        f"blocks {mean[True]['blocked_share']:.1%} of a step ({mean[True]['step_s_median']:.2f} s)",
        f"  load (resume): {load_s:.3f} s",
        f"  ({a.rounds} rounds x {a.steps} steps, a save after every step, {a.config} {' '.join(a.extra)})",
    ]
    print("\n".join(lines))
    if a.write:
        with open(a.write, "a", encoding="utf-8") as f:
            f.write("$ " + shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]) + "\n" + "\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()

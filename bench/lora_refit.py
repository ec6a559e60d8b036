"""A LoRA run's refit: the adapters alone against merged weights, in one invocation.

Runs ``rlcore run CONFIG`` twice, one after the other, with ``refit.adapters=auto`` (the
adapters alone, where the generation serves them in place: refit content ``adapters``) and
``refit.adapters=merged`` (every weight, base + the adapters' product), the same steps and
seed, and prints from each run's ``metrics.jsonl`` the medians over its steps of what a
refit moved (``refit/bytes``) and took (``refit/weight_sync_time_s``, ``timing/refit_time_s``),
the step and generate times and the refit check, then the ratios adapters / merged (the
generate time shows what serving the adapters unmerged costs the engine).

    python bench/lora_refit.py                                   # examples/lora.yaml
    python bench/lora_refit.py --steps 6 model.tiny.hidden_size=512 model.tiny.num_layers=8 \\
        model.tiny.num_heads=16 model.tiny.intermediate_size=1536

The figures are this machine's (CPU: a toy model unless a larger shape is given); the
ratio of bytes is the model's, whatever the machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlcore.app.records import read_metrics  # noqa: E402

RLCORE = Path(sys.executable).with_name("rlcore")
KEYS = {
    "refit_bytes": "refit/bytes",
    "refit_sync_s": "refit/weight_sync_time_s",
    "refit_call_s": "timing/refit_time_s",
    "step_s": "timing/step_time_s",
    "generate_s": "timing/generate_time_s",
    "train_s": "timing/train_time_s",
    "mult_prob_err": "refit/token_mult_prob_error",
}


def one_run(config: str, mode: str, steps: int, extra: list[str], out: Path) -> dict[str, float]:
    """The medians over the steps of one run with ``refit.adapters=mode``."""
    t0 = time.monotonic()
    done = subprocess.run(
        [str(RLCORE), "run", config, f"grpo.steps={steps}", f"refit.adapters={mode}", *extra, "--out", str(out)],
        capture_output=True, text=True, cwd=REPO,
    )
    if done.returncode != 0:
        raise SystemExit(f"rlcore run ({mode}) failed, rc {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    figures = {name: statistics.median(float(r[key]) for r in rows) for name, key in KEYS.items()}
    figures["transport"] = rows[0]["refit/transport"]
    figures["wall_s"] = time.monotonic() - t0
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "examples" / "lora.yaml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs (key=value)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlcore-lora-refit-") as tmp:
        runs = {
            mode: one_run(args.config, mode, args.steps, args.overrides, Path(tmp) / mode)
            for mode in ("auto", "merged")
        }
    a, m = runs["auto"], runs["merged"]
    print(f"# python bench/lora_refit.py --config {args.config} --steps {args.steps} {' '.join(args.overrides)}")
    print(f"refit_bytes_adapters_over_merged: {a['refit_bytes'] / m['refit_bytes']:.4f}")
    print(f"refit_time_adapters_over_merged: {a['refit_sync_s'] / m['refit_sync_s']:.3f}")
    print(f"refit_call_adapters_over_merged: {a['refit_call_s'] / m['refit_call_s']:.3f}")
    print(f"step_time_adapters_over_merged: {a['step_s'] / m['step_s']:.3f}")
    print(f"generate_time_adapters_over_merged: {a['generate_s'] / m['generate_s']:.3f}")
    for mode, f in runs.items():
        print(
            f"# refit.adapters={mode}: transport {f['transport']}, refit {f['refit_bytes'] / 2**20:.3f} MiB in "
            f"{f['refit_sync_s'] * 1e3:.1f} ms (the refit call {f['refit_call_s'] * 1e3:.1f} ms), step "
            f"{f['step_s']:.2f} s (generate {f['generate_s']:.2f} s, train {f['train_s']:.2f} s), mult_prob_err {f['mult_prob_err']:.4f}, run {f['wall_s']:.0f} s"
        )


if __name__ == "__main__":
    main()

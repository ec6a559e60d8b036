"""PNG plots of a run: the setup timeline and the reward curve (matplotlib, headless).

Each PNG is drawn in memory and written whole (:func:`rlcore.app.records.write_atomic`):
a full disk leaves the previous file or none, never a truncated or empty one.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.app.records import write_atomic


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def plot_setup_timeline(
    spans: Sequence[tuple[str, float, float, str]], path: Path, *, title: str, annotations: Mapping[str, float]
) -> Path:
    """A Gantt chart of setup tasks: (name, start_s, end_s, status) relative to setup start."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(spans)))
    colors = {"ok": "tab:green", "failed": "tab:red", "cancelled": "tab:orange", "timed_out": "tab:red"}
    for i, (_name, start, end, status) in enumerate(spans):
        ax.barh(i, max(end - start, 1e-3), left=start, color=colors.get(status, "tab:gray"))
        ax.text(end, i, f" {end - start:.2f}s", va="center", fontsize=8)
    ax.set_yticks(range(len(spans)), [s[0] for s in spans])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since setup start")
    ax.set_title(title + "\n" + "  ".join(f"{k}={v:.2f}s" for k, v in annotations.items()), fontsize=9)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_reward(history: Sequence[Mapping[str, Any]], path: Path, *, title: str) -> Path:
    """Mean (and exact-answer rate, if logged) reward per step, and against the wall time
    since step 1 began where the lines carry ``time`` (a loop that runs ahead,
    ``grpo.max_staleness``, trades steps for seconds: both axes tell whether it paid)."""
    plt = _pyplot()
    timed = bool(history) and all("time" in h for h in history)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 7, 4), squeeze=False)
    steps = [h["step"] for h in history]
    xs: list[tuple[Any, list[float], str]] = [(axes[0][0], [float(s) for s in steps], "step")]
    if timed:
        t0 = history[0]["time"] - float(history[0].get("timing/step_time_s") or 0.0)
        xs.append((axes[0][1], [h["time"] - t0 for h in history], "seconds since step 1 began"))
    for ax, x, label in xs:
        ax.plot(x, [h["reward/mean"] for h in history], marker="o", label="reward/mean")
        if history and "reward/exact" in history[0]:
            ax.plot(x, [h["reward/exact"] for h in history], marker=".", label="reward/exact")
        ax.set_xlabel(label)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, whole or not at all; raises RunDirError."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110)
    finally:
        plt.close(fig)
    return write_atomic(path, buf.getvalue())

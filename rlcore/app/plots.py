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
    """Mean (and exact-answer rate, if logged) reward per step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["reward/mean"] for h in history], marker="o", label="reward/mean")
    if history and "reward/exact" in history[0]:
        ax.plot(steps, [h["reward/exact"] for h in history], marker=".", label="reward/exact")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
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

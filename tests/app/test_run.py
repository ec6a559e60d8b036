"""``rlcore run``'s step lines and their legend (rlcore/app/run.py): every column a step line
shows is explained in the legend the run prints before its first step and in the README
("Reading the step lines"). The quickstart's console as printed: tests/e2e/test_e2e_console.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from rlcore.app.run import LEGEND_WIDTH, STEP_COLUMNS, STEP_TIMES, legend, step_line

REPO = Path(__file__).resolve().parents[2]

#: A step line's metrics with every column it can show: a failed reward, the loop ahead.
EVERY_COLUMN = {
    "step": 7, "reward/mean": 0.5, "reward/exact": 0.25, "reward/failed": 2,
    "refit/weight_sync_time_s": 0.031, "refit/token_mult_prob_error": 1.0001, "refit/checked_step": 6,
    "staleness/max_staleness": 1, "staleness/lag_max": 1,
    "timing/step_time_s": 0.4, "timing/generate_time_s": 0.1, "timing/wait_for_rollouts_time_s": 0.05,
    "timing/train_time_s": 0.2, "timing/refit_time_s": 0.04, "timing/handoff_time_s": 0.0,
    "timing/refit_check_share": 0.014,
}
#: Units and the line's own name: not columns.
NOT_COLUMNS = {"step", "ms", "s"}


def _columns(line: str) -> set[str]:
    """The words of a step line that name a column (markup and numbers left out)."""
    return set(re.findall(r"[a-z_]+", re.sub(r"\[/?\w+\]", "", line))) - NOT_COLUMNS


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", text) is not None


def test_every_column_of_a_step_line_is_in_the_legend() -> None:
    line = step_line(EVERY_COLUMN)
    assert line.startswith("step   7  reward 0.500  exact 0.25  [yellow]failed 2[/yellow]  refit 31 ms  ")
    columns = _columns(line)
    # Not vacuous: the line has the columns this test is about.
    assert {"reward", "exact", "failed", "mult_prob_err", "lag", "generate", "ahead", "waited", "train",
            "refit", "handoff", "check"} <= columns, columns
    text = "\n".join(legend(ahead=True, failed=True))
    missing = sorted(c for c in columns if not _has_word(text, c))
    assert not missing, f"columns of the step line the legend does not explain: {missing}\n{text}"


def test_the_legend_shows_what_this_run_shows_within_its_width() -> None:
    plain = legend()
    # A synchronous run without failed rewards: no lag, no ahead, no failed.
    synchronous = {k: v for k, v in EVERY_COLUMN.items() if k != "staleness/max_staleness"}
    plain_line = step_line({**synchronous, "reward/failed": 0})
    assert "lag" not in plain_line and "failed" not in plain_line and "ahead" not in plain_line
    text = "\n".join(plain)
    assert all(_has_word(text, c) for c in _columns(plain_line)), text
    for word in ("lag", "failed", "ahead"):
        assert not _has_word(text, word), text
    assert all(len(x) <= LEGEND_WIDTH for x in plain + legend(ahead=True, failed=True))
    # The first line names the README's section; none starts like a step line ("step N").
    assert plain[0].endswith('"Reading the step lines"):')
    assert not any(x.startswith("step ") for x in plain)


def test_the_readme_explains_every_column() -> None:
    readme = (REPO / "README.md").read_text()
    start = readme.index("### Reading the step lines")
    section = readme[start : readme.index("\n#", start + 1)]
    quoted = " ".join(re.findall(r"`([^`]*)`", section))
    labels = {w for label, _ in STEP_COLUMNS + STEP_TIMES for w in re.findall(r"[a-z_]+", label)} - {"ts"}
    columns = _columns(step_line(EVERY_COLUMN))
    missing = sorted(c for c in labels | columns if not _has_word(quoted, c))
    assert not missing, f"the README's 'Reading the step lines' does not name: {missing}"

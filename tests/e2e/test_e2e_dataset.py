"""End to end: examples/dataset.yaml (a file of math word problems, a reward file) trains
the quickstart's FSDP policy and vLLM generation on CPU, and the reward rises; a reward
that does not exist is refused before anything starts."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rlcore_fsdp")
pytest.importorskip("rlcore_vllm")
pytest.importorskip("rlcore_dataset")

from rlcore.app.records import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "dataset.yaml")
RLCORE = Path(sys.executable).with_name("rlcore")
STEPS = 20


@pytest.fixture(scope="module")
def dataset_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("dataset") / "run"
    cache = tmp_path_factory.mktemp("cache")
    done = subprocess.run(
        [str(RLCORE), "run", EXAMPLE, f"grpo.steps={STEPS}", f"setup.cache_dir={cache}", "--out", str(run_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=840,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return run_dir


def test_reward_rises_on_the_file_of_prompts(dataset_run: Path) -> None:
    steps = [r for r in read_metrics(dataset_run / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["reward/failed"] == 0 for r in steps)
    rewards = [r["reward/mean"] for r in steps]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.1, rewards


def test_a_bad_reward_is_refused_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(RLCORE), "run", EXAMPLE, "env.options.reward=examples/math_reward.py:nope", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "env.options.reward: 'examples/math_reward.py' has no function 'nope'" in done.stdout + done.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("staleness", [0, 1])
def test_dynamic_sampling_trains_no_group_of_equal_rewards(staleness: int, tmp_path: Path) -> None:
    """Two samples per prompt make groups of equal rewards common (both without a number):
    with grpo.dynamic_sampling none is trained on, and the dropped ones are replaced by
    extra draws of the env, as the step's line says; in the synchronous loop and in the one
    that samples ahead (grpo.max_staleness 1)."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [str(RLCORE), "run", EXAMPLE, "grpo.steps=3", "grpo.samples_per_prompt=2", "grpo.dynamic_sampling=true",
         f"grpo.max_staleness={staleness}", f"setup.cache_dir={tmp_path / 'cache'}", "--out", str(run_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=840,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["reward/zero_variance_groups"] == 0 for r in steps), steps
    assert sum(r["sampling/dropped_groups"] for r in steps) > 0
    assert all(r["sampling/extra_draws"] >= (r["sampling/dropped_groups"] > 0) for r in steps)
    assert all(r["generate/prompt_tokens"] > 0 for r in steps)


FAILS_AT_STEP_3 = '''\
import os

COUNT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls")


def parse_answer(text):
    return int("not a number: " + text)


def correct(completions, answer, **kw):
    with open(COUNT, "a+") as f:  # one byte per call: steps 1 and 2 are 16 calls (8 groups each)
        f.write("x")
        f.seek(0)
        calls = len(f.read())
    if calls > 16:
        return [float(parse_answer(c)) for c in completions]
    return [0.5 for _ in completions]
'''


def test_a_reward_that_raises_at_step_3_shows_its_frames_and_the_plot_of_steps_1_and_2(tmp_path: Path) -> None:
    """The console's error names the user's file and lines (not rlcore's reward process), and
    the failed run still writes reward.png of the steps it finished."""
    reward = tmp_path / "reward.py"
    reward.write_text(FAILS_AT_STEP_3)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [str(RLCORE), "run", EXAMPLE, "grpo.steps=4", f"env.options.reward={reward}:correct",
         f"setup.cache_dir={tmp_path / 'cache'}", "--out", str(run_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=840,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 3, out[-3000:]
    error = out[out.index("error: reward function 'correct'"):]
    assert "raised ValueError: invalid literal for int()" in error.splitlines()[0]
    lines = FAILS_AT_STEP_3.splitlines()
    for fn, text in (("correct", "parse_answer(c)"), ("parse_answer", 'int("not a number')):
        line = next(i for i, s in enumerate(lines) if text in s) + 1
        assert f'File "{reward}", line {line}, in {fn}' in error, error
    assert "rlcore_dataset" not in error and "site-packages" not in error, error
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r] == [1, 2]
    assert (run_dir / "reward.png").stat().st_size > 1000

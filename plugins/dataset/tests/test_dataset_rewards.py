"""Reward calls in their own processes: concurrent, bounded, every failure named."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import pytest

from rlcore_dataset.pool import RewardPool
from rlcore_dataset.rewards import RewardSpec
from rlcore_dataset.scoring import GroupInput, RewardError, score_groups

REWARDS = str(Path(__file__).resolve().parent / "fixture_rewards.py")
GROUPS = [
    GroupInput(row=4, prompt="4+1=", columns={"answer": "5", "id": 4}, completions=["5", "b", "55"],
               origin="prompts.jsonl line 5"),
    GroupInput(row=7, prompt="7+1=", columns={"answer": "8", "id": 7}, completions=["8", "8"]),
]


def pool_of(*names: str, workers: int = 2, timeout_s: float = 30.0) -> tuple[RewardPool, list[RewardSpec]]:
    specs = [RewardSpec(f"{REWARDS}:{n}") for n in names]
    pool = RewardPool([s.spec for s in specs], workers=workers, timeout_s=timeout_s)
    pool.start()
    return pool, specs


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_rewards_are_called_with_completions_and_columns_and_weighted() -> None:
    pool, _ = pool_of("matches", "async_length", "rank_in_group")
    try:
        specs = [RewardSpec(f"{REWARDS}:matches", 2.0), RewardSpec(f"{REWARDS}:async_length", 0.5),
                 RewardSpec(f"{REWARDS}:rank_in_group", 1.0)]
        got = score_groups(pool, specs, GROUPS, on_error="fail")
        # matches*2 + len*0.5 + (longest of its group: 1)
        assert got[0].rewards == [2.0 + 0.5, 0.5, 1.0 + 1.0]
        assert got[1].rewards == [2.0 + 0.5 + 1.0] * 2
        assert got[0].failed == [None] * 3
        assert all(p != os.getpid() for p in pool.pids())  # never in the calling process
    finally:
        pool.close()
    assert not any(alive(p) for p in pool.pids())


@pytest.mark.parametrize(("fn", "why"), [
    ("raises", "raised ValueError: boom"),
    ("one_short", "returned 2 scores for 3 completions"),
    ("nan_for_b", "returned nan for completion 1"),
    ("dies", r"its process exited during the call \(exit code 3"),
])
def test_a_broken_reward_is_named_with_its_row(fn: str, why: str, caplog: pytest.LogCaptureFixture) -> None:
    pool, specs = pool_of(fn, workers=1)
    try:
        with pytest.raises(RewardError, match=rf"'{fn}'.*on prompts.jsonl line 5 of env.options.data: {why}"):
            score_groups(pool, specs, GROUPS[:1], on_error="fail")
        with caplog.at_level(logging.WARNING, logger="rlcore_dataset.scoring"):
            skipped = score_groups(pool, specs, GROUPS[:1], on_error="skip")[0]
        # One warning for the call, counting the samples, not one per sample.
        warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith(f"{1 if fn == 'nan_for_b' else 3} sample(s) left out")
        failed = [f is not None for f in skipped.failed]
        assert failed == ([False, True, False] if fn == "nan_for_b" else [True, True, True])
        assert all(re.search(why, f) for f in skipped.failed if f)
        # The pool still serves (a dead process was replaced).
        assert score_groups(pool, [RewardSpec(f"{REWARDS}:{fn}")], GROUPS[1:], on_error="skip")
    finally:
        pool.close()


def test_a_hung_reward_is_killed_and_its_process_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed at its timeout, said plainly; the fresh process is started by the next call
    that needs it, not at the kill (a run that ends on the timeout claims and starts none)."""
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("HANG_PID_FILE", str(pid_file))
    pool, specs = pool_of("hangs", "length", workers=1, timeout_s=1.0)
    try:
        before = pool.pids()
        got = score_groups(pool, specs[:1], GROUPS[:1], on_error="skip")[0]
        assert None not in got.failed
        assert all(f.endswith(
            "timed out after 1 s (env.options.reward_timeout_s): the call did not return in time, "
            "so its process and what it started were killed"
        ) for f in got.failed if f), got.failed
        assert not any("restart" in f for f in got.failed if f)
        hung = int(pid_file.read_text())
        assert hung == before[0]
        deadline = time.monotonic() + 10
        while alive(hung) and time.monotonic() < deadline:  # reaped by join; bounded wait
            time.sleep(0.05)
        assert not alive(hung)
        assert pool.pids() == [] and pool.procs[0].restarts == 0  # nothing started at the kill
        ok = score_groups(pool, specs[1:], GROUPS[1:], on_error="fail")[0]
        assert ok.rewards == [1.0, 1.0]
        assert len(pool.pids()) == 1 and pool.pids() != before and pool.procs[0].restarts == 1
    finally:
        pool.close()


def test_a_run_that_ends_on_a_timeout_starts_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """on_reward_error=fail: the error ends the run; closing the pool then starts nothing."""
    monkeypatch.setenv("HANG_PID_FILE", str(tmp_path / "pid"))
    pool, specs = pool_of("hangs", workers=1, timeout_s=1.0)
    try:
        with pytest.raises(RewardError, match=r"on prompts.jsonl line 5 of env.options.data: timed out after 1 s") as info:
            score_groups(pool, specs, GROUPS[:1], on_error="fail")
        assert "restart" not in str(info.value)
    finally:
        pool.close()
    assert pool.procs[0].restarts == 0 and pool.pids() == []


def _line_of(fn: str, text: str) -> int:
    """The 1-based line of ``fixture_rewards.py`` in ``fn`` that holds ``text``."""
    lines = Path(REWARDS).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {fn}("))
    return next(i for i in range(start, len(lines)) if text in lines[i]) + 1


def test_a_raising_reward_shows_its_own_frames_under_the_error(caplog: pytest.LogCaptureFixture) -> None:
    """The error names the user's file and lines (their function, the helper it called), not
    rlcore's reward process or the standard library the exception came from."""
    pool, specs = pool_of("raises_in_helper", workers=1)
    try:
        with pytest.raises(RewardError) as info:
            score_groups(pool, specs, GROUPS[:1], on_error="fail")
        first, *rest = str(info.value).splitlines()
        assert "raised JSONDecodeError" in first and "on prompts.jsonl line 5" in first
        block = "\n".join(rest)
        call_line = _line_of("raises_in_helper", "_parse(c)")
        assert f'File "{REWARDS}", line {call_line}, in raises_in_helper' in block, block
        assert f'File "{REWARDS}", line {_line_of("_parse", "json.loads")}, in _parse' in block, block
        assert "return json.loads(text)" in block  # the source line, as Python shows it
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', block)
        assert frames[0][2] == "raises_in_helper" and frames[-1][2] == "_parse"  # innermost last
        for internal in ("rlcore_dataset", "json/decoder.py", "json/__init__.py", "site-packages"):
            assert internal not in block, block

        # Under skip: the first warning carries the traceback, a repeat of it does not.
        shown: set[str] = set()
        with caplog.at_level(logging.WARNING, logger="rlcore_dataset.scoring"):
            score_groups(pool, specs, GROUPS[:1], on_error="skip", shown=shown)
            score_groups(pool, specs, GROUPS[:1], on_error="skip", shown=shown)
        warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert len(warned) == 2
        assert f"line {call_line}, in raises_in_helper" in warned[0]
        assert "traceback" not in warned[1] and "File " not in warned[1]
    finally:
        pool.close()


def test_user_frames_leave_out_rlcore_and_libraries() -> None:
    """In the calling process too: rlcore_dataset's call wrapper and json's frames are cut, the
    test's own lambda and the fixture's functions stay, innermost last, at most ``limit``."""
    from rlcore_dataset import rewards
    from rlcore_dataset.pool import user_frames

    fn = rewards.load(f"{REWARDS}:raises_in_helper")
    try:
        rewards.call(fn, {"completions": ["x"]})
    except ValueError as err:
        frames = user_frames(err.__traceback__)
        last = user_frames(err.__traceback__, limit=1)
    else:
        pytest.fail("the reward did not raise")
    files = re.findall(r'File "([^"]+)", line \d+, in (\S+)', frames)
    assert files[0] == (__file__, "test_user_frames_leave_out_rlcore_and_libraries")
    assert files[-1] == (REWARDS, "_parse")
    assert all("rlcore_dataset" not in f and "/json/" not in f for f, _ in files)
    assert re.findall(r'File "([^"]+)", line \d+, in (\S+)', last) == [(REWARDS, "_parse")]

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
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("HANG_PID_FILE", str(pid_file))
    pool, specs = pool_of("hangs", "length", workers=1, timeout_s=1.0)
    try:
        before = pool.pids()
        got = score_groups(pool, specs[:1], GROUPS[:1], on_error="skip")[0]
        assert all("timed out after 1 s" in f for f in got.failed if f) and None not in got.failed
        hung = int(pid_file.read_text())
        assert hung == before[0]
        deadline = time.monotonic() + 10
        while alive(hung) and time.monotonic() < deadline:  # reaped by join; bounded wait
            time.sleep(0.05)
        assert not alive(hung)
        assert pool.pids() != before
        ok = score_groups(pool, specs[1:], GROUPS[1:], on_error="fail")[0]
        assert ok.rewards == [1.0, 1.0]
    finally:
        pool.close()

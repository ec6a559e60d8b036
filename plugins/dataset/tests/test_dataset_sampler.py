from __future__ import annotations

from rlcore_dataset.sampler import EpochSampler


def test_each_epoch_takes_every_row_once_in_a_seeded_order() -> None:
    s = EpochSampler(10, seed=3)
    taken = [s.take(4, step) for step in range(1, 6)]  # 20 rows: two epochs
    flat = [i for t in taken for i in t]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:] and flat[:10] != list(range(10))  # a new order each epoch
    again = EpochSampler(10, seed=3)
    assert [again.take(4, step) for step in range(1, 6)] == taken
    assert EpochSampler(10, seed=4).take(10, 1) != flat[:10]
    assert EpochSampler(10, shuffle=False).take(12, 1) == [*range(10), 0, 1]


def test_a_step_asked_again_gets_the_same_rows() -> None:
    s = EpochSampler(10)
    first = s.take(3, 1)
    assert s.take(3, 1) == first and s.position == 3
    assert s.take(3, 2) != first


def test_state_resumes_the_stream_where_it_was() -> None:
    run = EpochSampler(7, seed=1)
    steps = [run.take(3, step) for step in range(1, 6)]
    cut = EpochSampler(7, seed=1)
    for step in range(1, 3):
        cut.take(3, step)
    resumed = EpochSampler(7, seed=1)
    resumed.load_state(cut.state())
    assert [resumed.take(3, step) for step in range(3, 6)] == steps[2:]
    other = EpochSampler(7, seed=2)
    try:
        other.load_state(cut.state())
    except ValueError as err:
        assert "seed" in str(err)
    else:
        raise AssertionError("a state of another seed was accepted")


def test_the_state_after_a_step_ignores_steps_taken_ahead() -> None:
    """A loop that samples ahead (grpo.max_staleness) has taken steps 3 and 4 when step 2's
    checkpoint is saved: the state after step 2 still resumes at step 3's rows."""
    run = EpochSampler(7, seed=1)
    steps = [run.take(3, step) for step in range(1, 6)]
    ahead = EpochSampler(7, seed=1)
    for step in range(1, 5):
        ahead.take(3, step)
    resumed = EpochSampler(7, seed=1)
    resumed.load_state(ahead.state(after_step=2))
    assert [resumed.take(3, step) for step in range(3, 6)] == steps[2:]
    assert ahead.state()["position"] == 12 and ahead.state(after_step=2)["position"] == 6


def test_an_extra_draw_takes_the_next_rows_and_is_repeatable() -> None:
    s = EpochSampler(20, seed=2)
    own = s.take(4, 1)
    extra = s.take(4, 1, draw=1)
    assert not set(own) & set(extra) and s.position == 8
    assert s.take(4, 1, draw=1) == extra and s.position == 8  # asked again: the same rows
    nxt = s.take(4, 2)
    assert not set(nxt) & (set(own) | set(extra))
    # A run resumed after step 1 starts step 2 where it started, past step 1's extra draw.
    assert s.state(after_step=1)["position"] == 8

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

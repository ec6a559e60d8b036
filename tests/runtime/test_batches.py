import pytest

from rlcore.runtime.batches import check_rows, check_train_inputs, shard_range


def test_shard_range_covers_rows_once() -> None:
    for n in range(0, 9):
        for parts in (1, 2, 3, 4):
            ranges = [shard_range(n, parts, i) for i in range(parts)]
            assert [i for s, e in ranges for i in range(s, e)] == list(range(n))
            sizes = [e - s for s, e in ranges]
            assert max(sizes) - min(sizes) <= 1


def test_bad_batches_name_the_row() -> None:
    with pytest.raises(ValueError, match="batch row 1 is not"):
        check_rows([([1], [2]), 7])
    with pytest.raises(ValueError, match="batch row 0 has an empty prompt"):
        check_rows([([], [2])])
    with pytest.raises(ValueError, match="1 advantages for a batch of 2 rows"):
        check_train_inputs([([1], [2]), ([1], [3])], [0.5], None)
    with pytest.raises(ValueError, match="batch row 0: 2 old logprobs for 1 completion tokens"):
        check_train_inputs([([1], [2])], [0.5], [[-1.0, -2.0]])
    assert check_train_inputs([((1,), (2, 3))], [1.0], [[-1.0, -2.0]]) == [([1], [2, 3])]

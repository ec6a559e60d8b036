import math

import pytest

from rlcore.grpo import group_advantages, token_mult_prob_error


def test_group_advantages_normalise_within_each_group() -> None:
    adv = group_advantages([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5]])
    assert adv[0] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-4)
    assert adv[1] == [0.0, 0.0]  # no signal in a group of equal rewards
    assert sum(adv[0]) == pytest.approx(0.0, abs=1e-9)


def test_token_mult_prob_error() -> None:
    assert token_mult_prob_error([[-1.0, -2.0]], [[-1.0, -2.0]]) == 1.0
    assert token_mult_prob_error([[-1.0, -2.0]], [[-1.1, -1.9]]) == pytest.approx(math.exp(0.1))
    with pytest.raises(ValueError):
        token_mult_prob_error([[]], [[]])

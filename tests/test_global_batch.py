"""`train.batch_size` is the global batch: each rank takes an equal share, or the stage stops naming the numbers."""
from __future__ import annotations

import pytest

from clipfinetune.train import per_rank_batch_size


@pytest.mark.parametrize("global_batch, world_size, expected", [(64, 1, 64), (64, 2, 32), (256, 8, 32), (6, 3, 2)])
def test_each_rank_takes_an_equal_share(global_batch, world_size, expected):
    assert per_rank_batch_size(global_batch, world_size) == expected
    assert per_rank_batch_size(global_batch, world_size) * world_size == global_batch


def test_a_global_batch_the_ranks_do_not_divide_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"train\.batch_size 50 .* 8 ranks"):
        per_rank_batch_size(50, 8)


def test_nonpositive_numbers_are_refused():
    with pytest.raises(ValueError):
        per_rank_batch_size(0, 1)
    with pytest.raises(ValueError):
        per_rank_batch_size(64, 0)


def test_the_error_names_the_param_it_splits():
    """pretrain's `pretrain.batch_size` is global too (stages/pretrain.py): its error names that param."""
    with pytest.raises(ValueError, match=r"pretrain\.batch_size 30 .* 4 ranks"):
        per_rank_batch_size(30, 4, "pretrain.batch_size")

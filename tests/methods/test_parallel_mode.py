"""parallel_mode semantics (pure functions; the live mesh is checked in test_multirank.py)."""
import pytest

from atorch.distributed.mesh import group_ranks, normalize_parallel_config
from atorch.errors import ParallelModeError

SEED_EXAMPLE = ([("tensor", 4), ("pipeline", 2), ("data", 2)], None)


def test_seed_sixteen_rank_example_groups():
    groups = group_ranks(normalize_parallel_config(SEED_EXAMPLE, 16))
    assert groups["tensor"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert groups["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert groups["data"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]


@pytest.mark.parametrize("config, world, expected", [
    (None, 16, (("data", 16),)),
    (([("data", 8)], None), 16, (("data", 16),)),
    (([("tensor", 2), ("pipeline", 2), ("data", 2)], None), 16, (("tensor", 2), ("pipeline", 2), ("data", 4))),
    (([("tensor", 2)], None), 8, (("tensor", 2), ("data", 4))),
    (([("tensor", 2), ("data", 2)], None), 2, (("tensor", 2), ("data", 1))),
])
def test_data_size_is_adjusted(config, world, expected):
    assert normalize_parallel_config(config, world).dims == expected


def test_rank_order_is_laid_onto_the_grid():
    order = [3, 2, 1, 0]
    groups = group_ranks(normalize_parallel_config(([("tensor", 2), ("data", 2)], order), 4))
    assert groups["tensor"] == [[1, 0], [3, 2]]
    assert groups["data"] == [[2, 0], [3, 1]]  # grid [[3, 2], [1, 0]]: data runs down the columns


@pytest.mark.parametrize("config, world, match", [
    (([("tensor", 3)], None), 4, "does not divide the world size 4"),
    (([("tensor", 4), ("pipeline", 2)], None), 4, "product 8"),
    (([("expert", 2)], None), 4, "unknown dimension 'expert'"),
    (([("tensor", 0)], None), 4, "positive int"),
    (([("tensor", 2), ("tensor", 2)], None), 4, "given twice"),
    (([("data", 4)], [0, 1, 2, 2]), 4, "permutation"),
    ("data", 4, "config must be"),
])
def test_bad_parallel_mode(config, world, match):
    with pytest.raises(ParallelModeError, match=match):
        normalize_parallel_config(config, world)

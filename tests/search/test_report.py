"""The search report's last line: Spearman's rank correlation between the predicted and the measured
step times of the candidates that were dry-run (single process; the search itself is test_search.py)."""
from __future__ import annotations

import pytest

from atorch.auto.search.report import Row, format_table, rank_correlation

MIB = 2**20


def rows(predicted: list[float], measured: list) -> list[Row]:
    return [Row(f"c{i}", 10 * MIB, p, measured_time_s=m, measured_memory=10 * MIB if m else None)
            for i, (p, m) in enumerate(zip(predicted, measured))]


@pytest.mark.parametrize("predicted, measured, expected", [
    ([1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4], 1.0),            # same order
    ([1, 2, 3, 4], [0.4, 0.3, 0.2, 0.1], -1.0),           # reversed
    ([1, 2, 3, 4, 5], [0.2, 0.1, 0.3, 0.5, 0.4], 0.8),   # two swaps: 1 - 6 * 4 / (5 * 24)
    ([1, 1, 2, 3], [0.1, 0.2, 0.3, 0.4], 0.9487),        # a tie in the predictions shares its ranks
])
def test_rank_correlation_is_spearmans(predicted, measured, expected):
    correlation, count = rank_correlation(rows(predicted, measured))
    assert correlation == pytest.approx(expected, abs=1e-4)
    assert count == len(predicted)


def test_only_dry_run_rows_count_and_three_are_needed():
    assert rank_correlation(rows([1, 2, 3, 4], [0.1, None, 0.3, None])) is None
    correlation, count = rank_correlation(rows([1, 2, 3, 4, 9], [0.1, None, 0.3, 0.2, None]))
    assert count == 3 and correlation == pytest.approx(0.5)


def test_the_table_ends_with_the_correlation():
    table = format_table(rows([1, 2, 3], [0.3, 0.2, 0.1]), 100 * MIB)
    assert table.splitlines()[-1] == ("predicted vs measured step time: Spearman rank correlation -1.00 over 3 "
                                      "dry-run candidates")
    assert "no rank correlation" in format_table(rows([1, 2], [0.1, 0.2]), 100 * MIB)


def test_refine_tries_are_left_out_and_the_table_says_so():
    """A refine try's predicted time is its base's (the cost model does not price compute methods): the
    pair would compare a method's measured effect with a tie never predicted, so it does not count."""
    table_rows = rows([1, 2, 3, 2], [0.1, 0.2, 0.3, 0.05])
    table_rows[-1].priced = False
    correlation, count = rank_correlation(table_rows)
    assert count == 3 and correlation == pytest.approx(1.0)
    assert format_table(table_rows, 100 * MIB).splitlines()[-1].endswith(
        "over 3 dry-run candidates (refine tries left out: the cost model does not price their methods)")

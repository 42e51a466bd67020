"""On a GPU, a candidate predicted inside the memory model's default margin (15 %) of the limit is dry-run
once the search's own dry runs show a smaller error on this model (at least 5 %, from at least two dry
runs), and only when it is predicted faster than the best so far; on CPU (the limit holds on the resident
size, above the tracked peak) it is not. A candidate that cannot win by the over-prediction measured so
far is not dry-run. The dry runs are scripted here."""
from __future__ import annotations

from atorch.auto.dryrun import DryRunResult
from atorch.auto.search import strategy_search as search_module
from atorch.auto.search.candidates import Candidate
from atorch.auto.search.measure import HardwareProfile
from atorch.auto.search.options import SearchOptions
from atorch.auto.search.report import Row
from atorch.testing.training import build_gpt

MIB = 2**20
LIMIT = 64 * MIB


def _search(monkeypatch, rows: list[Row], runs: list[DryRunResult], device: str = "NVIDIA H200"
            ) -> search_module.StrategySearch:
    monkeypatch.setattr(search_module, "dry_run_candidate", lambda *a, **k: runs.pop(0))  # none left: IndexError
    search = search_module.StrategySearch(build_gpt(), None, SearchOptions())
    search.candidates = [Candidate() for _ in rows]
    search.rows = rows
    search.hardware = HardwareProfile(device, LIMIT, float("inf"))
    return search


def _measured(label: str, predicted_mib: float, measured_mib: float, seconds: float) -> Row:
    return Row(label, int(predicted_mib * MIB), seconds, "ok", int(measured_mib * MIB), seconds, samples=[seconds])


def _near(label: str, predicted_mib: float, seconds: float) -> Row:
    return Row(label, int(predicted_mib * MIB), seconds, "predicted over limit", reason="within 15% of the limit")


def test_a_candidate_near_the_limit_is_tried_when_the_measured_error_leaves_room(monkeypatch):
    rows = [_measured("slow", 50, 51, 0.2), _measured("slower", 40, 40.4, 0.3),
            _near("fast", 58.7, 0.1),    # 58.7 x 1.05 = 61.6 MiB fits 64
            _near("fastest", 63, 0.05)]  # 63 x 1.05 = 66 MiB does not: never started
    search = _search(monkeypatch, rows, [DryRunResult(True, 0.12, int(57.8 * MIB))])
    assert search.observed_memory_margin() == search_module.LEARNED_MARGIN_FLOOR  # 2 % measured, 5 % kept
    assert search.try_near_limit(0) == 2
    assert rows[2].status == "ok" and rows[2].reason.startswith("dry-run: within the 5% memory error")
    assert rows[3].status == "predicted over limit" and rows[3].reason == "within 15% of the limit"


def test_on_cpu_the_margin_stays(monkeypatch):
    rows = [_measured("slow", 50, 51, 0.2), _measured("slower", 40, 40.4, 0.3), _near("fast", 58.7, 0.1)]
    search = _search(monkeypatch, rows, [], device="cpu")  # no scripted run: trying would raise
    assert search.try_near_limit(0) == 0 and rows[2].status == "predicted over limit"


def test_the_margin_is_the_largest_error_measured(monkeypatch):
    rows = [_measured("a", 50, 54, 0.2), _measured("b", 40, 40, 0.3), _near("fast", 58.7, 0.1)]
    search = _search(monkeypatch, rows, [])  # 8 % measured: 58.7 x 1.08 = 63.4 MiB would fit
    assert abs(search.observed_memory_margin() - 0.08) < 1e-6
    rows[0].measured_memory = 56 * MIB  # 12 %: 65.7 MiB, not tried (no scripted run: trying would raise)
    assert search.try_near_limit(0) == 0 and rows[2].status == "predicted over limit"


def test_nothing_near_the_limit_is_tried_without_evidence_or_gain(monkeypatch):
    one = [_measured("only", 50, 50, 0.2), _near("fast", 58.7, 0.1)]
    assert _search(monkeypatch, one, []).try_near_limit(0) == 0  # one dry run: no evidence yet
    slower = [_measured("a", 50, 50, 0.2), _measured("b", 40, 40, 0.3), _near("slow", 58.7, 0.25)]
    assert _search(monkeypatch, slower, []).try_near_limit(0) == 0  # not predicted faster than the best
    assert slower[2].status == "predicted over limit"


def test_a_candidate_tried_near_the_limit_that_measures_over_it_is_not_chosen(monkeypatch):
    rows = [_measured("a", 50, 51, 0.2), _measured("b", 40, 40, 0.3), _near("fast", 58.7, 0.1)]
    search = _search(monkeypatch, rows, [DryRunResult(True, 0.05, 65 * MIB)])
    assert search.try_near_limit(0) == 0 and rows[2].status == "over memory limit"


def test_a_candidate_near_the_limit_takes_its_place_in_the_order_once_the_error_is_known(monkeypatch):
    """Two dry runs measure the error (2 %); the near-limit candidate, predicted faster than the next
    in the order, is tried third (the top-k) and wins; the last in the order is not tried."""
    rows = [Row(label, int(mib * MIB), seconds) for label, mib, seconds in
            (("a", 50, 0.3), ("b", 40, 0.4), ("c", 30, 0.5))] + [_near("near", 58.7, 0.2)]
    runs = [DryRunResult(True, 0.3, int(51 * MIB)), DryRunResult(True, 0.4, int(40.8 * MIB)),
            DryRunResult(True, 0.15, int(58 * MIB))]
    search = _search(monkeypatch, rows, runs)
    search.options = SearchOptions(topk=3)
    search.order = [0, 1, 2]
    assert search.dry_run_best() == 3 and rows[3].chosen
    assert [r.status for r in rows] == ["ok", "ok", "not tried", "ok"]
    assert rows[2].reason == "below the top-k by prediction" and not runs


def test_a_candidate_that_cannot_win_by_the_measured_error_is_not_dry_run(monkeypatch):
    """The first dry runs over-predicted by up to 1.5 times; a candidate predicted at 0.9 s is still
    0.6 s at that error, three times the best measured 0.2 s: not tried although within the top-k.
    One predicted at 0.34 s (0.227 s at that error, within 15 % of 0.2 s) could still win, and is tried."""
    rows = [Row(label, 10 * MIB, seconds) for label, seconds in (("a", 0.3), ("b", 0.34), ("c", 0.33), ("d", 0.9))]
    runs = [DryRunResult(True, 0.2, 10 * MIB), DryRunResult(True, 0.35, 10 * MIB), DryRunResult(True, 0.3, 10 * MIB)]
    search = _search(monkeypatch, rows, runs)
    search.order = [0, 2, 1, 3]
    assert search.dry_run_best() == 0 and not runs
    assert [r.status for r in rows] == ["ok", "ok", "ok", "not tried"]
    assert rows[3].reason == ("cannot win: predicted 900 ms, over 1.50 (the largest over-prediction measured) "
                              "still 200% slower than the best measured"), rows[3].reason
    assert not search._cannot_win(1, 0)

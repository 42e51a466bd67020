"""The search's refine step adds a compute method only when it changed some module and measures faster
by more than the measured noise (the spread of a dry run's steps and of repeated dry runs); and
module_replace reports what it replaced. The dry runs are scripted here, so the decisions are exact."""
from __future__ import annotations

import pytest
import torch

from atorch.auto.accelerate import auto_accelerate
from atorch.auto.dryrun import DryRunResult
from atorch.auto.search import strategy_search as search_module
from atorch.auto.search.analyser import analyse_model
from atorch.auto.search.candidates import Candidate, SearchSpace
from atorch.auto.search.measure import HardwareProfile, VariantProfile
from atorch.auto.search.options import SearchOptions
from atorch.auto.search.report import Row
from atorch.cost_model import Estimate
from atorch.models import SyntheticTokenDataset, gpt_loss
from atorch.testing.training import build_gpt

REPLACED = {"module_replace": {"replaced": {"repo_attention": {"CausalSelfAttention": 2}}}}
NOTHING = {"module_replace": {"replaced": {}}}


def _run(step_s: float, spread_s: float = 0.002, extras: dict = REPLACED) -> DryRunResult:
    return DryRunResult(True, step_s, 2**20, step_time_spread_s=spread_s, extras=extras)


def _refine(monkeypatch, base_runs: list, refined_runs: list) -> Row:
    """The chosen ddp+fp32 (first measured 100 ms) refined with module_replace alone; returns its row."""
    model = build_gpt()
    runs = {"ddp+fp32": list(base_runs), "ddp+fp32+module_replace": list(refined_runs)}
    monkeypatch.setattr(search_module, "dry_run_candidate", lambda m, f, c, *a: runs[c.label].pop(0))
    monkeypatch.setattr(search_module, "predict_measured", lambda *a, **k: Estimate(2**20, 0.1))
    search = search_module.StrategySearch(model, None, SearchOptions(excluded={"native_dynamo"}))
    search.space = SearchSpace(1, torch.device("cpu"), analyse_model(model), frozenset({"native_dynamo"}))
    search.candidates = [Candidate()]
    search.rows = [Row("ddp+fp32", 2**20, 0.1, "ok", 2**20, 0.100, samples=[0.100], spread_s=0.002, chosen=True)]
    search.variants = {("fp32", False): VariantProfile("fp32", False, 8)}
    search.hardware = HardwareProfile("cpu", 2**30, float("inf"))
    chosen = search.refine(0)
    row = search.rows[1]
    assert row.chosen == (chosen == 1) and search.rows[0].chosen == (chosen == 0)
    return row


def test_a_clear_win_is_added(monkeypatch):
    row = _refine(monkeypatch, [], [_run(0.070)])  # 30 % faster: no close call, far above a 2 ms spread
    assert row.chosen and row.reason == ""


def test_a_win_within_the_noise_is_not_added_nor_measured_again(monkeypatch):
    # 3 % faster, but the refined run's steps spread by 5 ms: no more scripted runs (a re-measurement
    # would fail the test), since measuring again only widens the noise
    row = _refine(monkeypatch, [], [_run(0.097, 0.005)])
    assert not row.chosen and row.samples == [0.097]
    assert row.reason == "not added: 3.0% faster, within the measured noise 5.0%", row.reason


def test_a_win_that_shrinks_into_the_noise_when_measured_again_is_not_added(monkeypatch):
    # 10 % faster at first, beyond a 2 ms spread: the close call is measured twice more, and the
    # medians (100 / 98 ms) leave a 2 % gain, within the spread the repeats measured
    row = _refine(monkeypatch, [_run(0.100), _run(0.101)], [_run(0.090), _run(0.098, 0.004), _run(0.099)])
    assert not row.chosen and row.samples == [0.090, 0.098, 0.099]
    assert row.reason.startswith("not added: 2.0% faster, within the measured noise"), row.reason


def test_a_win_beyond_the_noise_is_added_after_confirmation(monkeypatch):
    row = _refine(monkeypatch, [_run(0.100, 0.001), _run(0.100, 0.001)],
                  [_run(0.090, 0.001), _run(0.091, 0.001), _run(0.090, 0.001)])
    assert row.chosen and row.reason == ""


def test_a_method_slower_in_its_dry_run_is_not_measured_again(monkeypatch):
    # no more scripted runs: a re-measurement would fail the test
    row = _refine(monkeypatch, [], [_run(0.105)])
    assert not row.chosen and row.samples == [0.105]
    assert row.reason == "not added: 5.0% slower in its dry run", row.reason


def test_a_method_that_changed_no_module_is_never_added(monkeypatch):
    row = _refine(monkeypatch, [], [_run(0.050, extras=NOTHING)])  # twice as fast, by noise alone
    assert not row.chosen and row.reason == "not added: changed no module"


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("model, replaced", [(build_gpt(), True), (_MLP(), False)])
def test_module_replace_reports_what_it_replaced(model, replaced):
    if replaced:
        dataset, loss, fmt = SyntheticTokenDataset(8, 16, 64), gpt_loss, "unpack_dict"
    else:
        dataset = torch.utils.data.TensorDataset(torch.randn(8, 8))
        loss, fmt = (lambda batch, out: out.pow(2).mean()), "unpack_sequence"
    status, result, _ = auto_accelerate(model, torch.optim.SGD, dataset, loss, optim_args={"lr": 0.1},
                                        dataloader_args={"batch_size": 4}, model_input_format=fmt,
                                        load_strategy=["module_replace"])
    report = result.args.extras["module_replace"]["replaced"]
    assert bool(report) == replaced, report
    if replaced:
        assert report["repo_attention"] == {"CausalSelfAttention": 2}, report

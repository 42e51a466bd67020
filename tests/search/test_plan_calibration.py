"""The planner's fitted constants come from their calibration rows only.

``atorch/plan/calibration.py`` names, for every constant the analytic model fits, the rows of
``benchmarks/published_runs.json`` it was fitted on. This pins the split: those rows (and only they)
are ``role: calibration`` in the data file and name the constant in ``sets``; at most a third of the
rows are calibration rows; and refitting every constant on its own rows alone (the held-out rows are
not even passed in) gives back the value in the code, so a value tuned on a held-out row fails here."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from atorch.plan import calibration

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("plan_vs_published", ROOT / "benchmarks" / "plan_vs_published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()
DATA, ROWS = BENCH.load()


def test_the_data_file_marks_exactly_the_named_rows_as_calibration():
    named = calibration.calibration_rows()
    by_id = {row["id"]: row for row in ROWS}
    assert len(by_id) == len(ROWS), "row ids are unique"
    for row_id, constant in named.items():
        assert row_id in by_id, f"{constant} names {row_id!r}, which is not in published_runs.json"
        assert by_id[row_id]["role"] == "calibration", f"{constant} is fitted on held-out row {row_id!r}"
        assert by_id[row_id]["sets"] == constant
    stray = [row["id"] for row in ROWS if row["role"] == "calibration" and row["id"] not in named]
    assert not stray, f"calibration rows no constant names: {stray}"
    assert {row["role"] for row in ROWS} == {"calibration", "held-out"}
    assert 3 * len(named) <= len(ROWS), f"{len(named)} calibration rows of {len(ROWS)}: more than a third"


def test_the_data_is_many_rows_from_several_independent_sources():
    sources = {row["source"] for row in ROWS}
    beyond = sources - {"torchtitan-a100", "torchtitan-h100", "atorch"}
    assert len(beyond) >= 4 and sum(row["source"] in beyond for row in ROWS) >= 60
    for key in sources:
        assert DATA["sources"][key]["where"] and DATA["sources"][key]["mfu"], key


def test_refitting_on_the_calibration_rows_alone_gives_the_constants_in_the_code():
    calibration_only = [row for row in ROWS if row["role"] == "calibration"]
    refit = BENCH.fit(calibration_only, DATA["models"])
    for name, fitted in calibration.FITTED.items():
        assert refit[name] == pytest.approx(fitted.value, rel=0.03, abs=1e-6 * (fitted.high - fitted.low)), (
            f"{name}: {fitted.value} in calibration.py, but its calibration rows give {refit[name]:.4g}")


def test_no_constant_sits_at_the_bound_of_its_fit():
    """A constant the fit pushes to the edge of its physical range is standing in for something the
    model does not count (as the per-layer host cost once did); the model should change, not the range."""
    for name, fitted in calibration.FITTED.items():
        span = fitted.high - fitted.low
        assert fitted.low + 0.01 * span < fitted.value < fitted.high - 0.01 * span, (
            f"{name} = {fitted.value} sits at the bound of [{fitted.low}, {fitted.high}]")


def test_workload_facts_are_recorded_per_source_never_per_row():
    """How a source's code differs from the planner's defaults is a fact of the source (its framework),
    keyed by source and naming real Workload fields."""
    from dataclasses import fields

    from atorch.plan.analytic import Workload

    names = {f.name for f in fields(Workload)}
    for source, facts in BENCH.SOURCE_WORKLOAD.items():
        assert source in DATA["sources"], f"{source} is not a source of published_runs.json"
        assert set(facts) <= names, f"{source}: {set(facts) - names} are not Workload fields"


def _held_out(source: str) -> list[dict]:
    return [r for r in BENCH.evaluate(ROWS, DATA["models"], DATA["sources"])
            if r["role"] == "held-out" and r["source"] == source]


# sources none of whose rows set a constant: their rows test a model that never saw them
INDEPENDENT = sorted({row["source"] for row in ROWS}
                     - {row["source"] for row in ROWS if row["role"] == "calibration"})
# Issue 32 (open): where the model misses a source's runs, and why, as far as it is understood. Strict: a
# source that starts meeting its goal fails here until its entry is removed.
KNOWN_MISSES = {
    "throughput": {
        "megatron-bridge": "MAE 15.3 %, 7 of 13 within +-20 %: its performance archive's four MoE rows over "
                           "(Qwen3 30B at 1.26 and 1.39, Qwen3 235B at 1.29, GPT-OSS 120B at 1.25) where the same "
                           "repository's tuned BF16 Qwen3 30B runs on the first row's layout sit at 0.95-1.01 (its "
                           "archive FP8 run published 17 % below the BF16 run without overlap: FP8's cost on small "
                           "grouped expert matmuls is not modelled); its Llama 3 70B pretraining row under (0.77: "
                           "these containers' FP8 runs are faster than the Hopper efficiency fitted on earlier runs); "
                           "its 70B SFT run at TP 8 over (1.32: published 28 % below TP 4, where the planner hides its "
                           "TP collectives behind the recipe's TP overlap) (docs/plan.md)",
    },
    "memory": {
        "megatron-bridge": "its 70B SFT runs at TP 4 (PP 4 and PP 8) at 1.15 and 1.16 of the published max allocated "
                           "(the skill page's GB, 1e9 bytes, as Megatron-Bridge's report_memory prints them; its TP 8 "
                           "run at 0.95, its Qwen3 30B runs at 0.94): the fullest stage's state and 92 in-flight "
                           "blocks of FP8 activations at 14.5 bf16 hidden widths a token, and which part the run "
                           "keeps less of the page does not say (docs/plan.md)",
        "torchtitan-h100": "its 405B 1F1B run at 0.83 of the published reservation with torchtitan's own pipeline "
                           "split (0.87 under the even split, which overcounts its first stage); its published peak "
                           "is 10 GiB above the interleaved run's, which keeps more chunk inputs in flight, and "
                           "what holds that is not known (docs/plan.md); and its 405B run with context "
                           "parallelism 8 at 0.81: its published peak is 7.8 GiB above the same pipeline's at "
                           "context 4, with the same tokens a rank and the same sharding",
    },
    "fits": {
        "llama3": "all three runs, as section 3.3.2 describes them (FSDP keeping the weights gathered after "
                  "forward: zero2; interleaved one-block chunks; no activation checkpointing): 103, 95 and 96 GiB "
                  "predicted, where they ran in 80 GB (see the source's workload note)",
    },
}


def _by_source(goal: str, sources: list[str]) -> list:
    return [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=f"issue 32: {KNOWN_MISSES[goal][s]}"))
            if s in KNOWN_MISSES[goal] else s for s in sources]


@pytest.mark.parametrize("source", _by_source("throughput", [
    s for s in INDEPENDENT if sum(r["source"] == s and r["role"] == "held-out" for r in ROWS) >= 3]))
def test_each_independent_source_meets_the_accuracy_goal(source):
    """Issue 32's goal, per source whose rows set no constant and with three or more rows: mean absolute
    error <= 10 % and >= 90 % within +-20 % of the published tokens/s."""
    errors = [abs(r["ratio"] - 1) for r in _held_out(source)]
    assert len(errors) >= 3
    assert sum(errors) / len(errors) <= 0.10, f"{source}: MAE {sum(errors) / len(errors):.1%}"
    assert sum(e <= 0.20 for e in errors) >= 0.90 * len(errors), source


@pytest.mark.parametrize("source", _by_source("memory", sorted({r["source"] for r in ROWS if r["memory_gib"]})))
def test_memory_is_within_15_percent_wherever_published(source):
    results = [r for r in _held_out(source) if r["mem_ratio"]]
    off = {r["id"]: round(r["mem_ratio"], 2) for r in results if abs(r["mem_ratio"] - 1) > 0.15}
    assert not off, off


@pytest.mark.parametrize("source", _by_source("fits", sorted({r["source"] for r in ROWS})))
def test_every_configuration_that_ran_is_predicted_to_fit(source):
    misses = [r["id"] for r in _held_out(source) if not r["pred"].fits]
    assert not misses, misses


def test_a_row_that_runs_non_default_optimizer_states_says_where_that_comes_from():
    """optimizer_states is a row's configuration, like its precision: a valid choice, and where it is not
    the fp32 default, the row's source records the file it was read from."""
    from atorch.plan.analytic import OPTIMIZER_STATES

    for row in ROWS:
        assert row["optimizer_states"] in OPTIMIZER_STATES, row["id"]
        if row["optimizer_states"] != "fp32":
            assert "optimizer_states" in DATA["sources"][row["source"]], row["id"]
            assert "optimizer states" in row["note"], row["id"]


def test_explain_shows_where_a_rows_predicted_step_goes():
    """``--explain``: the parts of one row's step, ending with the step the benchmark compares."""
    row = next(r for r in ROWS if r["id"] == "mbridge llama3-70b pretrain 64gpu tp4pp8vp5 26.04.01")
    text = BENCH.explain(row, DATA["models"])
    step = BENCH.predict_row(row, DATA["models"]).step_time_s
    step_line = next(line for line in text.splitlines() if line.strip().startswith("step "))
    assert step_line.split()[-2] == f"{step:.3f}"
    assert "slowest stage's excess" in text and "weight matmuls" in text
    peak = BENCH.predict_row(row, DATA["models"]).memory_bytes / 2**30
    assert text.splitlines()[-1].split()[-2] == f"{peak:.1f}" and "gradient buffer" in text



def test_plot_draws_every_row_against_its_published_figures(tmp_path):
    """``--plot``: predicted against published, throughput for every row and memory where published; a
    PNG where matplotlib is installed (``.[plot]``), else None and no file (the tables print either way)."""
    rows = [r for r in ROWS if r["source"] in ("atorch", "torchtitan-h100")]
    results = BENCH.evaluate(rows, DATA["models"], DATA["sources"])
    path = tmp_path / "published.png"
    drawn = BENCH.plot_results(results, path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert drawn is None and not path.exists()
        return
    assert drawn == path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_moe_note_states_what_the_published_moe_runs_measured():
    """Every MoE prediction warns that published MoE runs ran below the planner's throughput; the range it
    states is the held-out MoE rows' published / predicted tokens/s, so it cannot go stale silently."""
    from atorch.plan.analytic import MOE_PUBLISHED_SHARE

    results = BENCH.evaluate(ROWS, DATA["models"], DATA["sources"])
    moe = [r for r in results if BENCH.row_spec(r, DATA["models"]).experts]
    assert len(moe) >= 3 and all(r["role"] == "held-out" for r in moe)
    shares = [1 / r["ratio"] for r in moe]
    low, high = MOE_PUBLISHED_SHARE
    assert low == pytest.approx(min(shares), abs=0.005) and high == pytest.approx(max(shares), abs=0.005)
    assert all(any(note.startswith("MoE:") for note in r["pred"].notes) for r in moe)
    dense = [r for r in results if not BENCH.row_spec(r, DATA["models"]).experts]
    assert not any(note.startswith("MoE:") for r in dense for note in r["pred"].notes)


def test_the_thin_calibration_note_states_what_the_held_out_runs_on_its_device_measured():
    """A device family fitted on a single run warns with the share of the prediction its held-out runs
    reached; the shares it states are the held-out rows' published / predicted tokens/s on that family."""
    from atorch.plan.analytic import THIN_FAMILY_PUBLISHED_SHARE
    from atorch.plan.hardware_specs import DEVICES

    single = {name.removesuffix(" efficiency") for name, fitted in calibration.FITTED.items()
              if name.endswith(" efficiency") and len(fitted.rows) == 1
              and any(d.family == name.removesuffix(" efficiency") for d in DEVICES.values())}
    results = BENCH.evaluate(ROWS, DATA["models"], DATA["sources"])
    for family in single - {"hopper 500W"}:  # the 500 W H100: 23 held-out rows, its goal tested above
        shares = [1 / r["ratio"] for r in results
                  if r["role"] == "held-out" and DEVICES[r["device"]].family == family]
        assert shares, family
        low, high = THIN_FAMILY_PUBLISHED_SHARE[family]
        assert low == pytest.approx(min(shares), abs=0.005) and high == pytest.approx(max(shares), abs=0.005)


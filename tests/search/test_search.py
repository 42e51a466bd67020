"""Fully automatic mode on 2 gloo ranks: the search returns a strategy every rank agrees on, honours
excluded / included / finetune_strategy and a memory limit, survives a candidate that fails on one
rank only, and its memory model predicts every dry-run candidate's measured per-rank peak within 15%.
bf16 is excluded in most cases only to keep the suite fast (bf16 matmuls are emulated on CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from atorch.auto.accelerate import auto_accelerate
from atorch.distributed.mesh import ParallelModeConfig, parse_parallel_config
from atorch.models import GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.hf_models import SmallResNet
from atorch.testing.training import build_gpt

# solo: its assertions read this machine's timings / memory or wait on timeouts, so it runs alone (make test)
pytestmark = [pytest.mark.multirank, pytest.mark.solo]

CONFIG = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
MEMORY_TOLERANCE = 0.15


def _search(report_dir: str, **kargs):
    dataset = SyntheticTokenDataset(64, CONFIG.block_size, CONFIG.vocab_size)
    status, result, strategy = auto_accelerate(
        build_gpt(0, CONFIG), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_dir=report_dir,
        use_profile_cache=False, **kargs,
    )
    found = result.args.extras["search"] if status else None
    rows = [dict(vars(r), memory_error=r.memory_error) for r in found.rows] if found else []
    pieces = [(p.setting, p.label, p.error, p.step_time_s, p.peak_bytes) for p in found.pieces] if found else []
    return {"status": status, "strategy": strategy, "rows": rows, "table": found.table if found else "",
            "limit": found.hardware.memory_limit if found else None, "pieces": pieces}


def _explode_zero2_on_rank_1():
    from atorch.auto.opt_lib.zero import Zero2Optimization

    original = Zero2Optimization.transform

    def transform(self, ctx, config):
        if dist.get_rank() == 1:
            raise RuntimeError("zero2 made to fail on rank 1")
        return original(self, ctx, config)

    Zero2Optimization.transform = transform
    return original


def launch(report_dir: str) -> dict:
    out = {}
    out["time_limited"] = _search(f"{report_dir}/time", time_limit=30, excluded=["amp_native"])
    out["excluded"] = _search(f"{report_dir}/excluded", excluded=["amp_native", "fsdp", "zero2", "checkpoint"])
    out["included"] = _search(f"{report_dir}/included", included=["fsdp"], excluded=["amp_native"])
    original = _explode_zero2_on_rank_1()
    try:
        out["one_rank_fails"] = _search(f"{report_dir}/fails", excluded=["amp_native"], search_exhaustive=True)
    finally:
        from atorch.auto.opt_lib.zero import Zero2Optimization

        Zero2Optimization.transform = original
    ddp_peak = next(r["measured_memory"] for r in out["one_rank_fails"]["rows"] if r["label"] == "ddp+fp32")
    fsdp_peak = next(r["measured_memory"] for r in out["one_rank_fails"]["rows"] if r["label"] == "fsdp+fp32+ckpt")
    limit = int((ddp_peak + fsdp_peak) / 2)
    out["memory_limited"] = _search(f"{report_dir}/memory", memory_limit=limit, excluded=["amp_native"])
    out["memory_limited"]["asked_limit"] = limit
    out["memory_limited"]["ddp_peak"] = ddp_peak
    out["tensor_layout"] = _search(f"{report_dir}/tensor", included=["tensor_parallel"], excluded=["amp_native"])
    out["finetune"] = _search(f"{report_dir}/finetune",
                              load_strategy=[("amp_native", {"dtype": torch.bfloat16}), "zero1"],
                              finetune_strategy=True)
    return out


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    return run_distributed(launch, 2, str(tmp_path_factory.mktemp("search")), timeout_s=900)


def _names(strategy) -> list[str]:
    return strategy.names()


def test_every_rank_ends_with_the_same_strategy(searched):
    for case in searched[0]:
        assert searched[0][case]["status"], f"{case}: {searched[0][case]['table']}"
        assert searched[0][case]["strategy"] == searched[1][case]["strategy"], case
        assert any(r["chosen"] for r in searched[0][case]["rows"]), case


def test_each_setting_is_measured_alone_on_one_rank_and_every_rank_has_its_record(searched):
    """The settings are spread over the ranks (``_measure_settings``): every rank holds the same record of
    what was measured, to the same step times and peaks (one measurement each, exchanged; two ranks timing the
    same piece would differ), and no piece was measured twice but for the retry of a negative block time."""
    for case in searched[0]:
        pieces = searched[0][case]["pieces"]
        assert pieces == searched[1][case]["pieces"], case
        alone = [(setting, label) for setting, label, *_ in pieces if not _split_piece(setting)]
        assert alone, case
        for entry in set(alone):
            assert alone.count(entry) <= 2, (case, entry, alone)
    # the exhaustive search measures fp32 with and without checkpointing: one setting on each rank
    exhaustive = {setting for setting, *_ in searched[0]["one_rank_fails"]["pieces"] if not _split_piece(setting)}
    assert exhaustive == {"fp32", "checkpoint"}, exhaustive


def _split_piece(setting: str) -> bool:
    """Whether a piece's record is a tensor split's or a sharding's dry run on the real groups, not an alone run."""
    last = setting.split("+")[-1]
    return last in ("fsdp", "zero2") or (last.startswith("tp") and last[2:].isdigit())


def test_excluded_and_included_are_honoured(searched):
    rank0 = searched[0]
    for row in rank0["excluded"]["rows"]:
        assert not {"fsdp", "zero2", "ckpt", "amp_bf16"} & set(row["label"].split("+")), row["label"]
    assert not {"fsdp", "zero2", "checkpoint", "amp_native"} & set(_names(rank0["excluded"]["strategy"]))
    assert all(r["label"].startswith("fsdp+") for r in rank0["included"]["rows"]), [
        r["label"] for r in rank0["included"]["rows"]]
    assert "fsdp" in _names(rank0["included"]["strategy"])


def test_a_candidate_failing_on_one_rank_is_marked_failed_everywhere(searched):
    for rank, per_rank in enumerate(searched):
        rows = {r["label"]: r for r in per_rank["one_rank_fails"]["rows"]}
        for label in ("zero2+fp32", "zero2+fp32+ckpt"):
            assert rows[label]["status"] == "failed", (rank, rows[label])
        # every rank reports the failing rank's own reason, not a bare "failed on another rank"
        assert rows["zero2+fp32"]["reason"] == "RuntimeError: zero2 made to fail on rank 1 (rank 1)", rows["zero2+fp32"]
        assert sum(r["status"] == "ok" for r in rows.values()) >= 6


def test_memory_limit_that_ddp_exceeds_is_respected(searched):
    case = searched[0]["memory_limited"]
    assert case["limit"] == case["asked_limit"] < case["ddp_peak"]
    chosen = next(r for r in case["rows"] if r["chosen"])
    assert chosen["measured_memory"] <= case["limit"], case["table"]
    ddp = next(r for r in case["rows"] if r["label"] == "ddp+fp32")
    assert ddp["status"] in ("predicted over limit", "over memory limit"), case["table"]


def test_finetune_keeps_the_loaded_methods(searched):
    case = searched[0]["finetune"]
    assert {"amp_native", "zero1"} <= set(_names(case["strategy"])), case["table"]
    assert all("zero1" in r["label"] and "amp_bf16" in r["label"] for r in case["rows"]), case["table"]


def test_memory_model_predicts_every_dry_run_within_tolerance(searched):
    checked = 0
    for case, result in searched[0].items():
        for row in result["rows"]:
            if row["measured_memory"]:
                checked += 1
                assert abs(row["memory_error"]) < MEMORY_TOLERANCE, f"{case}: {row['label']}\n{result['table']}"
    assert checked >= 15


def test_search_in_one_process(tmp_path):
    got = _search(str(tmp_path), excluded=["amp_native"], time_limit=60)
    assert got["status"] and (tmp_path / "search_report.txt").exists() and (tmp_path / "search_report.csv").exists()
    assert {r["label"] for r in got["rows"]} >= {"ddp+fp32", "ddp+fp32+ckpt"}


def test_a_time_limit_spent_before_any_dry_run_still_dry_runs_the_best_predicted(tmp_path):
    """A limit the analysis alone spends (a millisecond) returned (False, None, None) with every candidate
    'skipped: time limit': the first candidate by prediction is now dry-run regardless, and the search
    returns what trained (every later one would be skipped: in one process the others do not fit unsplit)."""
    got = _search(str(tmp_path), excluded=["amp_native"], time_limit=1e-3)
    assert got["status"] and got["strategy"] is not None, got["table"]
    statuses = [r["status"] for r in got["rows"]]
    assert statuses.count("ok") == 1, got["table"]


def test_search_input_errors():
    from atorch.errors import InputError, UnknownMethodError

    with pytest.raises(UnknownMethodError, match="fsdp"):
        auto_accelerate(build_gpt(), torch.optim.SGD, SyntheticTokenDataset(8, 16, 64), gpt_loss,
                        optim_args={"lr": 0.1}, included=["fdsp"])
    with pytest.raises(InputError, match="memory_limit"):
        auto_accelerate(build_gpt(), torch.optim.SGD, SyntheticTokenDataset(8, 16, 64), gpt_loss,
                        optim_args={"lr": 0.1}, model_input_format="unpack_dict", memory_limit="lots")
    with pytest.raises(InputError, match="dryrun_steps=0 .*positive int"):  # semi-automatic mode checks it too
        auto_accelerate(build_gpt(), torch.optim.SGD, SyntheticTokenDataset(8, 16, 64), gpt_loss,
                        optim_args={"lr": 0.1}, model_input_format="unpack_dict", load_strategy=["amp_native"],
                        ignore_dryrun_on_load_strategy=False, dryrun_steps=0)


@pytest.mark.parametrize("kargs, message", [
    ({"search_topk": "four"}, r"search_topk='four' is not valid: give a positive int"),
    ({"search_topk": 0}, r"search_topk=0 is not valid"),
    ({"dryrun_steps": 2.5}, r"dryrun_steps=2.5 is not valid: give a positive int"),
    ({"time_limit": -5}, r"time_limit=-5 is not valid: give seconds as a positive number"),
    ({"time_limit": "60"}, r"time_limit='60' is not valid"),
    ({"memory_limit": "-1GiB"}, r"memory_limit='-1GiB' is not valid: it must be above 0 bytes"),
    ({"memory_limit": "6 gigs"}, r"memory_limit='6 gigs' has an unknown unit 'gigs'.*GiB"),
    ({"memory_limit": 0}, r"memory_limit=0 is not valid"),
    ({"report_dir": 3}, r"report_dir=3 is not valid: give a directory path"),
    ({"search_exhaustive": "yes"}, r"search_exhaustive='yes' is not valid: give True or False"),
])
def test_search_options_refuse_bad_values_naming_the_argument(kargs, message):
    from atorch.auto.search.options import SearchOptions
    from atorch.errors import InputError

    with pytest.raises(InputError, match=message):
        SearchOptions.from_kargs(kargs)


def test_search_options_defaults_and_accepted_forms():
    """The defaults live in SearchOptions alone; dry runs default to the same steps in both modes."""
    from atorch.auto.dryrun import DEFAULT_DRYRUN_STEPS
    from atorch.auto.search.options import SearchOptions
    from atorch.errors import InputError

    defaults = SearchOptions.from_kargs({})
    assert defaults == SearchOptions() and defaults.report_dir is None
    assert ((defaults.topk, defaults.dryrun_steps, defaults.use_cache, defaults.refine)
            == (4, DEFAULT_DRYRUN_STEPS, True, True))
    for value, expected in [("6GiB", 6 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 gib", 3 * 2**29),
                            (123456, 123456)]:
        assert SearchOptions.from_kargs({"memory_limit": value}).memory_limit == expected, value
    options = SearchOptions.from_kargs({"time_limit": 30, "find_unused_parameters": True}, ["fsdp"],
                                       ["zero1", ("checkpoint", ("GPTBlock",))])
    assert options.time_limit == 30.0 and options.excluded == {"fsdp"}
    assert options.included.names() == ["zero1", "checkpoint"] and options.included.get("checkpoint") == ("GPTBlock",)
    with pytest.raises(InputError, match="both included and excluded"):
        SearchOptions.from_kargs({}, ["zero1"], ["zero1"])


def test_report_files_are_written_only_under_report_dir(tmp_path, monkeypatch):
    from atorch.auto.search.candidates import Candidate
    from atorch.auto.search.measure import HardwareProfile
    from atorch.auto.search.options import SearchOptions
    from atorch.auto.search.report import Row
    from atorch.auto.search.strategy_search import StrategySearch

    monkeypatch.chdir(tmp_path)
    search = StrategySearch(build_gpt(), None, SearchOptions())
    search.candidates = [Candidate()]
    search.rows = [Row("ddp+fp32", 2**20, 0.01, "ok", 2**20, 0.011, chosen=True)]
    search.hardware = HardwareProfile("cpu", 2**30, float("inf"))
    found = search.report(0)
    assert "ddp+fp32" in found.table and found.report_files == [] and not list(tmp_path.iterdir())
    assert found.strategy.names() == [] and found.candidate == Candidate()
    search.options = SearchOptions(report_dir=str(tmp_path / "report"))
    files = search.report(0).report_files
    assert {f.name for f in files} >= {"search_report.txt", "search_report.csv"}
    assert all(f.parent == tmp_path / "report" for f in files)


def test_included_layout_method_searches_only_that_layout(searched):
    case = searched[0]["tensor_layout"]
    assert case["rows"] and all(r["label"].endswith("+tp2") for r in case["rows"]), case["table"]
    assert "tensor_parallel" in _names(case["strategy"]), case["table"]
    mode = parse_parallel_config(case["strategy"].get("parallel_mode"))
    assert mode.size("tensor") == 2, mode


def test_layout_candidates_follow_the_model_and_the_rules():
    """Without ranks: which tensor / pipeline layouts the search proposes on 4 ranks, and why not the others."""
    from atorch.auto.search.analyser import analyse_model
    from atorch.auto.search.candidates import SearchSpace, enumerate_candidates
    from atorch.auto.search.layouts import layout_facts

    model = build_gpt(0, GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))
    profile = analyse_model(model)
    profile.layouts = layout_facts(model, 4)
    assert "heads" in profile.layouts.unsupported["tp4"] and "tp2" not in profile.layouts.unsupported
    space = SearchSpace(4, torch.device("cpu"), profile, frozenset({"amp_native"}), per_rank_batch=2)
    candidates, skipped = enumerate_candidates(space)
    layouts = {(c.tensor, c.pipeline) for c in candidates}
    assert layouts == {(1, 1), (2, 1), (1, 2), (1, 4), (2, 2)}, layouts
    assert all(c.sharding in ("ddp", "zero1") for c in candidates if c.tensor * c.pipeline > 1)
    assert "zero1 needs a data dimension" in skipped["zero1+fp32+tp2+pp2"]
    assert "not searched with tensor / pipeline layouts" in skipped["fsdp+fp32+tp2"]
    mixed = next(c for c in candidates if (c.tensor, c.pipeline) == (2, 2))
    assert parse_parallel_config(mixed.strategy(4)[0].config) == ParallelModeConfig(
        dims=(("tensor", 2), ("pipeline", 2), ("data", 1)))
    assert "mixed_parallel" in mixed.strategy(4)
    # tied input / output embeddings are cut into pipeline stages (each end holds a copy); BatchNorm is not
    tied = build_gpt(0, GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, tie_weights=True))
    facts = layout_facts(tied, 2)
    assert "pp2" not in facts.unsupported and "tp2" not in facts.unsupported
    assert "BatchNorm" in layout_facts(SmallResNet(), 2).unsupported["pp2"]


def test_micro_batched_candidates_are_not_searched_where_the_rows_are_not_first():
    """A data pipeline that stacks rows on another dimension (nn.Transformer's tutorial's (seq, batch)
    batches): applying micro_batch or a pipeline refuses it (row_layout), so the search leaves out every
    candidate that splits the batch into micro-batches, with the reason, and keeps the others."""
    from atorch.auto.model_context import ModelContext
    from atorch.auto.opt_lib.row_layout import rows_elsewhere
    from atorch.auto.search.analyser import analyse_model
    from atorch.auto.search.candidates import SearchSpace, enumerate_candidates
    from atorch.auto.search.layouts import layout_facts
    from atorch.testing.community_models import SequenceFirstLM, sequence_first_collate

    rows = [(torch.arange(16), torch.arange(16)) for _ in range(8)]
    context = ModelContext(SequenceFirstLM(), torch.optim.SGD, rows, lambda batch, output: output.sum(),
                           dataloader_args={"batch_size": 4, "collate_fn": sequence_first_collate},
                           model_input_format="unpack_sequence")
    why = rows_elsewhere(context)
    assert why.startswith("micro-batches take each input's rows") and "on dimension 1" in why, why
    model = build_gpt(0, GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))
    profile = analyse_model(model)
    profile.layouts = layout_facts(model, 2)
    space = SearchSpace(2, torch.device("cpu"), profile, frozenset({"amp_native"}), per_rank_batch=4,
                        rows_elsewhere=why)
    candidates, skipped = enumerate_candidates(space)
    assert candidates and all(c.micro == 1 and c.pipeline == 1 for c in candidates)
    assert any(c.tensor == 2 for c in candidates)  # tensor parallelism splits no batch
    assert skipped["ddp+fp32+pp2"] == why and skipped["fsdp+fp32+mb2"] == why, skipped

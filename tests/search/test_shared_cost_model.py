"""The search and atorch.plan share one cost model (``atorch/cost_model.py``): given the measurements a
search kept (``SearchResult.measured``), ``atorch.plan.plan_measured`` predicts every candidate the
search estimated with exactly the search's memory and step time. Checked from a profile made by hand
(which also pickles), after a real search in one process, and after one on 2 gloo ranks (the profile
pickled back to this process)."""
from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from atorch.auto.accelerate import auto_accelerate
from atorch.auto.search.analyser import analyse_model
from atorch.auto.search.candidates import Candidate, SearchSpace, enumerate_candidates
from atorch.auto.search.layouts import layout_facts
from atorch.auto.search.measure import HardwareProfile, VariantProfile, load_cached, store_cached
from atorch.auto.search.options import SearchOptions
from atorch.auto.search.pieces import extrapolate
from atorch.auto.search.strategy_search import MEASURED_SHARDINGS, RECOMPUTED_FORWARD_SHARE, StrategySearch
from atorch.auto.search.topology import Links, keep_tensor_in_node, topology_for
from atorch.cost_model import (
    MICRO_STEP_OVERHEAD,
    MeasuredProfile,
    estimate_layout_memory,
    fits_with_margin,
    fixed_pass_share,
    micro_step_overhead_s,
    pass_seconds,
    predict_measured,
    topology_estimate,
)
from atorch.errors import InputError
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.plan import plan_measured
from atorch.testing import run_distributed
from atorch.testing.training import build_gpt

CONFIG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
MIB = 2**20
# slow or not needed here: bf16 is emulated on CPU, compilation takes long
EXCLUDED = ["amp_native", "native_dynamo"]


# --- by hand: no model runs ----------------------------------------------------------------------------
def _hand_made_search(world: int = 4, ranks_per_node: int = 2) -> StrategySearch:
    """A StrategySearch whose analysis and measurements are set by hand (two nodes of two ranks, so the
    estimates cross links): its ``estimate()`` step runs as in a real search."""
    model = GPT(CONFIG)
    topology = topology_for(world, ranks_per_node)
    profile = analyse_model(model)
    profile.tokens_per_sample = CONFIG.block_size
    profile.layouts = keep_tensor_in_node(layout_facts(model, world), topology)
    search = StrategySearch(model, None, SearchOptions(excluded=set(EXCLUDED), ranks_per_node=ranks_per_node))
    search.world, search.topology, search.profile, search.per_rank_batch = world, topology, profile, 2
    search.space = SearchSpace(world, torch.device("cpu"), profile, frozenset(EXCLUDED), per_rank_batch=2,
                               ranks_per_node=ranks_per_node)
    search.candidates, _ = enumerate_candidates(search.space)
    search.hardware = HardwareProfile("cpu", 33 * MIB, 2e9, latency_s=1e-4, intra_node_bandwidth=20e9,
                                      inter_node_bandwidth=1e9)
    search.links = Links(search.hardware.intra_node_bandwidth, search.hardware.inter_node_bandwidth)
    search.variants = {
        ("fp32", False): VariantProfile("fp32", False, 2, peak_bytes=30 * MIB, step_time_s=0.05, params=4 * MIB,
                                        grads=4 * MIB, optim_state=8 * MIB, forward_backward_peak_bytes=26 * MIB,
                                        forward_saved_bytes=12 * MIB),
        ("fp32", True): VariantProfile("fp32", True, 2, error="made to fail alone"),
    }
    return search


def test_the_planner_reproduces_the_search_estimates_from_a_hand_made_profile():
    search = _hand_made_search()
    search.estimate()
    measured = search.measured
    assert measured == MeasuredProfile(search.profile, search.hardware, search.variants, 4, search.topology,
                                       search.links, 2, "cpu", frozenset(EXCLUDED))
    rows = dict(zip((c.label for c in search.candidates), search.rows))
    failed = {label for label, row in rows.items() if row.reason.startswith("alone: ")}
    assert failed and len(failed) < len(rows)  # the checkpointed setting failed alone, the rest is estimated
    predictions = plan_measured(measured)  # the search's candidates enumerated again
    assert {p.candidate.label for p in predictions} == set(rows) - failed
    for p in predictions:
        row = rows[p.candidate.label]
        assert (p.memory_bytes, p.step_time_s) == (row.predicted_memory, row.predicted_time_s), p.candidate.label
        assert p.fits == (row.status != "predicted over limit"), p.candidate.label
    assert any(p.fits for p in predictions) and not all(p.fits for p in predictions)
    # the shared function is the per-link composition over the measured alone profile
    hybrid = next(c for c in search.candidates if c.shard and not c.checkpoint)
    assert predict_measured(hybrid, measured) == topology_estimate(
        hybrid, search.variants[("fp32", False)], world=4, profile=search.profile, hardware=search.hardware,
        topology=search.topology, links=search.links)


def test_a_pipeline_stage_is_predicted_at_backwards_start_when_the_optimizer_step_hides_it():
    # state outweighs activations: the alone peak (the optimizer step's) is barely above the state, but a
    # pipeline stage keeps its micro-batches' saved activations beside its gradients
    search = _hand_made_search()
    stage = next(c for c in search.candidates if c.pipeline > 1 and c.tensor == 1 and not c.checkpoint)
    state = 4 * MIB + 4 * MIB + 8 * MIB
    hidden = VariantProfile("fp32", False, 2, peak_bytes=state + MIB, step_time_s=0.05, params=4 * MIB,
                            grads=4 * MIB, optim_state=8 * MIB)
    measured = dataclasses.replace(hidden, forward_backward_peak_bytes=state, forward_saved_bytes=3 * MIB)
    facts = search.profile.layouts
    before = estimate_layout_memory(stage, hidden, 4, facts)
    after = estimate_layout_memory(stage, measured, 4, facts)
    share = facts.state_share[(1, stage.pipeline)]
    assert after > before >= state * share
    # the saved activations of the micro-batches in flight beside the stage's share of the whole state
    assert after >= state * share + 3 * MIB * facts.stage_block_share[stage.pipeline]


def test_each_micro_step_sync_is_searched_under_fsdp_where_the_last_step_split_does_not_fit():
    """micro_batch's grad_sync="each_micro_step" under fsdp (label ``mb2s``): the rank keeps only its shard
    of the gradients between micro-steps (the unsharded fp32 gradients less the shard, 3 of 4 MiB, off the
    prediction), for one more reduce-scatter of them per extra micro-step. Dry-run only where the last-step
    split is predicted over the limit; not enumerated for ddp / zero1 / zero2 or hybrid sharding."""
    search = _hand_made_search()
    labels = {c.label: c for c in search.candidates}
    each, last = labels["fsdp+fp32+mb2s"], labels["fsdp+fp32+mb2"]
    assert dataclasses.replace(last, grad_sync="each_micro_step") == each
    assert ("micro_batch", {"num_micro_batch": 2, "grad_sync": "each_micro_step"}) in [
        (item.name, item.config) for item in each.strategy(4)]
    assert {c.sharding for c in search.candidates if c.grad_sync != "last_micro_step"} == {"fsdp"}
    assert not any(c.shard for c in search.candidates if c.grad_sync != "last_micro_step")
    search.estimate()
    measured = search.measured
    e, la = predict_measured(each, measured), predict_measured(last, measured)
    assert la.memory_bytes - e.memory_bytes == 3 * MIB and e.step_time_s > la.step_time_s
    rows = dict(zip((c.label for c in search.candidates), search.rows))
    assert rows[each.label].reason == "the split fits with gradients synchronised at the last micro-step"
    # a limit between the two: the last-step split is over it (and so is the unsplit batch), each-step fits
    search.hardware = dataclasses.replace(search.hardware, memory_limit=19 * MIB)
    search.rows = []
    search.estimate()
    rows = dict(zip((c.label for c in search.candidates), search.rows))
    assert rows[last.label].status == rows["fsdp+fp32"].status == "predicted over limit"
    assert rows[each.label].status == "not tried" and not rows[each.label].reason
    assert search.candidates.index(each) in search.order
    predicted = {p.candidate.label: p for p in plan_measured(search.measured)}
    assert predicted[each.label].fits and not predicted[last.label].fits


def _wanted(search, setting, kind) -> set:
    """The measurements of ``kind`` (int: a tensor size; str: a sharding) the search wants for ``setting``."""
    return {key for key in search._measurements_that_matter([setting]) if isinstance(key[1], kind)}


def test_only_tensor_splits_that_could_be_dry_run_are_measured():
    """A split is measured only when a candidate using it is among the ``topk`` fastest predicted to fit
    (the formula's optimistic cost for unmeasured splits), one at a time as measurements move them."""
    search = _hand_made_search()
    search.stack = None
    setting = ("fp32", False)
    everything = {(setting, c.tensor) for c in search.candidates
                  if c.tensor > 1 and (c.precision, c.checkpoint) == setting}
    assert everything
    # every fitting candidate is dry-run: every split that fits is wanted
    search.options = dataclasses.replace(search.options, exhaustive=True)
    fitting = _wanted(search, setting, int)
    assert fitting and fitting <= everything
    search.options = dataclasses.replace(search.options, exhaustive=False, topk=1)
    ranked = sorted((c for c in search.candidates if c.precision == "fp32" and not c.checkpoint
                     and fits_with_margin(search._estimate(c).memory_bytes, search.hardware.memory_limit)),
                    key=lambda c: search._estimate(c).step_time_s)
    kept = _wanted(search, setting, int)
    assert kept == ({(setting, ranked[0].tensor)} if ranked[0].tensor > 1 else set())
    search.options = dataclasses.replace(search.options, topk=len(ranked))
    assert _wanted(search, setting, int) == fitting
    # measured, a split costs what it measured: here far more than the formula, so it leaves the top-k,
    # and the next fastest candidate's split (if any) is wanted instead
    tensor = max(fitting, key=lambda key: key[1])[1]
    search.variants[setting].tensor_step_times[tensor] = 10.0
    after = _wanted(search, setting, int)
    assert (setting, tensor) not in after
    assert all(key[1] != tensor for key in after)
    search.hardware = dataclasses.replace(search.hardware, memory_limit=MIB)  # nothing fits: nothing to measure
    assert search._measurements_that_matter([setting]) == {}


def _two_settings_with_recorded_splits():
    """A hand-made search with fp32 measured with and without checkpointing, whose split measurements are
    recorded instead of run (each costing what the pieces would have measured: far over the formula)."""
    search = _hand_made_search()
    search.stack = None
    plain, ckpt = ("fp32", False), ("fp32", True)
    search.variants[ckpt] = dataclasses.replace(search.variants[plain], checkpoint=True, step_time_s=0.07,
                                                tensor_step_times={}, sharded_step_times={})
    measured = []

    def measure(setting, kind):
        measured.append((setting, kind))
        variant = search.variants[setting]
        if isinstance(kind, int):
            variant.tensor_step_times[kind] = 1.0
        else:
            variant.sharded_step_times[kind], variant.sharded_world = variant.step_time_s + 0.5, search.world

    search._measure_split = measure
    return search, plain, ckpt, measured


def test_each_split_beyond_the_top_k_is_measured_once_and_what_it_adds_carried_to_the_other_settings():
    """Where more candidates fit than are dry-run, every tensor size and measured sharding the fitting
    candidates use is measured once (at the setting of its fastest candidate) and what it adds is carried to
    the settings that did not measure it, so the candidates beyond the top-k are priced from a measurement,
    not from the formula's optimistic cost; where every fitting candidate is dry-run, nothing is."""
    search, plain, ckpt, measured = _two_settings_with_recorded_splits()
    search.options = dataclasses.replace(search.options, exhaustive=False, topk=10**6)
    assert not search._carry_split_overheads({plain, ckpt}) and not measured
    search.options = dataclasses.replace(search.options, topk=1)
    search.measured = search._measured()
    fitting = [c for c in search.candidates if search.measured.predictable(c)
               and fits_with_margin(search._estimate(c).memory_bytes, search.hardware.memory_limit)]
    kinds = {search._split_kind(c) for c in fitting} - {None}
    assert {k for k in kinds if isinstance(k, int)} and {k for k in kinds if isinstance(k, str)}
    tp = next(c for c in fitting if c.tensor > 1)
    tp_other = dataclasses.replace(tp, checkpoint=not tp.checkpoint)
    formula = search._estimate(tp_other).step_time_s
    assert search._carry_split_overheads({plain, ckpt})
    assert len(measured) == len(kinds) and {kind for _, kind in measured} == kinds  # each once
    for setting, kind in measured:
        other = search.variants[ckpt if setting == plain else plain]
        carried = (other.tensor_overhead_s if isinstance(kind, int) else other.sharded_overhead_s)[kind]
        assert carried == pytest.approx(search._split_added_s(kind, search.variants[setting])) and carried > 0
        if isinstance(kind, str):  # the unsplit candidate at the other setting: its alone step + the carried excess
            candidate = Candidate(kind, "fp32", other.checkpoint, block="Block")
            assert search._estimate(candidate).step_time_s == pytest.approx(other.step_time_s + 0.5)
    assert search._estimate(tp_other).step_time_s > formula


def test_a_split_the_top_k_uses_at_two_settings_is_measured_at_one_and_carried_to_the_other():
    """Among the candidates that could be dry-run too, each tensor size and measured sharding is measured at
    one setting only: what it added there is carried at once to the settings that have not measured it,
    which then want no measurement of their own."""
    search, plain, ckpt, measured = _two_settings_with_recorded_splits()
    search.options = dataclasses.replace(search.options, exhaustive=False, topk=10**6)
    wanted = search._measurements_that_matter({plain, ckpt})
    kinds = {kind for _, kind in wanted}
    assert {setting for setting, _ in wanted} == {plain, ckpt} and any(isinstance(k, int) for k in kinds)
    search._measure_tensor_splits({plain, ckpt})
    assert measured and {kind for _, kind in measured} <= kinds
    assert len({kind for _, kind in measured}) == len(measured)  # each kind once, at one setting
    for setting, kind in measured:
        other = search.variants[ckpt if setting == plain else plain]
        carried = (other.tensor_overhead_s if isinstance(kind, int) else other.sharded_overhead_s)[kind]
        assert carried == pytest.approx(search._split_added_s(kind, search.variants[setting]))
    assert search._measurements_that_matter({plain, ckpt}) == {}


@pytest.mark.parametrize("sharding", MEASURED_SHARDINGS)
def test_a_sharding_is_measured_when_it_could_be_dry_run_and_then_costs_what_it_measured(sharding):
    """FSDP's and zero2's cost (``MEASURED_SHARDINGS``) is measured over every rank when such a candidate is
    among the fitting ``topk`` and more candidates fit than are dry-run (else its pieces would cost what its
    own dry run does, to no end); once measured, its unsplit candidate costs exactly the measured step, and a
    micro-batched one the measured excess scaled as the formula scales it with micro-steps."""
    search = _hand_made_search()
    search.stack = None
    setting = ("fp32", False)
    unsplit = Candidate(sharding, "fp32", False, block="Block")
    search.measured = search._measured()
    fitting = sorted((c for c in search.candidates if (c.precision, c.checkpoint) == setting and c.micro == 1
                      and fits_with_margin(search._estimate(c).memory_bytes, search.hardware.memory_limit)),
                     key=lambda c: search._estimate(c).step_time_s)
    place = [c.label for c in fitting].index(unsplit.label)
    assert place + 1 < len(fitting)
    # among the top-k while more candidates fit than are dry-run: measured
    search.options = dataclasses.replace(search.options, exhaustive=False, topk=place + 1)
    assert (setting, sharding) in _wanted(search, setting, str)
    # outside the top-k, or every fitting candidate dry-run anyway (exhaustive): not worth its pieces
    search.options = dataclasses.replace(search.options, topk=place)
    assert (setting, sharding) not in _wanted(search, setting, str)
    search.options = dataclasses.replace(search.options, exhaustive=True)
    assert _wanted(search, setting, str) == set()
    search.options = dataclasses.replace(search.options, exhaustive=False, topk=place + 1)
    variant = search.variants[setting]
    split = dataclasses.replace(unsplit, micro=2)
    formula = {c.label: search._estimate(c).step_time_s for c in (unsplit, split)}
    variant.sharded_step_times[sharding], variant.sharded_world = variant.step_time_s + 1.0, search.world
    assert (setting, sharding) not in _wanted(search, setting, str)
    optimizer_owned = variant.step_time_s - (1 - 1 / search.world) * variant.optimizer_step_time_s
    assert search._estimate(unsplit).step_time_s == pytest.approx(variant.step_time_s + 1.0)
    formula_excess = {label: t - optimizer_owned - variant.step_time_s * MICRO_STEP_OVERHEAD * (c.micro - 1)
                      for (label, t), c in zip(formula.items(), (unsplit, split))}
    expected = (optimizer_owned + variant.step_time_s * MICRO_STEP_OVERHEAD
                + (variant.step_time_s + 1.0 - optimizer_owned) * formula_excess[split.label]
                / formula_excess[unsplit.label])
    assert search._estimate(split).step_time_s == pytest.approx(expected)
    # measured over another world size (a cached profile of another run), the formula stands
    variant.sharded_world = search.world * 2
    assert search._estimate(unsplit).step_time_s == pytest.approx(formula[unsplit.label])


def test_a_profile_cached_before_a_field_was_measured_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    variant = VariantProfile("fp32", False, 2, peak_bytes=30 * MIB, step_time_s=0.05)
    store_cached("key", variant)
    assert load_cached("key") == variant
    path = next(tmp_path.rglob("key.json"))
    old = json.loads(path.read_text())
    del old["forward_saved_bytes"]
    path.write_text(json.dumps(old))
    assert load_cached("key") is None


def test_a_measured_profile_pickles_and_predicts_the_same_after():
    search = _hand_made_search()
    search.estimate()
    copy = pickle.loads(pickle.dumps(search.measured))
    assert copy == search.measured
    before, after = plan_measured(search.measured), plan_measured(copy)
    assert [(p.candidate, p.memory_bytes, p.step_time_s) for p in before] == [
        (p.candidate, p.memory_bytes, p.step_time_s) for p in after]


def test_plan_measured_refuses_what_was_not_measured_and_honours_excluded():
    search = _hand_made_search()
    search.estimate()
    with pytest.raises(InputError, match="failed alone: made to fail alone"):
        plan_measured(search.measured, [Candidate("ddp", "fp32", True, block="GPTBlock")])
    with pytest.raises(InputError, match="measured no rank alone"):
        plan_measured(search.measured, [Candidate("ddp", "amp_bf16")])
    kept = [p.candidate for p in plan_measured(search.measured, excluded=["fsdp", "tensor_parallel"])]
    assert kept and not any(c.sharding == "fsdp" or c.layout_method == "tensor_parallel" for c in kept)
    assert [p.candidate for p in plan_measured(search.measured, [Candidate("fsdp", block="GPTBlock")], ["fsdp"])] == []


# --- after a real search -------------------------------------------------------------------------------
def _search(**kargs) -> dict:
    """A fully automatic search of the tiny GPT; what it estimated and measured, as plain values."""
    dataset = SyntheticTokenDataset(32, CONFIG.block_size, CONFIG.vocab_size)
    status, result, _ = auto_accelerate(
        build_gpt(0, CONFIG), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": 4}, model_input_format="unpack_dict", use_profile_cache=False,
        excluded=EXCLUDED, **kargs)
    found = result.args.extras["search"]
    return {"status": status, "measured": found.measured, "candidates": found.candidates, "rows": found.rows,
            "table": found.table}


def _assert_the_planner_agrees(found: dict) -> None:
    """Every candidate the search estimated (every row but those whose setting failed alone or was not
    measured, the refinements included) gets the search's predicted memory and step time from
    ``plan_measured``; and enumerating again gives the search's own candidates."""
    assert found["status"], found["table"]
    estimated = [(c, r) for c, r in zip(found["candidates"], found["rows"], strict=True)
                 if not r.reason.startswith(("alone: ", "not measured: "))]
    assert estimated, found["table"]
    predicted = {p.candidate.label: p for p in plan_measured(found["measured"], [c for c, _ in estimated])}
    for candidate, row in estimated:
        p = predicted[candidate.label]
        assert p.memory_bytes == row.predicted_memory, (candidate.label, found["table"])
        assert p.step_time_s == pytest.approx(row.predicted_time_s, rel=1e-9, abs=0), candidate.label
    enumerated = {p.candidate.label for p in plan_measured(found["measured"])}
    rows = {c.label for c, _ in estimated}
    assert enumerated <= rows, enumerated - rows
    assert all(c.compute for c, _ in estimated if c.label not in enumerated), "only refinements are not enumerated"


def test_the_planner_reproduces_a_search_in_one_process():
    found = _search(time_limit=60)
    assert found["measured"].world == 1
    _assert_the_planner_agrees(found)
    variant = found["measured"].variants[("fp32", False)]  # the alone step's optimizer update, measured apart
    assert 0 < variant.optimizer_step_time_s < variant.step_time_s, variant


def _search_on_ranks() -> dict:
    return _search(time_limit=90, search_topk=1)


@pytest.mark.multirank
def test_the_planner_reproduces_a_search_on_two_ranks():
    results = run_distributed(_search_on_ranks, 2, timeout_s=600)
    for found in results:  # each rank's, pickled back to this process
        assert found["measured"].world == 2 and found["measured"].variants == results[0]["measured"].variants
        _assert_the_planner_agrees(found)


def test_checkpointing_is_measured_only_where_a_candidate_without_it_does_not_fit():
    """Checkpointing only adds recompute: a checkpointed candidate whose twin without it is predicted to fit
    can never be the fastest that fits, so its setting is not measured (a row saying why, nothing for
    plan_measured to predict from); under a limit some twin does not fit, and it is measured."""
    search = _hand_made_search()
    del search.variants[("fp32", True)]
    search.hardware = dataclasses.replace(search.hardware, memory_limit=2**30)
    assert search._checkpointing_dominated(("fp32", True))
    search.estimate()
    rows = dict(zip((c.label for c in search.candidates), search.rows))
    checkpointed = [c.label for c in search.candidates if c.checkpoint]
    assert checkpointed and all(rows[label].reason.startswith("not measured: checkpointing only adds recompute")
                                for label in checkpointed)
    assert not {search.candidates[i].label for i in search.order} & set(checkpointed)
    assert {p.candidate.label for p in plan_measured(search.measured)} == set(rows) - set(checkpointed)
    tight = _hand_made_search()  # 33 MiB: some candidates without checkpointing are predicted over it
    del tight.variants[("fp32", True)]
    assert not tight._checkpointing_dominated(("fp32", True)) and not tight.dominated
    search.options = dataclasses.replace(search.options, exhaustive=True)  # every candidate, as asked
    assert not search._checkpointing_dominated(("fp32", True))


def test_a_checkpointed_setting_is_never_predicted_faster_than_the_same_without():
    """Pieces measured a checkpointed setting faster than its twin (noise in a difference of two pieces'
    times): the search lifts it to the twin's plus the forward it runs again (a share of the blocks' time
    the twin's pieces measured), and every tensor split to the twin's, so a checkpointed candidate never
    ranks ahead of, or level with, the same one without checkpointing."""
    search = _hand_made_search()
    plain = dataclasses.replace(search.variants[("fp32", False)], step_time_s=0.05, blocks_step_time_s=0.04,
                                tensor_step_times={2: 0.06})
    search.variants = {("fp32", False): plain,
                       ("fp32", True): dataclasses.replace(plain, checkpoint=True, step_time_s=0.04,
                                                           peak_bytes=20 * MIB, tensor_step_times={2: 0.03})}
    search._bound_checkpointed_times()
    lifted = search.variants[("fp32", True)]
    assert lifted.step_time_s == pytest.approx(0.05 + RECOMPUTED_FORWARD_SHARE * 0.04)
    assert (lifted.tensor_step_times, lifted.peak_bytes) == ({2: 0.06}, 20 * MIB)
    slower = dataclasses.replace(plain, checkpoint=True, step_time_s=0.07)  # measured above the floor: kept
    search.variants[("fp32", True)] = slower
    search._bound_checkpointed_times()
    assert search.variants[("fp32", True)].step_time_s == 0.07
    search.variants[("fp32", True)] = dataclasses.replace(plain, checkpoint=True, step_time_s=0.04)
    search._bound_checkpointed_times()
    search.estimate()
    by_label = {c.label: r for c, r in zip(search.candidates, search.rows)}
    for candidate in search.candidates:
        if candidate.checkpoint:
            twin = by_label[dataclasses.replace(candidate, checkpoint=False).label]
            assert by_label[candidate.label].predicted_time_s >= twin.predicted_time_s, candidate.label


def test_pieces_extrapolate_the_whole_step_and_keep_the_blocks_part():
    """Two pieces one block apart give the whole model's step (the rest once, the block times the count)
    and the blocks' part of it, which the checkpointed setting's floor is a share of."""
    low = VariantProfile("fp32", False, 2, peak_bytes=10 * MIB, step_time_s=0.010)
    high = VariantProfile("fp32", False, 2, peak_bytes=12 * MIB, step_time_s=0.012)
    whole = extrapolate(low, high, 0, 12)
    assert whole.step_time_s == pytest.approx(0.010 + 12 * 0.002)
    assert whole.blocks_step_time_s == pytest.approx(12 * 0.002)
    assert whole.peak_bytes == 10 * MIB + 12 * 2 * MIB
    noisy = extrapolate(high, low, 1, 12)  # the larger piece measured faster: a block is never negative time
    assert (noisy.step_time_s, noisy.blocks_step_time_s) == (0.012, 0.0)


def test_a_rank_pays_only_the_optimizer_update_it_owns():
    """The alone step's optimizer update (measured apart) is what a sharded optimizer state takes off a
    rank: zero1 / zero2 / fsdp step 1/N of it, ddp all of it; a pipeline or tensor layout's rank steps its
    share of the parameters once a step, not scaled by the batch or the bubble (zero1 on the data
    dimension divides it again). Everything else about the two profiles is equal."""
    search = _hand_made_search(world=4, ranks_per_node=4)
    plain = search.variants[("fp32", False)]
    with_update = dataclasses.replace(plain, optimizer_step_time_s=0.02)
    measured = MeasuredProfile(search.profile, search.hardware, {("fp32", False): plain}, 4, search.topology)
    split = MeasuredProfile(search.profile, search.hardware, {("fp32", False): with_update}, 4, search.topology)
    facts = search.profile.layouts
    for candidate in search.candidates:
        if candidate.checkpoint or candidate.precision != "fp32" or candidate.shard:
            continue
        saved = predict_measured(candidate, measured).step_time_s - predict_measured(candidate, split).step_time_s
        data = candidate.data_size(4)
        owned = 1 / data if candidate.sharding != "ddp" and data > 1 else 1.0
        if candidate.tensor * candidate.pipeline == 1:
            want = 0.02 * (1 - owned)
        else:
            t, p = candidate.tensor, candidate.pipeline
            share = facts.state_share[(t, p)]
            bubble = 1.0
            if p > 1:
                micro = min(2 * p, 2 * t * p)
                bubble = (micro + p - 1) / micro
            want = 0.02 * t * p * share * bubble - 0.02 * share * owned
        assert saved == pytest.approx(want, abs=1e-9), candidate.label


def test_pieces_extrapolate_the_optimizer_update():
    low = VariantProfile("fp32", False, 2, step_time_s=0.010, optimizer_step_time_s=0.002)
    high = VariantProfile("fp32", False, 2, step_time_s=0.012, optimizer_step_time_s=0.0025)
    assert extrapolate(low, high, 0, 12).optimizer_step_time_s == pytest.approx(0.002 + 12 * 0.0005)


def test_a_pipeline_stage_pays_the_fixed_part_of_a_pass_once_per_micro_batch():
    """Measured alone also at a pipeline's micro-batch (half the per-rank batch), a pass costs the straight
    line through the two measurements: a stage pays its part that does not shrink with the batch once per
    micro-batch, so the pipeline is priced above the batch-proportional price, by exactly that part; the
    line's slope stays between flat and proportional whatever the noise."""
    search = _hand_made_search(world=4, ranks_per_node=4)
    plain = dataclasses.replace(search.variants[("fp32", False)], step_time_s=0.05, optimizer_step_time_s=0.01)
    # full batch 2: 0.04 s forward + backward; batch 1: 0.03 s -> 0.02 s fixed, 0.01 s a sample
    assert fixed_pass_share(plain, 0.04, 1) == pytest.approx(0.5)
    assert fixed_pass_share(plain, 0.07, 1) == pytest.approx(1.0)  # noise: the half batch slower: flat
    assert fixed_pass_share(plain, 0.015, 1) == pytest.approx(0.0)  # below proportional: proportional
    assert fixed_pass_share(plain, 0.04, 2) == 0.0  # not a smaller batch: nothing learnt
    micro = dataclasses.replace(plain, pass_fixed_share=0.5)
    assert pass_seconds(plain, 1) == pytest.approx(0.02)  # unmeasured: proportional
    assert pass_seconds(micro, 1) == pytest.approx(0.03) and pass_seconds(micro, 2) == pytest.approx(0.04)
    assert pass_seconds(micro, 4) == pytest.approx(0.06)
    # an extra micro-step runs the fixed part again; unmeasured, MICRO_STEP_OVERHEAD of the step
    assert micro_step_overhead_s(micro) == pytest.approx(0.02)
    assert micro_step_overhead_s(plain) == pytest.approx(0.05 * MICRO_STEP_OVERHEAD)
    assert micro_step_overhead_s(dataclasses.replace(plain, pass_fixed_share=0.0)) == 0.0  # measured: none
    facts = search.profile.layouts
    before = MeasuredProfile(search.profile, search.hardware, {("fp32", False): plain}, 4, search.topology)
    after = MeasuredProfile(search.profile, search.hardware, {("fp32", False): micro}, 4, search.topology)
    compared = 0
    for candidate in search.candidates:
        if candidate.checkpoint or candidate.precision != "fp32" or candidate.shard or candidate.micro > 1:
            continue
        added = predict_measured(candidate, after).step_time_s - predict_measured(candidate, before).step_time_s
        if candidate.pipeline == 1:
            assert added == 0, candidate.label
            continue
        t, p = candidate.tensor, candidate.pipeline
        batch = 2 * t * p
        micro_batches = min(2 * p, batch)
        samples = batch / micro_batches
        want = (pass_seconds(micro, samples) - pass_seconds(plain, samples)) * facts.state_share[(t, p)]
        assert added == pytest.approx(want * (micro_batches + p - 1), abs=1e-9), candidate.label
        # a micro-batch as large as the measured batch (tensor x pipeline) costs what it did
        assert (added > 0) == (samples < plain.batch), candidate.label
        compared += samples < plain.batch
    assert compared


def test_the_search_measures_a_pipeline_micro_batch_only_for_precisions_a_fitting_pipeline_uses():
    """Once per precision, without checkpointing, at half the per-rank batch; the share carried to the same
    precision with checkpointing; nothing where no pipeline candidate fits."""
    search = _hand_made_search(world=4, ranks_per_node=4)
    plain, ckpt = ("fp32", False), ("fp32", True)
    search.variants[plain] = dataclasses.replace(search.variants[plain], step_time_s=0.05)
    search.variants[ckpt] = dataclasses.replace(search.variants[plain], checkpoint=True, step_time_s=0.07)
    asked = []

    def measured_alone(settings, batch):
        asked.append((list(settings), batch))
        return {s: dataclasses.replace(search.variants[s], step_time_s=0.04, batch=batch) for s in settings}

    search._measured_alone = measured_alone
    search._measure_fixed_pass_shares({plain, ckpt})
    assert asked == [([plain], 1)]
    share = fixed_pass_share(dataclasses.replace(search.variants[plain], pass_fixed_share=None), 0.04, 1)
    assert share > 0
    assert search.variants[plain].pass_fixed_share == search.variants[ckpt].pass_fixed_share == share
    search._measure_fixed_pass_shares({plain, ckpt})
    assert len(asked) == 1  # measured once
    search.variants[plain] = dataclasses.replace(search.variants[plain], pass_fixed_share=None)
    search.candidates = [c for c in search.candidates if c.pipeline == 1 and c.micro == 1]
    search._measure_fixed_pass_shares({plain})
    assert len(asked) == 1  # no pipeline and no micro-batched candidate: nothing to measure


def test_a_pipeline_beyond_the_top_k_at_its_lowest_price_is_not_measured_for_its_fixed_share():
    """An unmeasured fixed share prices a pipeline's micro-batches in proportion to the batch, the lowest
    price a measurement could give it: a pipeline beyond the ``topk`` fastest by that price is never dry-run,
    so its precision is not measured again at the small batch; one inside the top-k is."""
    search = _hand_made_search(world=4, ranks_per_node=4)
    plain = ("fp32", False)
    asked = []

    def measured_alone(settings, batch):
        asked.append((list(settings), batch))
        return {s: dataclasses.replace(search.variants[s], step_time_s=0.04, batch=batch) for s in settings}

    search._measured_alone = measured_alone
    unsplit = [c for c in search.candidates if c.pipeline == 1 and c.micro == 1 and c.tensor == 1 and not c.checkpoint]
    pipeline = next(c for c in search.candidates if c.pipeline > 1 and c.micro == 1 and not c.checkpoint)
    k = search.options.topk
    assert len(unsplit) >= k
    search._fitting_candidates = lambda: [(0.01 * (i + 1), c) for i, c in enumerate(unsplit[:k])] + [(1.0, pipeline)]
    search._measure_fixed_pass_shares({plain})
    assert asked == [] and search.variants[plain].pass_fixed_share is None
    search._fitting_candidates = lambda: [(0.001, pipeline)] + [(0.01 * (i + 1), c) for i, c in enumerate(unsplit)]
    search._measure_fixed_pass_shares({plain})
    assert asked == [([plain], 1)] and search.variants[plain].pass_fixed_share is not None

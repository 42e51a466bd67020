"""The fully automatic search: analyse → candidates → measure alone → estimate → prune → dry-run
the most promising within the time limit → confirm close finalists → refine → report.

Every rank runs the same loop on the same numbers (measurements are agreed across ranks, or made on some
ranks and exchanged: ``atorch.distributed.spread``; time-limit decisions are broadcast from rank 0, see
``atorch.distributed.agreement``), so every rank ends with the same strategy. A candidate that fails on any
rank (while being applied or while training) is marked failed on every rank and the loop goes on.

``StrategySearch`` holds one search's state (the model, the context factory, the options, the profiles,
the candidates and their report rows, the start time) so each step is a short method reading the
state it needs, instead of a function passed a dozen positional arguments.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from atorch.auto import opt_lib
from atorch.auto.apply import apply_strategy, resolve_strategy
from atorch.auto.dryrun import DryRunResult, dry_run, dry_run_copy
from atorch.auto.opt_lib.row_layout import rows_elsewhere
from atorch.auto.search.analyser import ModelProfile, analyse_model
from atorch.auto.search.candidates import Candidate, SearchSpace, enumerate_candidates, needless_split, refinements
from atorch.auto.search.layouts import layout_facts
from atorch.auto.search.measure import (
    HardwareProfile,
    NodeGrid,
    Setting,
    VariantProfile,
    cache_key,
    load_cached,
    measure_hardware,
    measure_variant,
    slowest_of,
    store_cached,
    train_alone,
    variant_from_dict,
)
from atorch.auto.search.options import SearchOptions
from atorch.auto.search.pieces import (
    BlockStack,
    PieceRun,
    cut_copy,
    describe_pieces,
    extrapolate,
    find_block_stack,
    state_bytes_needed,
    whole_model,
)
from atorch.auto.search.report import Row, format_table, write_report
from atorch.auto.search.topology import Links, keep_tensor_in_node, topology_for
from atorch.auto.strategy import Strategy, StrategyItem
from atorch.cost_model import (
    MEMORY_MODEL_ERROR,
    Estimate,
    MeasuredProfile,
    fits_with_margin,
    fixed_pass_share,
    predict_measured,
    sharding_overhead_s,
    tensor_split_overhead_s,
)
from atorch.distributed.agreement import all_ranks_true, broadcast_flag, is_main_rank, world_size
from atorch.distributed.spread import assignment, spread_over_ranks
from atorch.distributed.timeouts import DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S
from atorch.errors import InputError
from atorch.utils.batch import first_tensor, loss_value
from atorch.utils.memory import release_host_memory

logger = logging.getLogger("atorch")

ContextFactory = Callable[..., Any]  # (model, local=False, batch_size=None) -> ModelContext

CLOSE_CALL = 0.15  # finalists measured within this fraction of each other are measured again
CONFIRM_ROUNDS = 2  # alternating re-measurements of close finalists (3 samples each: a real median)
# a candidate predicted inside MEMORY_MODEL_ERROR of the limit is dry-run once the search's own dry runs
# (at least MIN_MEMORY_EVIDENCE of them) show the memory model's error on this model to be smaller;
# the margin kept then is that observed error, never under LEARNED_MARGIN_FLOOR
MIN_MEMORY_EVIDENCE = 2
LEARNED_MARGIN_FLOOR = 0.05
# a candidate predicted slower than the best measured, beyond the largest over-prediction seen in at least
# this many successful dry runs, is not dry-run (``_cannot_win``)
MIN_TIME_EVIDENCE = 2
# Checkpointing runs each block's forward again in backward: at least this share of the blocks' forward and
# backward time (the forward does a third of their matmul FLOPs, backward twice as many). A floor, not an
# estimate: measured on CPU, one thread, one block of search_quality.py's HF Llama 12x256 and repo GPT 4x128
# (fp32 and bf16 autocast), checkpointing added 0.40-0.51 of the block's time (a forward alone: 0.23-0.34).
RECOMPUTED_FORWARD_SHARE = 0.25
# the methods that make a setting (precision, checkpoint): what a rank training alone applies
SETTING_METHODS = ("amp_native", "half", "checkpoint")
PIECE_STEP_FACTOR = 2  # a cut model trains this many times the dry run's steps (see ``_train_alone``)
# the shardings whose cost the search measures on the real process group before dry-running them
# (``_measure_sharding``): FSDP, whose per-unit gathers, reduce-scatters and copies the bandwidth formula
# prices from an all-reduce and so under-prices (on 2 to 4 gloo ranks, 1.6 to 2 times), and zero2, which is
# FSDP2 keeping its parameters gathered through the step (the same per-unit work less backward's gathers:
# on the repo GPT on 2 gloo ranks it ran 23 % slower than ddp, the formula priced it 1 % faster)
MEASURED_SHARDINGS = ("fsdp", "zero2")
# a rank measuring its settings alone whose heartbeat stops this long is reported lost (``spread_over_ranks``)
SPREAD_LOST_AFTER_S = 60.0


@dataclass
class SearchResult:
    strategy: Optional[Strategy]
    candidate: Optional[Candidate]
    rows: list[Row]
    profile: ModelProfile
    hardware: HardwareProfile
    dryrun: Optional[DryRunResult] = None     # the chosen candidate's dry run
    report_files: list = field(default_factory=list)
    table: str = ""                           # the report, always here (files only with report_dir)
    phase_seconds: dict = field(default_factory=dict)  # where the search's time went
    pieces: list = field(default_factory=list)  # every alone measurement (``PieceRun``): what the search ran
    # what the estimates read (atorch.plan.plan_measured reproduces them from it), and the candidates:
    # candidates[i] is the one rows[i] reports
    measured: Optional[MeasuredProfile] = None
    candidates: list[Candidate] = field(default_factory=list)


def search(model: torch.nn.Module, make_context: ContextFactory, options: SearchOptions) -> SearchResult:
    """Find the fastest strategy that fits ``options.memory_limit`` (see the module doc)."""
    return StrategySearch(model, make_context, options).run()


class StrategySearch:
    """One search. ``run()`` calls the steps in order; each step records what the next reads:

    - ``analyse()``: the model profile, the candidates, the machine (memory limit, bandwidth);
    - ``measure()``: one rank training alone under each precision / checkpoint setting;
    - ``estimate()``: a report row per candidate with its predicted memory and step time;
    - ``dry_run_best()``: dry-runs the fastest predictions that fit, at least ``topk`` of them;
    - ``confirm_finalists()``: measures the two fastest again when noise could have ranked them;
    - ``refine()``: tries the winner with each compute method, kept only when measured faster;
    - ``report()``: the table (logged, and written under ``report_dir`` when given) and the result.
    """

    def __init__(self, model: torch.nn.Module, make_context: ContextFactory, options: SearchOptions):
        self.model, self.make_context, self.options = model, make_context, options
        self.world = world_size()
        self.topology = topology_for(self.world, options.ranks_per_node)
        self.links = Links(options.intra_node_bandwidth, options.inter_node_bandwidth)
        self.started = time.perf_counter()
        self.phases = _Phases()
        self.per_rank_batch = 1  # under pure data parallelism
        self.input_format: Optional[str] = None  # the context's model_input_format, for the errors that name it
        self.profile: Optional[ModelProfile] = None
        self.hardware: Optional[HardwareProfile] = None
        self.space: Optional[SearchSpace] = None
        self.candidates: list[Candidate] = []
        self.variants: dict[Setting, VariantProfile] = {}
        self.measured: Optional[MeasuredProfile] = None  # what every estimate reads, once measured
        self.rows: list[Row] = []           # rows[i] reports candidates[i]
        self.order: list[int] = []          # candidates predicted to fit, fastest first
        self.dry_runs: dict[int, DryRunResult] = {}  # each candidate's first dry run
        self.stack: Optional[BlockStack] = None      # the model's repeated blocks, measured by pieces
        self.pieces: list[PieceRun] = []             # every alone measurement, in order
        self.dominated: dict[Setting, str] = {}      # checkpointed settings not measured, and why

    def run(self) -> SearchResult:
        self.analyse()
        self.phases.mark("analyse")
        self.measure()
        self.phases.mark("measure alone")
        self._refuse_a_model_that_never_trained()
        self.estimate()
        chosen = self.dry_run_best()
        self.phases.mark("dry-run")
        if chosen is not None and self.options.refine:
            chosen = self.refine(chosen)
        self.phases.mark("refine")
        return self.report(chosen)

    # --- the steps -------------------------------------------------------------------------------------
    def analyse(self) -> None:
        probe = self.make_context(self.model, local=True)
        self.input_format = probe.model_input_format
        self.per_rank_batch = probe.dataloader_args.get("batch_size", 1) // self.world
        self.profile = self._profile(probe)
        self.space = SearchSpace(self.world, probe.device, self.profile, self.options.excluded,
                                 self.options.included, self.per_rank_batch,
                                 self.topology.ranks_per_node if self.topology.nodes > 1 else 0,
                                 rows_elsewhere(probe))
        self.candidates, _ = enumerate_candidates(self.space)
        self._say(f"search: {len(self.candidates)} candidate strategies for {self.world} rank(s); model "
                  f"{self.profile.param_count / 1e6:.2f} M parameters, repeated block {self.profile.main_block}")
        self.measure_machine(probe.device)

    def _refuse_a_model_that_never_trained(self) -> None:
        """When every setting's measurement failed with one and the same error, and not for memory, no
        method can help: the model does not train on the batches as they reach it (``model_input_format``,
        the dataset's items, ``loss_func``). A typed error naming it, on every rank alike, instead of a table
        of candidates that all failed the same way."""
        errors = {variant.error for variant in self.variants.values()}
        error = next(iter(errors)) if len(errors) == 1 else None
        if not all_ranks_true(error is not None and "memory" not in error.lower()):
            return
        raise InputError(f"the model failed to train alone under every setting with the same error, before any "
                         f"method was applied: {error}. No strategy can fix that: check that "
                         f"model_input_format={self.input_format!r} calls the model as its forward expects "
                         "(None: model(batch), 'unpack_sequence': model(*batch), 'unpack_dict': model(**batch)), "
                         "and that loss_func(batch, output) runs on what it returns")

    def measure_machine(self, device: torch.device) -> None:
        """The memory limit, the all-reduce bandwidth and latency, and each link's bandwidth: measured, or as
        the options give it. The estimates then cost every collective on the link it crosses (``self.links``)."""
        self.hardware = measure_hardware(device, self.options.memory_limit, self._node_grid())
        self.links = Links(self.hardware.intra_node_bandwidth, self.hardware.inter_node_bandwidth)
        if self._links_matter():
            self._say(f"search: {self.topology.nodes} node(s) x {self.topology.ranks_per_node} rank(s); "
                      + self.hardware.describe_links())

    def measure(self) -> None:
        """One rank alone per setting the candidates use, from the profile cache when every rank has it;
        measured by pieces (``pieces.py``) where the model has a block stack, the settings spread over the
        ranks (``_measure_settings``)."""
        batch = self.per_rank_batch
        self.stack = find_block_stack(self.model)
        fresh: dict[Setting, str] = {}
        settings = sorted({(c.precision, c.checkpoint) for c in self.candidates})
        # without checkpointing first: whether a checkpointed setting is needed at all depends on them
        for checkpointed in (False, True):
            todo = []
            for setting in (s for s in settings if s[1] == checkpointed):
                if checkpointed and self._checkpointing_dominated(setting):
                    continue
                key = cache_key(self.profile, self.hardware, batch, setting)
                cached = load_cached(key) if self.options.use_cache else None
                if all_ranks_true(cached is not None):
                    self.variants[setting] = cached
                    continue
                todo.append(setting)
                fresh[setting] = key
            self._measure_settings(todo)
        self._measure_tensor_splits(set(fresh))
        if self._carry_split_overheads(set(fresh)):
            self._measure_tensor_splits(set(fresh))  # a carried overhead may have moved a split into the top-k
        self._measure_fixed_pass_shares(set(fresh))
        if is_main_rank():
            for setting, key in fresh.items():
                store_cached(key, self.variants[setting])
        self._bound_checkpointed_times()

    def _checkpointing_dominated(self, setting: Setting) -> bool:
        """Whether the checkpointed ``setting`` need not be measured: checkpointing recomputes the forward
        and changes nothing else, so a candidate with it is never faster than its twin without; when every
        candidate using the setting has such a twin predicted to fit (with the memory model's margin),
        none of them can be the fastest that fits. Recorded in ``self.dominated`` with the reason.
        ``search_exhaustive`` measures and dry-runs every candidate all the same."""
        if self.options.exhaustive:
            return False
        self.measured = self._measured()
        labels = {c.label for c in self.candidates}
        twins = [dataclasses.replace(c, checkpoint=False) for c in self.candidates
                 if (c.precision, c.checkpoint) == setting]
        for twin in twins:
            if twin.label not in labels or not self.measured.predictable(twin):
                return False
            if not fits_with_margin(self._estimate(twin).memory_bytes, self.hardware.memory_limit):
                return False
        self.dominated[setting] = ("not measured: checkpointing only adds recompute, and the same candidate "
                                   "without it is predicted to fit")
        self._say(f"search: {setting[0]} with checkpointing not measured: every candidate using it has a twin "
                  "without checkpointing that is predicted to fit, and recompute never makes a step faster")
        return True

    def _bound_checkpointed_times(self) -> None:
        """A checkpointed setting's step times are at least those of the same precision without it plus
        the forward it runs again (``RECOMPUTED_FORWARD_SHARE`` of the blocks' time the pieces measured
        without it): where pieces measured it faster, that difference was noise (or the plain setting's
        0- and 1-block pieces counting a first block's extra cost once per block), and left in it would rank
        checkpointed candidates level with, or ahead of, their twins."""
        for (precision, checkpoint), variant in list(self.variants.items()):
            plain = self.variants.get((precision, False))
            if not checkpoint or plain is None or plain.error or variant.error:
                continue
            floor = plain.step_time_s + RECOMPUTED_FORWARD_SHARE * plain.blocks_step_time_s
            splits = {t: max(s, plain.tensor_step_times.get(t, 0.0)) for t, s in variant.tensor_step_times.items()}
            sharded = {k: max(s, plain.sharded_step_times.get(k, 0.0)) for k, s in variant.sharded_step_times.items()}
            self.variants[(precision, checkpoint)] = dataclasses.replace(
                variant, step_time_s=max(variant.step_time_s, floor), tensor_step_times=splits,
                sharded_step_times=sharded)

    def _measure_tensor_splits(self, settings: set[Setting]) -> None:
        """Measure tensor splits and shardings (``_measure_tensor_split``, ``_measure_sharding``) until
        none that could be dry-run is left unmeasured: one at a time, since a measurement moves its
        candidates (the formula's cost is the optimistic one) and so changes which are the fastest."""
        tried: set[tuple[Setting, Any]] = set()
        while True:
            wanted = {key: t for key, t in self._measurements_that_matter(settings).items() if key not in tried}
            if not wanted:
                return
            setting, what = min(wanted, key=lambda key: (wanted[key], str(key)))
            self._measure_split(setting, what)
            tried.add((setting, what))
            self._carry_split(what, self.variants[setting])

    def _carry_split_overheads(self, settings: set[Setting]) -> bool:
        """Price every split the candidates use from a measurement, not only those that could be dry-run:
        each tensor size and measured sharding (``MEASURED_SHARDINGS``) that no setting measured is measured
        once, at the setting of its fastest candidate predicted to fit, and what it adds to a step is carried
        to the settings that did not measure it (``VariantProfile.tensor_overhead_s``,
        ``sharded_overhead_s``). The formula leaves out the split layers' own work and prices a collective
        as an all-reduce: on CPU gloo a tensor split's step measured 2-3x the formula's price and FSDP's
        1.4x, so the candidates beyond the top-k were ranked among the fastest. Returns whether anything
        was carried. Where no more candidates fit than are dry-run, each is dry-run anyway and nothing is
        measured here (a split's pieces cost about what its candidate's dry run does)."""
        fitting = self._fitting_candidates()
        if self.options.exhaustive or len(fitting) <= self.options.topk:  # each is dry-run: its own run prices it
            return False
        firsts: dict[Any, tuple[float, Setting]] = {}
        for time_s, candidate in fitting:
            setting, kind = (candidate.precision, candidate.checkpoint), self._split_kind(candidate)
            if kind is not None and setting in settings:
                firsts[kind] = min(firsts.get(kind, (float("inf"), setting)), (time_s, setting))
        carried = False
        for kind, (_, setting) in sorted(firsts.items(), key=lambda item: str(item[0])):
            source = next((v for v in self.variants.values() if self._split_added_s(kind, v) is not None), None)
            if source is None:
                self._measure_split(setting, kind)
                source = self.variants[setting]
            carried = self._carry_split(kind, source) or carried
        return carried

    def _carry_split(self, kind: Any, source: VariantProfile) -> bool:
        """What the split ``kind`` added to ``source``'s step as measured, carried to every setting that has
        not measured it (``VariantProfile.tensor_overhead_s``, ``sharded_overhead_s``); returns whether any
        took it. Such a setting then wants no measurement of its own (``_measurements_that_matter``): the
        split's collectives and its layers' own work change little with the precision, and a candidate that
        stays among the fastest by the carried cost is dry-run, which prices it on its own."""
        added = self._split_added_s(kind, source)
        if added is None:
            return False
        carried = False
        for variant in self.variants.values():
            if variant.error or self._split_added_s(kind, variant) is not None:
                continue
            if isinstance(kind, int):
                variant.tensor_overhead_s[kind] = added
            else:
                variant.sharded_overhead_s[kind], variant.sharded_world = added, self.world
            carried = True
        return carried

    def _split_kind(self, candidate: Candidate) -> Any:
        """The split ``candidate`` pays for that pieces can measure: its tensor size, its sharding where the
        search measures it unsplit over all ranks, or None."""
        if candidate.tensor > 1:
            return candidate.tensor
        if (candidate.sharding in MEASURED_SHARDINGS and candidate.pipeline == 1 and not candidate.shard
                and self.world > 1):
            return candidate.sharding
        return None

    def _split_added_s(self, kind: Any, variant: VariantProfile) -> Optional[float]:
        """What the split ``kind`` adds to ``variant``'s step as measured under it; None if it was not."""
        if isinstance(kind, int):
            return tensor_split_overhead_s(kind, variant, self.world, self.profile, self.hardware)
        return sharding_overhead_s(kind, variant) if variant.sharded_world == self.world else None

    def _measure_split(self, setting: Setting, kind: Any) -> None:
        if isinstance(kind, int):
            self._measure_tensor_split(setting, kind, self.variants[setting])
        else:
            self._measure_sharding(setting, kind, self.variants[setting])

    def _fitting_candidates(self) -> list[tuple[float, Candidate]]:
        """Every candidate the current measurements can predict (its setting measured and not failed alone)
        that is predicted to fit with the memory model's margin, with its predicted step time, in the
        candidates' order. Re-reads the measurements first: each split measured moves its candidates."""
        self.measured = self._measured()
        fitting = []
        for candidate in self.candidates:
            if not self.measured.predictable(candidate):
                continue
            guess = self._estimate(candidate)
            if fits_with_margin(guess.memory_bytes, self.hardware.memory_limit):
                fitting.append((guess.step_time_s, candidate))
        return fitting

    @staticmethod
    def _dry_runnable(fitting: list[tuple[float, Candidate]]) -> list[tuple[float, Candidate]]:
        """``fitting`` less the splits the search would not dry-run (``_skip_needless_splits``: the same
        candidate with fewer micro-batches, or synchronising at the last micro-step, also fits)."""
        labels = {candidate.label for _, candidate in fitting}
        return [(t, c) for t, c in fitting if c.micro == 1 or not needless_split(c, lambda x: x.label in labels)]

    def _measurements_that_matter(self, settings: Iterable[Setting]) -> dict[tuple[Setting, Any], float]:
        """The (setting, tensor size) and (setting, sharding) pairs among ``settings`` neither measured yet
        nor carried from another setting (``_carry_split``) that some candidate the search would dry-run
        uses, each with that candidate's predicted step time: among the ``topk`` fastest candidates
        predicted to fit (every fitting one with ``exhaustive``), unmeasured splits and shardings costed by
        the formula, which leaves out the split layers' and the sharding's own overheads (the optimistic
        cost: a candidate beyond the ``topk`` by it stays beyond once measured, and is never dry-run). A
        sharding is measured where ``MEASURED_SHARDINGS`` names it, unsplit over all ranks (what
        ``sharded_step_times`` holds)."""
        settings = set(settings)
        fitting = self._dry_runnable(self._fitting_candidates())
        fitting.sort(key=lambda pair: pair[0])
        # a sharding's pieces cost about what its candidate's own dry run costs (every rank's collectives
        # run on both), so it is measured only where its candidate could then be left out: where more
        # candidates fit than are dry-run (otherwise every one of them is dry-run in some order anyway)
        shardings_matter = not self.options.exhaustive and len(fitting) > self.options.topk
        if not self.options.exhaustive:
            fitting = fitting[:self.options.topk]
        wanted: dict[tuple[Setting, Any], float] = {}
        for time_s, candidate in fitting:
            setting = (candidate.precision, candidate.checkpoint)
            if setting not in settings:
                continue
            variant = self.variants[setting]
            key = None  # neither measured at this setting nor carried from another (``_carry_split``)
            if (candidate.tensor > 1 and candidate.tensor not in variant.tensor_step_times
                    and candidate.tensor not in variant.tensor_overhead_s):
                key = (setting, candidate.tensor)
            elif (shardings_matter and self._unmeasured_sharding(candidate, variant)
                  and candidate.sharding not in variant.sharded_overhead_s):
                key = (setting, candidate.sharding)
            if key is not None:
                wanted[key] = min(wanted.get(key, float("inf")), time_s)
        return wanted

    def _measure_settings(self, settings: list[Setting]) -> None:
        """Each setting measured alone at the per-rank batch (``_measured_alone``)."""
        self.variants.update(self._measured_alone(settings, self.per_rank_batch))

    def _measured_alone(self, settings: list[Setting], batch: int) -> dict[Setting, VariantProfile]:
        """Each setting measured alone at ``batch``, the settings spread over the ranks (``spread_over_ranks``:
        N at a time on N ranks, a round with fewer settings than ranks measuring them on several, so that
        every rank works while the others do, as in training), then every rank has every profile (the
        slowest of a setting's ranks: ``slowest_of``) and every piece's record (its first rank's). A setting
        that fails alone is that setting's error, as when every rank measured it; a rank that raises outside
        a measurement fails every rank."""
        if not settings:
            return {}
        if self.world > 1 and len(settings) > 1:
            ranks = assignment(len(settings), self.world)
            share = "; ".join(f"{_setting_label(self._setting_strategy(s))} on rank(s) "
                              f"{', '.join(str(r) for r in range(self.world) if i in ranks[r])}"
                              for i, s in enumerate(settings))
            self._say(f"search: measuring {len(settings)} settings alone at batch {batch}, spread over the ranks: "
                      f"{share}")

        def measure_one(setting: Setting) -> str:
            first = len(self.pieces)
            variant = self._measure_setting(setting, self._setting_strategy(setting), batch)
            runs = self.pieces[first:]
            del self.pieces[first:]  # every rank adds every setting's records below, in the settings' order
            return json.dumps({"variant": dataclasses.asdict(variant), "pieces": [dataclasses.asdict(r) for r in runs]})

        results = spread_over_ranks(settings, measure_one, lost_after_s=SPREAD_LOST_AFTER_S, describe=_setting_text)
        measured = {}
        for setting, texts in zip(settings, results):
            records = [json.loads(text) for text in texts]
            measured[setting] = slowest_of([variant_from_dict(record["variant"]) for record in records])
            self.pieces.extend(PieceRun(**run) for run in records[0]["pieces"])
        return measured

    def _measure_fixed_pass_shares(self, settings: set[Setting]) -> None:
        """The fixed part of a pass (``VariantProfile.pass_fixed_share``) for each precision that a pipeline
        candidate, or a micro-batched one whose batch does not fit unsplit, predicted to fit uses: its setting
        without checkpointing measured alone once more at half the per-rank batch (a pipeline's micro-batch:
        ``layouts.micro_batches`` runs 2 per stage, so a micro-batch holds half the per-rank batch whatever
        the stage count; and 2 micro-steps' micro-batch), the share carried to the same precision with
        checkpointing (recompute runs the same ops again: fixed and batch-bound parts alike). On 2 CPU ranks
        the repo GPT's 2-stage pipeline ran 1.2-1.7x the step a price in proportion to the batch gave it, bf16
        autocast most (it casts the stage's weights again for every micro-batch), where a micro-step cost
        0.03-0.04 of the step, not the 0.2 ``MICRO_STEP_OVERHEAD`` assumes; a device's small kernels lose
        efficiency the same way."""
        micro = self.per_rank_batch // 2
        if micro < 1:
            return
        precisions = {c.precision for c in self._could_use_a_fixed_share()}
        wanted = [(p, False) for p in sorted(precisions) if (p, False) in settings and (p, False) in self.variants
                  and not self.variants[(p, False)].error and self.variants[(p, False)].pass_fixed_share is None]
        for (precision, _), small in (self._measured_alone(wanted, micro) if wanted else {}).items():
            if small.error:
                continue
            share = fixed_pass_share(self.variants[(precision, False)], small.step_time_s, micro)
            self.variants[(precision, False)] = dataclasses.replace(self.variants[(precision, False)],
                                                                    pass_fixed_share=share)
            self._say(f"search: {precision}: {share:.0%} of a forward and backward pass does not shrink with the "
                      f"batch (measured alone at batch {micro} and {self.per_rank_batch}); a pipeline stage pays it "
                      "once per micro-batch, micro-batching once per extra micro-step")
        for (precision, checkpoint), variant in list(self.variants.items()):
            plain = self.variants.get((precision, False))
            if checkpoint and plain is not None and not variant.error and variant.pass_fixed_share is None:
                self.variants[(precision, checkpoint)] = dataclasses.replace(
                    variant, pass_fixed_share=plain.pass_fixed_share)

    def _could_use_a_fixed_share(self) -> list[Candidate]:
        """The dry-runnable candidates predicted to fit whose price a measured fixed share could change enough
        to matter: every micro-batched one (unmeasured, its extra micro-steps cost ``MICRO_STEP_OVERHEAD``, which
        a measurement can lower) and the pipelines among the ``topk`` fastest (every one with ``exhaustive``).
        An unmeasured share prices a pipeline's micro-batches in proportion to the batch, its lowest price: one
        beyond the top-k by it stays beyond once measured (HF GPT-2 on 2 ranks: its 2-stage pipelines priced at
        twice the top-k's times, the two measurements 0.5-1 s of a 9 s search)."""
        runnable = sorted(self._dry_runnable(self._fitting_candidates()), key=lambda pair: pair[0])
        cut = float("inf")
        if not self.options.exhaustive and len(runnable) > self.options.topk:
            cut = runnable[self.options.topk - 1][0]
        return [c for t, c in runnable if c.micro > 1 or (c.pipeline > 1 and t <= cut)]

    def _measure_setting(self, setting: Setting, strategy: Strategy, batch: int) -> VariantProfile:
        """The whole model's alone profile under ``setting``: extrapolated from the model cut to 0 and 1
        blocks (or 1 and 2 when it cannot run without blocks), or, without a usable block stack, measured
        whole. Under checkpointing the pieces are 1 and 2 blocks: backward recomputes one block at a time,
        a working set the step holds once, which only two pieces with blocks separate from a block's share."""
        label = _setting_label(strategy)
        if self.stack is not None:
            for low in ((1,) if setting[1] else (0, 1)):
                self._say(f"search: measuring one rank alone with {label} at batch {batch}, the model cut to "
                          f"{low} and {low + 1} of its {self.stack.blocks} blocks")
                low_run = self._measure_piece(label, setting, strategy, batch, low)
                if low_run.error:
                    continue
                high_run = self._measure_piece(label, setting, strategy, batch, low + 1)
                if not high_run.error and high_run.step_time_s < low_run.step_time_s:
                    # a block cannot take negative time: another process slowed one of the two; once more
                    low_run = self._measure_piece(label, setting, strategy, batch, low)
                    high_run = self._measure_piece(label, setting, strategy, batch, low + 1)
                if not (low_run.error or high_run.error):
                    return extrapolate(low_run, high_run, low, self.stack.blocks)
        self._say(f"search: measuring one rank alone with {label} at batch {batch}, the whole model")
        return self._measure_piece(label, setting, strategy, batch, None)

    def _measure_piece(self, label: str, setting: Setting, strategy: Strategy, batch: int,
                       kept: Optional[int]) -> VariantProfile:
        """Train the model cut to ``kept`` blocks (None: whole) alone, unless its training state alone is
        predicted over the memory limit; every run is recorded in ``self.pieces``."""
        held = self.stack.param_bytes(kept) if kept is not None else self.profile.param_bytes
        run = PieceRun(label, kept, self.stack.blocks if self.stack else 0, held, batch=batch)
        self.pieces.append(run)
        needed = state_bytes_needed(held)
        if needed > self.hardware.memory_limit:
            run.error = (f"{run.label} needs about {needed / 2**20:.1f} MiB of training state, over the memory "
                         f"limit {self.hardware.memory_limit / 2**20:.1f} MiB")
            return VariantProfile(setting[0], setting[1], batch, error=run.error)
        variant = measure_variant(lambda b: self._train_alone(strategy, b, kept), setting, batch)
        run.peak_bytes, run.step_time_s, run.error = variant.peak_bytes, variant.step_time_s, variant.error
        return variant

    def _measure_tensor_split(self, setting: Setting, tensor: int, variant: VariantProfile) -> None:
        """The whole model's step under ddp + a ``tensor``-way split on every rank, extrapolated from the
        model cut to 1 and 2 blocks (without a block the split finds nothing to split; each process
        holds 2 / tensor of the two) and dry-run as the plan would split it, on the real process groups.
        The cost model takes the split's cost from it instead of a formula (``cost_model._tensor_split_time``)."""
        if variant.error:
            return
        candidate = Candidate("ddp", setting[0], setting[1], block=self.profile.main_block, tensor=tensor)
        whole = self._whole_from_pieces(candidate)
        if whole is not None:
            variant.tensor_step_times[tensor] = whole

    def _unmeasured_sharding(self, candidate: Candidate, variant: VariantProfile) -> bool:
        """Whether ``candidate`` is an unsplit candidate over every rank of a sharding the search measures
        (``MEASURED_SHARDINGS``) that ``variant`` has not measured yet."""
        return (candidate.sharding in MEASURED_SHARDINGS and candidate.tensor * candidate.pipeline == 1
                and not candidate.shard and self.world > 1 and candidate.sharding not in variant.sharded_step_times)

    def _measure_sharding(self, setting: Setting, sharding: str, variant: VariantProfile) -> None:
        """The whole model's unsplit step under ``sharding`` over every rank, extrapolated from the model cut
        to 1 and 2 blocks (the sharding's per-unit cost is a block's share, as compute is), dry-run on the
        real process group, each process holding its shard of the two. The cost model takes what the
        sharding adds from it instead of the bandwidth formula (``cost_model._measured_sharding_seconds``)."""
        if variant.error:
            return
        whole = self._whole_from_pieces(Candidate(sharding, setting[0], setting[1], block=self.profile.main_block))
        if whole is not None:
            variant.sharded_step_times[sharding], variant.sharded_world = whole, self.world

    def _whole_from_pieces(self, candidate: Candidate) -> Optional[float]:
        """The whole model's step time under ``candidate``, extrapolated from its dry runs on the model cut
        to 1 and 2 blocks (both again once when the second ran faster: a block cannot take negative time);
        None without a stack of three or more blocks, or when a piece failed."""
        if self.stack is None or self.stack.blocks < 3:
            return None
        runs = [self._dry_run_piece(candidate, kept) for kept in (1, 2)]
        if all(r is not None for r in runs) and runs[1] < runs[0]:
            runs = [self._dry_run_piece(candidate, kept) for kept in (1, 2)]
        if any(r is None for r in runs):
            return None
        return whole_model(runs[0], runs[1], 1, self.stack.blocks)

    def _dry_run_piece(self, candidate: Candidate, kept: int) -> Optional[float]:
        """The step time of ``candidate`` dry-run on the model cut to ``kept`` blocks, recorded in
        ``self.pieces``; None when it failed or its state alone is predicted over the memory limit."""
        held = self.stack.param_bytes(kept)
        setting = _setting_label(self._setting_strategy((candidate.precision, candidate.checkpoint)))
        split = f"tp{candidate.tensor}" if candidate.tensor > 1 else candidate.sharding
        run = PieceRun(f"{setting}+{split}", kept, self.stack.blocks, held)
        self.pieces.append(run)
        needed = state_bytes_needed(held) / (candidate.tensor if candidate.tensor > 1 else self.world)
        if needed > self.hardware.memory_limit:
            run.error = f"needs about {needed / 2**20:.1f} MiB of training state, over the memory limit"
            return None
        self._say(f"search: dry-running {candidate.label} on the model cut to {kept} of {self.stack.blocks} blocks")
        try:
            piece = cut_copy(self.model, self.stack, kept)
        except ValueError as error:
            run.error = str(error)
            return None
        result = dry_run_candidate(piece, self.make_context, candidate,
                                   PIECE_STEP_FACTOR * self.options.dryrun_steps, self.options.collective_timeout_s)
        del piece
        run.peak_bytes, run.step_time_s = result.peak_memory_bytes or 0, result.step_time_s or 0.0
        run.error = None if result.ok else result.error
        return result.step_time_s if result.ok else None

    def estimate(self) -> None:
        """A row per candidate (failed when its setting failed alone, or predicted over the limit), and
        the order to dry-run the rest: fastest first, among equals the one with fewer methods."""
        self.measured = self._measured()
        for candidate in self.candidates:
            dominated = self.dominated.get((candidate.precision, candidate.checkpoint))
            if dominated:
                self.rows.append(Row(candidate.label, 0, float("inf"), "not tried", reason=dominated))
                continue
            variant = self.variants[(candidate.precision, candidate.checkpoint)]
            if variant.error:
                self.rows.append(Row(candidate.label, 0, float("inf"), "failed", reason=f"alone: {variant.error}"))
                continue
            guess = self._estimate(candidate)
            row = Row(candidate.label, guess.memory_bytes, guess.step_time_s)
            limit = self.hardware.memory_limit
            if guess.memory_bytes > limit:
                row.status = "predicted over limit"
            elif not fits_with_margin(guess.memory_bytes, limit):
                row.status = "predicted over limit"
                row.reason = (f"within {MEMORY_MODEL_ERROR:.0%} of the limit, the memory model's error: a dry run "
                              "could exceed it")
            self.rows.append(row)
        self._skip_needless_splits()
        fitting = [i for i, r in enumerate(self.rows) if r.status == "not tried" and not r.reason]
        self.order = sorted(fitting, key=lambda i: (round(self.rows[i].predicted_time_s, 4),
                                                     len(self.rows[i].label.split("+"))))

    def dry_run_best(self) -> Optional[int]:
        """Dry-run candidates in predicted order: up to ``topk``, and on until one succeeds (or all, with
        ``exhaustive``), within the time limit (the first even past it, so that what returns has trained);
        fewer where the rest cannot win (``_cannot_win``). On a GPU a candidate kept out only by the memory
        model's default margin takes its place in that order once the error measured so far admits it
        (``_near_limit_before``). Returns the chosen candidate's index."""
        tried, best, position = 0, None, 0
        queue = list(self.order)
        while queue:
            successes = any(r.status == "ok" for r in self.rows)
            room = tried < self.options.topk or not successes or self.options.exhaustive
            near = self._near_limit_before(self.rows[queue[0]].predicted_time_s) if room else None
            index = near if near is not None else queue.pop(0)
            position += near is None
            row = self.rows[index]
            if self._out_of_time():
                if tried:
                    row.status = "skipped: time limit"
                    continue
                # the analysis spent the limit: one dry run still, so that what returns has trained
                if is_main_rank():
                    logger.warning("time_limit (%s s) passed before any dry run: trying the best predicted "
                                   "candidate regardless", self.options.time_limit)
            if not room:
                row.status = "not tried"
                row.reason = "below the top-k by prediction"
                continue
            hopeless = self._cannot_win(index, best) if near is None and not self.options.exhaustive else ""
            if hopeless:
                row.status, row.reason = "not tried", hopeless
                continue
            tried += 1
            self._try_near(index) if near is not None else self._try(index)
            self._say_tried("near the limit" if near is not None else f"{position}/{len(self.order)}", row)
            if row.status == "ok" and (best is None or row.measured_time_s < self.rows[best].measured_time_s):
                best = index
        best = self.try_near_limit(best) if best is not None else None
        best = self.confirm_finalists() if best is not None else None
        if best is not None:
            self.rows[best].chosen = True
        return best

    def _cannot_win(self, index: int, best: Optional[int]) -> str:
        """Why candidate ``index`` need not be dry-run, or "": once ``MIN_TIME_EVIDENCE`` dry runs succeeded,
        one whose predicted time, divided by the largest over-prediction they measured, is still slower than
        the best measured by more than ``CLOSE_CALL`` cannot win (at scale: a layout predicted 3.7 times the
        best's time, a dry run of 8 of the search's 44 s)."""
        done = [r for r in self.rows if r.status == "ok" and r.measured_time_s]
        if best is None or len(done) < MIN_TIME_EVIDENCE:
            return ""
        over = max(1.0, max(r.predicted_time_s / r.measured_time_s for r in done))
        best_s, predicted_s = self.rows[best].measured_time_s, self.rows[index].predicted_time_s
        if predicted_s / over <= best_s * (1 + CLOSE_CALL):
            return ""
        return (f"cannot win: predicted {predicted_s * 1000:.0f} ms, over {over:.2f} (the largest over-prediction "
                f"measured) still {predicted_s / over / best_s - 1:.0%} slower than the best measured")

    def observed_memory_margin(self) -> Optional[float]:
        """The memory model's error on this model, as this search's dry runs measured it: the largest
        share by which a measured peak exceeded its prediction (at least ``LEARNED_MARGIN_FLOOR``);
        None before ``MIN_MEMORY_EVIDENCE`` dry runs measured a peak."""
        runs = [r for r in self.rows if r.measured_memory and r.predicted_memory]
        if len(runs) < MIN_MEMORY_EVIDENCE:
            return None
        return max(LEARNED_MARGIN_FLOOR, max(r.measured_memory / r.predicted_memory - 1 for r in runs))

    def try_near_limit(self, best: int) -> int:
        """After the ordered dry runs: the candidates kept out only by the default margin and predicted
        faster than the best so far, where the error measured on this model's dry runs leaves room (a
        layout predicted 8 % under the limit is often the fastest that fits); at most ``topk``, the
        margin measured again after each. Returns the best index (by measured time)."""
        for _ in range(self.options.topk):
            index = self._near_limit_before(self.rows[best].predicted_time_s)
            if index is None or self._out_of_time():
                break
            self._try_near(index)
            row = self.rows[index]
            self._say_tried("near the limit", row)
            if row.status == "ok" and row.measured_time_s < self.rows[best].measured_time_s:
                best = index
        return best

    def _near_limit_before(self, predicted_time_s: float) -> Optional[int]:
        """The fastest-predicted candidate kept out only by ``MEMORY_MODEL_ERROR``, predicted faster than
        ``predicted_time_s``, that fits with the error this search's dry runs measured; None if none.

        On a GPU only: there the tracked peak is what the device runs out of (and running out fails one dry
        run). On CPU the limit holds on the resident size, which glibc's retained pages put above the tracked
        peak (a meta Llama's 4-stage pipeline: 57.8 MiB tracked, 72 MiB resident growth), so the margin stays."""
        margin = self.observed_memory_margin()
        if self.hardware.device == "cpu" or margin is None or margin >= MEMORY_MODEL_ERROR:
            return None
        limit = self.hardware.memory_limit
        near = [i for i, r in enumerate(self.rows) if r.status == "predicted over limit"
                and r.predicted_memory * (1 + margin) <= limit and r.predicted_time_s < predicted_time_s]
        return min(near, key=lambda i: self.rows[i].predicted_time_s, default=None)

    def _try_near(self, index: int) -> None:
        margin, row = self.observed_memory_margin(), self.rows[index]
        row.status, row.reason = "not tried", ""
        self._try(index)
        if row.status == "ok":
            row.reason = f"dry-run: within the {margin:.0%} memory error this search's dry runs measured"

    def _say_tried(self, where: str, row: Row) -> None:
        self._say(f"search [{where}] {row.label}: {row.status}" + (
            f", {row.measured_time_s * 1000:.1f} ms/step, {row.measured_memory / 2**20:.1f} MiB "
            f"(predicted {row.predicted_memory / 2**20:.1f} MiB)" if row.status == "ok" else f" ({row.reason})"))

    def confirm_finalists(self, indices: Optional[list[int]] = None) -> Optional[int]:
        """The fastest of ``indices`` (default: every candidate) that trained within the limit.

        Single dry runs on a busy machine differ by 10-20% from noise alone: when the two fastest
        are that close, both are measured again ``CONFIRM_ROUNDS`` times in alternating order and
        their medians compared."""
        rows = self.rows
        ok = sorted((i for i in (indices if indices is not None else range(len(rows))) if rows[i].status == "ok"),
                    key=lambda i: rows[i].measured_time_s)
        if len(ok) < 2:
            return ok[0] if ok else None
        first, second = ok[0], ok[1]
        if rows[second].measured_time_s > rows[first].measured_time_s * (1 + CLOSE_CALL):
            return first
        rounds = [(second, first) if r % 2 == 0 else (first, second) for r in range(CONFIRM_ROUNDS)]
        for index in (i for pair in rounds for i in pair):
            if self._out_of_time():
                break
            result = dry_run_candidate(self.model, self.make_context, self.candidates[index], self.options.dryrun_steps,
                                       self.options.collective_timeout_s)
            if result.ok:
                rows[index].samples.append(result.step_time_s)
                rows[index].measured_time_s = statistics.median(rows[index].samples)
                rows[index].spread_s = max(rows[index].spread_s, result.step_time_spread_s or 0.0)
        return min((first, second), key=lambda i: rows[i].measured_time_s)

    def refine(self, chosen: int) -> int:
        """Try the winner with each compute method (their effect cannot be predicted from the alone
        profile); keep one only when it changed the model and measures faster by more than the
        measured noise (a method picked by noise would be kept for nothing). Returns the chosen index."""
        for candidate in refinements(self.space, self.candidates[chosen]):
            if self._out_of_time():
                break
            guess = self._estimate(candidate)
            row = Row(candidate.label, guess.memory_bytes, guess.step_time_s, priced=False)
            self.rows.append(row)
            self.candidates.append(candidate)
            self._try(len(self.candidates) - 1)
            self._say(f"search refine {row.label}: {row.status}"
                      + (f", {row.measured_time_s * 1000:.1f} ms/step" if row.status == "ok" else f" ({row.reason})"))
            index = len(self.candidates) - 1
            if row.status == "ok" and self._keeps(chosen, index, candidate.compute[-1]):
                self.rows[chosen].chosen = False
                row.chosen = True
                chosen = index
        return chosen

    def _keeps(self, chosen: int, index: int, method: str) -> bool:
        """Whether refinement ``index`` (the chosen candidate plus ``method``) replaces the chosen one:
        it changed some module, and after the close-call re-measurement it is faster by more than the
        noise. A method must earn its place: one that measured slower than the chosen candidate in its
        own dry run is not measured again (the chosen one stays). Otherwise its row says why it was not
        added. Nor is one whose first dry run gained less than the noise its and the chosen one's dry
        runs measured: a method must show its gain beyond the noise at once (at scale the close-call
        re-measurement of such gains was most of the refine step's time)."""
        row = self.rows[index]
        row.reason = unchanged_by(self.dry_runs[index], method)
        if row.reason:
            return False
        base_time = self.rows[chosen].measured_time_s
        if row.measured_time_s >= base_time:
            row.reason = f"not added: {row.measured_time_s / base_time - 1:.1%} slower in its dry run"
            return False
        row.reason = self._within_noise(chosen, index)
        if row.reason:  # measuring again only widens the noise (its spread is a running maximum)
            return False
        if self.confirm_finalists(indices=[chosen, index]) != index:
            return False
        row.reason = self._within_noise(chosen, index)
        return not row.reason

    def report(self, chosen: Optional[int]) -> SearchResult:
        """The result; the table is logged and kept in it, and written to files only under
        ``report_dir`` (rank 0), so a search never litters the working directory unasked."""
        table = format_table(self.rows, self.hardware.memory_limit)
        if self._links_matter():
            table = self.hardware.describe_links() + "\n" + table
        if self.pieces:
            table += "\n" + describe_pieces(self.pieces)
        table += "\nsearch time: " + ", ".join(f"{name} {s:.1f} s" for name, s in self.phases.seconds.items())
        self._say("search report:\n" + table)
        files = []
        if self.options.report_dir and is_main_rank():
            files = write_report(self.rows, self.hardware.memory_limit, self.options.report_dir)
        candidate = self.candidates[chosen] if chosen is not None else None
        return SearchResult(candidate.strategy(self.world) if candidate else None, candidate, self.rows, self.profile,
                            self.hardware, self.dry_runs.get(chosen), files, table, self.phases.seconds,
                            self.pieces, measured=self.measured, candidates=list(self.candidates))

    # --- helpers ---------------------------------------------------------------------------------------
    def _node_grid(self) -> NodeGrid:
        """The topology and the bandwidths the options give, as ``measure_hardware`` takes them (it measures
        each link the options leave out)."""
        return NodeGrid(self.topology.nodes, self.topology.ranks_per_node,
                          self.options.intra_node_bandwidth, self.options.inter_node_bandwidth)

    def _links_matter(self) -> bool:
        """Whether the report names the links: with several nodes, or when the user gave a bandwidth."""
        given = (self.options.intra_node_bandwidth, self.options.inter_node_bandwidth)
        return self.topology.nodes > 1 or any(b is not None for b in given)

    def _within_noise(self, base: int, faster: int) -> str:
        """Why ``faster`` does not beat ``base`` by more than the noise, or "" when it does. The noise is
        the larger spread measured for either: the standard deviation of a dry run's timed steps, or
        of the repeated dry runs' step times."""
        rows = self.rows
        noise = max(_spread(rows[base]), _spread(rows[faster]))
        gain = rows[base].measured_time_s - rows[faster].measured_time_s
        if gain > noise:
            return ""
        base_time = rows[base].measured_time_s
        return (f"not added: {gain / base_time:.1%} faster, within the measured noise "
                f"{noise / base_time:.1%}")

    def _skip_needless_splits(self) -> None:
        """A micro-batched candidate is not dry-run when fewer micro-batches are predicted to fit: it
        would only add per-micro-step overhead (``candidates.needless_split``)."""
        fits = {c.label: r.status == "not tried" for c, r in zip(self.candidates, self.rows)}
        for candidate, row in zip(self.candidates, self.rows):
            if candidate.micro > 1 and row.status == "not tried" and not row.reason:
                row.reason = needless_split(candidate, lambda c: fits.get(c.label, False)) or ""

    def _profile(self, probe) -> ModelProfile:
        """The static profile, FLOPs on one sample batch, the sequence length and the layout facts."""
        sample = None
        if probe.dataset is not None:  # batched as training batches it: the user's collate_fn pads ragged rows
            loader = torch.utils.data.DataLoader(probe.dataset, batch_size=max(self.per_rank_batch, 1),
                                                 collate_fn=probe.dataloader_args.get("collate_fn"))
            sample = next(iter(loader), None)

        def run_model(call, batch):
            return loss_value(probe.loss_func(batch, probe.call_model(call, batch)))

        profile = analyse_model(self.model, sample, run_model if probe.loss_func is not None else None)
        first = first_tensor(sample)
        if first is not None and first.dim() > 1:
            profile.tokens_per_sample = first[0].numel()
        if self.world > 1:
            run = (lambda model: probe.call_model(model, sample)) if sample is not None else None
            profile.layouts = keep_tensor_in_node(layout_facts(self.model, self.world, run), self.topology)
        return profile

    def _measured(self) -> MeasuredProfile:
        """The measurements and the search space as one picklable profile: the estimates read it, and
        ``atorch.plan.plan_measured`` given it (``SearchResult.measured``) predicts exactly the same."""
        space = self.space
        return MeasuredProfile(self.profile, self.hardware, dict(self.variants), self.world, self.topology, self.links,
                               self.per_rank_batch, str(space.device), frozenset(space.excluded), space.included)

    def _estimate(self, candidate: Candidate) -> Estimate:
        """The cost model's prediction from ``self.measured``: the one function ``atorch.plan`` shares."""
        return predict_measured(candidate, self.measured)

    def _setting_strategy(self, setting: Setting) -> Strategy:
        """The precision / checkpoint methods of a setting, normalised as a rank alone applies them
        (no ``resolve_strategy``: alone there is no process group to fit ``parallel_mode`` to)."""
        candidate = next(c for c in self.candidates if (c.precision, c.checkpoint) == setting)
        return Strategy([StrategyItem(item.name, opt_lib.get_optimization(item.name).normalize(item.config),
                                      item.tunable)
                         for item in candidate.strategy(1) if item.name in SETTING_METHODS])

    def _train_alone(self, strategy: Strategy, batch: int, kept: Optional[int] = None) -> tuple:
        """Train a copy of the model (cut to ``kept`` blocks; None: whole) alone at ``batch``."""
        try:
            model = copy.deepcopy(self.model) if kept is None else cut_copy(self.model, self.stack, kept)
        except ValueError as error:  # the same model on every rank: every rank refuses the cut alike
            return DryRunResult(False, error=str(error)), None
        ctx = self.make_context(model, local=True, batch_size=batch)
        del model
        try:
            # a piece is small, and its block's share is a difference of two pieces' times, which doubles
            # their noise, so pieces train more steps than a dry run
            steps = self.options.dryrun_steps if kept is None else PIECE_STEP_FACTOR * self.options.dryrun_steps
            return train_alone(ctx, strategy, steps, agree=False)  # this rank's own setting (``_measure_settings``)
        finally:
            del ctx
            release_host_memory()

    def _try(self, index: int) -> None:
        """Dry-run candidate ``index`` once and record the outcome in its row."""
        result = dry_run_candidate(self.model, self.make_context, self.candidates[index], self.options.dryrun_steps,
                                       self.options.collective_timeout_s)
        self.dry_runs[index] = result
        row = self.rows[index]
        if not result.ok:
            row.status, row.reason = "failed", result.error or ""
            return
        row.measured_memory, row.measured_time_s = result.peak_memory_bytes, result.step_time_s
        row.samples.append(result.step_time_s)
        row.spread_s = result.step_time_spread_s or 0.0
        row.status = "over memory limit" if result.peak_memory_bytes > self.hardware.memory_limit else "ok"

    def _out_of_time(self) -> bool:
        """Rank 0's clock decides: ranks that disagreed would stop at different candidates and hang."""
        limit = self.options.time_limit
        return broadcast_flag(limit is not None and time.perf_counter() - self.started > limit)

    def _say(self, message: str) -> None:
        if is_main_rank():  # every rank runs the same loop: one copy of the progress is enough
            logger.info(message)


def dry_run_candidate(model: torch.nn.Module, make_context: ContextFactory, candidate: Candidate, steps: int,
                      collective_timeout_s: float = DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S) -> DryRunResult:
    """Apply ``candidate`` to a fresh copy of ``model`` on every rank and train ``steps`` timed steps
    after one warm-up; a failure on any rank, applying or training, fails it on every rank (the
    work runs under ``run_isolated``, so the process group survives for the next candidate). The copy
    is a meta copy where the model's initialisers allow (``dry_run_copy``)."""
    ctx = make_context(dry_run_copy(model))
    setup = functools.partial(_apply_candidate, ctx, candidate)
    result = dry_run(ctx, warmup_steps=1, timed_steps=steps, setup=setup, collective_timeout_s=collective_timeout_s)
    del ctx, setup  # free this candidate's model and optimizer before the next one is built
    release_host_memory()
    return result


def _setting_text(setting: Setting) -> str:
    precision, checkpoint = setting
    return f"the {precision}{' checkpointed' if checkpoint else ''} setting alone"


def _setting_label(strategy: Strategy) -> str:
    """How the search's record names a setting: its methods (``fp32`` for none)."""
    return "+".join(strategy.names()) or "fp32"


def unchanged_by(result: DryRunResult, method: str) -> str:
    """Why ``method`` is not kept although it trained: it reported that it changed no module
    (module_replace's ``replaced`` is empty on every rank), or "" when it did change something."""
    report = result.extras.get(method)
    changed = not (isinstance(report, dict) and report.get("replaced") == {})
    return "" if all_ranks_true(changed) else "not added: changed no module"


def _spread(row: Row) -> float:
    """A row's measured noise: within one dry run's steps, or between its repeated dry runs."""
    between = statistics.stdev(row.samples) if len(row.samples) > 1 else 0.0
    return max(row.spread_s, between)


def _apply_candidate(ctx: Any, candidate: Candidate) -> None:
    apply_strategy(ctx, resolve_strategy(candidate.strategy(world_size())))


class _Phases:
    """Wall time per search phase, so a user (and the benchmark) can see where the time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

"""The method-to-context contract is explicit and true.

Each method declares its facts (``opt_lib/base.py``); the stage contract, the record-time facts, the
mesh dimensions and the exclusive groups are derived from the registry. Every declared fact is an
attribute of a fresh ModelContext; what each stage really reads and writes on a context, recorded
under several strategies, is within what its methods and the context declare; and a method defined
here, registered through the public call, is in every derived table and trains through
auto_accelerate without any other file changing.
"""
from __future__ import annotations

import fnmatch
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from atorch.auto import auto_accelerate, opt_lib
from atorch.auto.apply import _check_required_dims, apply_strategy, resolve_strategy
from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import data_parallel
from atorch.auto.opt_lib.compat import check_compatible
from atorch.auto.stages import CONTEXT_WORK, STAGES
from atorch.auto.strategy import Strategy, StrategyItem
from atorch.distributed.mesh import ParallelModeConfig
from atorch.errors import IncompatibleMethodsError, MethodConfigError
from atorch.models import GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing.launcher import run_distributed
from atorch.testing.training import build_gpt
from atorch.utils.config import MethodConfig, option

RECORD = "(record)"  # what transform does, before any stage runs
SAMPLE_CONFIGS = {"checkpoint": ("Linear",)}  # methods without a default config


def _sample_config(method):
    return method.normalize(SAMPLE_CONFIGS.get(method.name))


def _context(**kwargs) -> ModelContext:
    return ModelContext(torch.nn.Linear(2, 2), **kwargs)


def test_every_stage_has_one_contract_row_in_order():
    assert tuple(row.stage for row in opt_lib.stage_contract()) == STAGES


def test_every_fact_in_the_contract_is_a_declared_attribute():
    ctx = _context()
    names = {name for row in opt_lib.stage_contract() for name in row.reads + row.writes}
    names |= set(opt_lib.record_time_facts())
    missing = sorted(name for name in names if not hasattr(ctx, name))
    assert not missing, f"facts used by stages but not declared on ModelContext: {missing}"


def test_every_method_declares_known_stages_and_facts():
    ctx = _context()
    for method in opt_lib.registered_methods():
        assert set(method.stages) <= set(STAGES), method.name
        for declared in (method.reads, method.writes):
            if isinstance(declared, dict):
                assert set(declared) <= set(method.stages), method.name
        names = [n for stage in method.stages for n in sum(method.facts_at(stage), ())] + list(method.record_writes)
        assert all(hasattr(ctx, n) for n in names), (method.name, [n for n in names if not hasattr(ctx, n)])


def test_members_of_an_exclusive_group_give_the_same_reason():
    for group, members, why in opt_lib.exclusive_groups():
        reasons = {opt_lib.get_optimization(m).excludes[group] for m in members}
        assert reasons == {why}, (group, reasons)


def test_the_derived_rules_are_the_ones_that_were_hard_coded():
    """What apply.REQUIRED_DIMS and opt_lib/compat.py listed by name, now read off the methods."""
    assert opt_lib.required_dims() == {"tensor_parallel": ("tensor",), "sequence_parallel": ("tensor",),
                                       "pipeline_parallel": ("pipeline",), "mixed_parallel": ("tensor", "pipeline")}
    groups = {frozenset(members) for _, members, _ in opt_lib.exclusive_groups()}
    assert groups == {frozenset({"zero1", "zero2", "fsdp", "ds_3d_parallel"}),
                      frozenset({"tensor_parallel", "mixed_parallel", "ds_3d_parallel"}),
                      frozenset({"pipeline_parallel", "mixed_parallel", "ds_3d_parallel"}),
                      frozenset({"micro_batch", "pipeline_parallel", "mixed_parallel", "ds_3d_parallel"}),
                      # added after: FSDP2 sharding beside a pipeline schedule (measured wrong, refused)
                      frozenset({"fsdp", "zero2", "pipeline_parallel", "mixed_parallel"})}
    assert opt_lib.get_optimization("sequence_parallel").requires_one_of == ("tensor_parallel", "mixed_parallel")
    precise = [m.name for m in opt_lib.registered_methods() if m.precision(_sample_config(m)) is not None]
    assert precise == ["amp_native", "half"]
    with pytest.raises(IncompatibleMethodsError, match="zero2 and ds_3d_parallel cannot be combined: choose one"):
        check_compatible([("zero2", None), ("tensor_parallel", None), ("ds_3d_parallel", None)])


def test_a_method_registers_wrappers_only_at_its_declared_stages():
    for method in opt_lib.registered_methods():
        ctx = _context(optim_func=torch.optim.SGD, optim_args={"lr": 0.1})
        config = _sample_config(method)
        try:
            method.transform(ctx, config)
        except Exception:  # a backend missing here (DeepSpeed, TransformerEngine)
            if method.requirements(config) is None and method.name != "ds_3d_parallel":
                raise
            continue
        used = {stage for stage, entries in ctx.wrappers.items() for name, _ in entries if name == method.name}
        if ctx.data_parallel_wrapper is not None:
            used.add("data_parallel")
        if ctx.optimizer_factory is not None:
            used.add("optimizer")
        assert used <= set(method.stages), (method.name, used, method.stages)


def test_the_per_rank_batch_is_planned_once_from_the_global_batch():
    ctx = _context(dataloader_args={"batch_size": 12})
    assert ctx.global_batch_size == 12 and ctx.per_rank_batch_size is None
    ctx.plan_batches()  # one process: the data-parallel size is 1
    assert (ctx.data_parallel_size, ctx.per_rank_batch_size) == (1, 12)
    assert ctx.args.per_rank_batch_size == 12


def test_a_local_context_keeps_the_per_rank_batch_it_was_given():
    ctx = _context(dataloader_args={"batch_size": 12}, local=True, per_rank_batch_size=3)
    ctx.plan_batches()
    assert (ctx.global_batch_size, ctx.data_parallel_size, ctx.per_rank_batch_size) == (12, 1, 3)


# --- what the stages really touch ----------------------------------------------------------------------
class RecordingContext(ModelContext):
    """A ModelContext that records, per stage, which of its attributes are read and written:
    attribute access, plus in-place changes of ``args`` and ``sync_toggles`` between stages."""

    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_stage", None)
        object.__setattr__(self, "_seen", defaultdict(lambda: (set(), set())))
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_stage", RECORD)
        object.__setattr__(self, "_before", self._snapshot())

    def __getattribute__(self, name):
        if not name.startswith("_"):
            stage = object.__getattribute__(self, "_stage")
            if stage is not None and name in object.__getattribute__(self, "__dict__") and name != "wrappers":
                object.__getattribute__(self, "_seen")[stage][0].add(name)
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        stage = object.__getattribute__(self, "_stage")
        if stage is not None and not name.startswith("_"):
            self._seen[stage][1].add(name)
        object.__setattr__(self, name, value)

    def _snapshot(self):
        return repr(object.__getattribute__(self, "args")), len(object.__getattribute__(self, "sync_toggles"))

    def _enter(self, stage):
        after = self._snapshot()
        for name, before, now in zip(("args", "sync_toggles"), self._before, after):
            if before != now:
                self._seen[self._stage][1].add(name)
        object.__setattr__(self, "_before", after)
        object.__setattr__(self, "_stage", stage)

    def apply_wrappers(self):
        self._enter(None)  # moving the model to the device, before the first stage, is no stage's
        for stage in STAGES:
            self.wrappers[stage].insert(0, ("(recorder)", lambda ctx, stage=stage: ctx._enter(stage)))
        super().apply_wrappers()
        self._enter(None)


def _declared(names, stage):
    """(reads, writes) declared at ``stage`` by the methods named, the default data-parallel
    wrapper and the context."""
    reads, writes = set(), set()
    for name in names:
        r, w = opt_lib.get_optimization(name).facts_at(stage)
        reads |= set(r)
        writes |= set(w)
    if stage in data_parallel.STAGES:
        reads |= set(data_parallel.READS)
        writes |= set(data_parallel.WRITES)
    if stage in CONTEXT_WORK:
        reads |= set(CONTEXT_WORK[stage].reads)
        writes |= set(CONTEXT_WORK[stage].writes)
    return reads, writes


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, batch):
        return self.head(torch.relu(self.body(batch["x"])))


def _net_inputs() -> dict:
    return dict(model=Net(), dataset=[{"x": torch.randn(4), "y": torch.randn(1)} for _ in range(8)],
                loss_func=lambda batch, out: nn.functional.mse_loss(out, batch["y"]), dataloader_args={"batch_size": 4})


def _gpt_inputs() -> dict:
    return dict(model=build_gpt(0, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)),
                dataset=SyntheticTokenDataset(16, 16, 64), loss_func=gpt_loss, model_input_format="unpack_dict",
                dataloader_args={"batch_size": 4})


def _record(strategy, inputs=_net_inputs) -> dict:
    ctx = RecordingContext(optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                           lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1},
                           **inputs())
    resolved = resolve_strategy(Strategy(strategy))
    apply_strategy(ctx, resolved)
    return {"names": [item.name for item in resolved], "seen": dict(ctx._seen)}


def _check_recorded(recorded) -> None:
    names, seen = recorded["names"], recorded["seen"]
    record_writes = {fact for name in names for fact in opt_lib.get_optimization(name).record_writes}
    record_writes.add("data_parallel_wrapper")  # apply_strategy's default DDP, when no method claims the slot
    assert seen.get(RECORD, (set(), set()))[1] <= record_writes, (names, seen[RECORD][1] - record_writes)
    for stage in STAGES:
        reads, writes = seen.get(stage, (set(), set()))
        declared_reads, declared_writes = _declared(names, stage)
        assert writes <= declared_writes, f"{names}: stage {stage} writes {sorted(writes - declared_writes)} undeclared"
        undeclared = reads - declared_reads - declared_writes
        assert not undeclared, f"{names}: stage {stage} reads {sorted(undeclared)} undeclared"


@pytest.mark.parametrize("strategy", [
    [], ["amp_native"], [("half", "bf16")], [("checkpoint", ("Linear",))], ["module_replace"], ["native_dynamo"],
    [("micro_batch", 2)], ["amp_native", ("checkpoint", ("Linear",)), ("micro_batch", 2)],
], ids=lambda s: "+".join(i if isinstance(i, str) else i[0] for i in s) or "none")
def test_what_each_stage_touches_is_declared(strategy):
    _check_recorded(_record(strategy))


TP2 = ("parallel_mode", ([("tensor", 2)], None))
PP2 = ("parallel_mode", ([("pipeline", 2)], None))
TWO_RANK_STRATEGIES = [
    ([], _net_inputs), (["fsdp", "amp_native"], _net_inputs), (["zero1"], _net_inputs), (["zero2"], _net_inputs),
    ([("zero2", {"not_use_fsdp": True})], _net_inputs), ([TP2, "tensor_parallel"], _gpt_inputs),
    ([TP2, "tensor_parallel", "sequence_parallel"], _gpt_inputs),
    ([PP2, ("pipeline_parallel", {"num_micro_batch": 2})], _gpt_inputs),
]


def two_rank_records() -> list:
    return [_record(strategy, inputs) for strategy, inputs in TWO_RANK_STRATEGIES]


@pytest.mark.multirank
def test_what_each_stage_touches_is_declared_on_two_ranks():
    for records in run_distributed(two_rank_records, 2, timeout_s=300):
        for recorded in records:
            _check_recorded(recorded)


def test_the_recorder_sees_what_a_stage_does():
    seen = _record(["amp_native"])["seen"]
    assert {"loss_func", "optim", "args"} <= seen["amp"][1] and "model" in seen["amp"][0]  # forward patched in place
    assert {"dataloader", "lr_scheduler"} <= seen["dataloader"][1]
    assert {"data_parallel_size", "per_rank_batch_size"} <= seen["parallel_mode"][1]
    assert "amp_dtype" in seen[RECORD][1]


# --- a new method, in this file only --------------------------------------------------------------------
@dataclass(frozen=True)
class FreezeConfig(MethodConfig):
    patterns: tuple[str, ...] = option(("0.*",), doc="parameter-name globs to freeze")


class Freeze(opt_lib.Optimization):
    """A built-in-style method: its facts are declared, nothing else in the package names it."""

    name = "test_freeze"
    config_class = FreezeConfig
    stages = ("checkpoint",)
    reads = ("model",)
    excludes = {"test freezing": "freeze once"}

    def transform(self, ctx, config):
        def freeze(ctx):
            for name, param in ctx.model.named_parameters():
                if any(fnmatch.fnmatchcase(name, glob) for glob in config.patterns):
                    param.requires_grad_(False)

        ctx.add_wrapper("checkpoint", self.name, freeze)


class FreezeUnderAmp(Freeze):
    name = "test_freeze_amp"
    requires_one_of = ("amp_native",)


@pytest.fixture
def registered():
    methods = [opt_lib.register_optimization(Freeze), opt_lib.register_optimization(FreezeUnderAmp)]
    try:
        yield methods
    finally:
        for method in methods:
            opt_lib.unregister_optimization(method.name)


def test_a_registered_method_is_in_every_derived_table_and_trains(registered):
    row = next(r for r in opt_lib.stage_contract() if r.stage == "checkpoint")
    assert row.methods == ("checkpoint", "test_freeze", "test_freeze_amp")
    assert ("test freezing", ("test_freeze", "test_freeze_amp"), "freeze once") in opt_lib.exclusive_groups()
    _check_recorded(_record(["test_freeze", "amp_native"]))
    with pytest.raises(IncompatibleMethodsError, match="test_freeze and test_freeze_amp cannot be combined: freeze"):
        resolve_strategy(Strategy(["test_freeze", "test_freeze_amp"]))
    with pytest.raises(IncompatibleMethodsError, match=r"test_freeze_amp needs one of \['amp_native'\]"):
        resolve_strategy(Strategy(["test_freeze_amp"]))

    dataset = [{"x": torch.randn(4), "y": torch.randn(1)} for _ in range(16)]
    status, result, strategy = auto_accelerate(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), torch.optim.SGD, dataset,
        lambda batch, out: nn.functional.mse_loss(out, batch["y"]), optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 4}, prepare_input=lambda batch, device: batch,
        load_strategy=[("test_freeze_amp", {"patterns": ["0.*"]}), "amp_native"])
    assert status and [item.name for item in strategy] == ["test_freeze_amp", "amp_native"]
    frozen = [n for n, p in result.model.named_parameters() if not p.requires_grad]
    assert frozen and all(".0." in f".{n}" for n in frozen)
    batch = next(iter(result.dataloader))
    loss = result.loss_func(batch, result.model(batch["x"]))
    result.optim.backward(loss) if result.args["use_optim_backward"] else loss.backward()
    result.optim.step()


def test_the_mesh_check_reads_each_methods_declared_dims():
    data_only = StrategyItem("parallel_mode", ParallelModeConfig(dims=(("data", 2),)), True)
    items = [data_only, StrategyItem("mixed_parallel", None, True), StrategyItem("sequence_parallel", None, True)]
    with pytest.raises(MethodConfigError, match=r"mixed_parallel: needs the 'tensor' and 'pipeline' dimension\(s\) "
                       r"of parallel_mode above 1.*\(sequence_parallel too\)"):
        _check_required_dims(items, world_size=2)
    tensor = StrategyItem("parallel_mode", ParallelModeConfig(dims=(("tensor", 2),)), True)
    _check_required_dims([tensor, StrategyItem("tensor_parallel", None, True)], world_size=2)

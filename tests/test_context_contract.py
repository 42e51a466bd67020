"""The method-to-context contract is explicit: every fact a stage reads or writes is a declared
attribute of a fresh ModelContext, every stage has a row, and the per-rank batch is derived once."""
import torch

from atorch.auto.model_context import RECORD_TIME_FACTS, STAGE_CONTRACT, STAGES, ModelContext


def _context(**kwargs) -> ModelContext:
    return ModelContext(torch.nn.Linear(2, 2), **kwargs)


def test_every_stage_has_one_contract_row_in_order():
    assert tuple(row.stage for row in STAGE_CONTRACT) == STAGES


def test_every_fact_in_the_contract_is_a_declared_attribute():
    ctx = _context()
    names = {name for row in STAGE_CONTRACT for name in row.reads + row.writes} | set(RECORD_TIME_FACTS)
    missing = sorted(name for name in names if not hasattr(ctx, name))
    assert not missing, f"facts used by stages but not declared on ModelContext: {missing}"


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

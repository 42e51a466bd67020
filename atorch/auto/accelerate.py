"""auto_accelerate: the user-facing entry point (semi-automatic mode: ``load_strategy``)."""
from __future__ import annotations

import copy
import logging
from collections import namedtuple
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from atorch.auto.apply import apply_strategy, dry_run_strategy, resolve_strategy
from atorch.auto.model_context import ModelContext
from atorch.auto.search.options import SEARCH_KARGS, SearchOptions
from atorch.auto.search.planner import search
from atorch.auto.strategy import Strategy
from atorch.distributed.agreement import broadcast_flag, is_main_rank, is_multi_rank
from atorch.distributed.init import init_distributed
from atorch.errors import DryRunError, InputError, StrategyFileError

logger = logging.getLogger("atorch")

AutoAccelerateResult = namedtuple(
    "AutoAccelerateResult", ["model", "optim", "dataloader", "loss_func", "prepare_input", "lr_scheduler", "args"]
)
# the search's kargs (also ``verbose`` and ``dryrun_steps`` for semi-automatic mode) are validated,
# with their defaults, by SearchOptions.from_kargs; find_unused_parameters goes to DDP
KARGS = ("find_unused_parameters", *SEARCH_KARGS)


def auto_accelerate(
    model: torch.nn.Module,
    optim_func: Optional[Callable] = None,
    dataset: Optional[torch.utils.data.Dataset] = None,
    loss_func: Optional[Callable] = None,
    prepare_input: Optional[Callable] = None,
    model_input_format: Optional[str] = None,
    optim_args: Optional[dict] = None,
    optim_param_func: Optional[Callable] = None,
    dataloader_args: Optional[dict] = None,
    distributed_sampler_cls: Optional[type] = None,
    excluded: Optional[list] = None,
    included: Optional[list] = None,
    load_strategy: Any = None,
    lr_scheduler_cls: Optional[type] = None,
    lr_scheduler_args: Optional[dict] = None,
    finetune_strategy: bool = False,
    save_strategy_to_file: Optional[str] = None,
    ignore_dryrun_on_load_strategy: bool = True,
    **kargs: Any,
) -> tuple[bool, Optional[AutoAccelerateResult], Optional[Strategy]]:
    """Apply (semi-automatic) or find (fully automatic) a strategy; see the README for the contract.

    Returns ``(status, result, strategy)``; ``result`` holds the wrapped model, optimizer, dataloader,
    loss_func, prepare_input, lr_scheduler and ``args`` (how to drive them). Bad inputs raise typed
    errors (``atorch.errors``). A loaded strategy whose dry run fails raises ``DryRunError`` on every
    rank; a search in which no candidate trains within the limits returns ``(False, None, None)``
    and logs the report.
    """
    unknown = sorted(set(kargs) - set(KARGS))
    if unknown:
        raise InputError(f"unknown keyword argument(s) {unknown}; supported kargs: {list(KARGS)}")
    if kargs.get("verbose"):
        _enable_verbose_logging()
    init_distributed()

    def make_context(target: torch.nn.Module, local: bool = False, batch_size: Optional[int] = None) -> ModelContext:
        """A fresh context on ``target``; ``local=True`` measures this rank alone with a per-rank
        batch of ``batch_size`` (the search's single-rank profiles)."""
        return ModelContext(
            target, optim_func, dataset, loss_func, prepare_input, model_input_format, optim_args,
            optim_param_func, dataloader_args, distributed_sampler_cls, lr_scheduler_cls, lr_scheduler_args,
            find_unused_parameters=bool(kargs.get("find_unused_parameters", False)), local=local,
            per_rank_batch_size=batch_size,
        )

    ctx = make_context(model)  # checks the inputs before anything else happens
    if load_strategy is None or finetune_strategy:
        found = _search(model, make_context, load_strategy, finetune_strategy, excluded, included, kargs)
        if found.strategy is None:
            logger.error("auto_accelerate: no candidate strategy trained within the limits:\n%s", found.table)
            return False, None, None
        strategy = resolve_strategy(found.strategy, excluded=None)
        ctx.args.dryrun = found.dryrun
        ctx.args.extras["search"] = found
    else:
        strategy = resolve_strategy(Strategy.from_any(load_strategy), excluded=excluded)
        _log(f"auto_accelerate strategy:\n{strategy}")
        if not ignore_dryrun_on_load_strategy:
            options = SearchOptions.from_kargs(kargs)  # same checks and defaults as the search's
            report = dry_run_strategy(lambda: make_context(copy.deepcopy(model)), strategy, options.dryrun_steps,
                                      options.collective_timeout_s)
            _log(str(report))
            if not report.ok:
                raise DryRunError(f"the loaded strategy failed its dry run: {report.error}")
            ctx.args.dryrun = report

    if save_strategy_to_file:  # before the model is wrapped: a strategy that cannot be saved fails first
        _save(strategy, save_strategy_to_file)
    apply_strategy(ctx, strategy)
    result = AutoAccelerateResult(
        ctx.model, ctx.optim, ctx.dataloader, ctx.loss_func, ctx.prepare_input, ctx.lr_scheduler, ctx.args
    )
    return True, result, strategy


def _search(model, make_context, load_strategy, finetune_strategy, excluded, included, kargs):
    """Fully automatic mode; with finetune_strategy, the search is limited to the loaded strategy's
    non-tunable items (kept in every candidate) plus the searched dimensions for the tunable ones."""
    forced = Strategy(included or [])
    if finetune_strategy and load_strategy is not None:
        for item in Strategy.from_any(load_strategy):
            if item.name == "parallel_mode":
                continue
            if not item.tunable:
                forced = Strategy([*forced, (item.name, item.config)])
            elif item.name not in forced:
                forced = Strategy([*forced, item.name])
    return search(model, make_context, SearchOptions.from_kargs(kargs, excluded, forced))


def _save(strategy: Strategy, path: str) -> None:
    """Rank 0 saves (serialised and checked first, then an atomic replace: a failure leaves any
    previous file byte-identical); rank 0 then broadcasts the outcome, so on failure every rank
    raises the same StrategyFileError instead of waiting in a barrier for rank 0."""
    error, cause = None, None
    if is_main_rank():
        try:
            strategy.save(path)
        except StrategyFileError as failure:
            error, cause = str(failure), failure
        except Exception as failure:  # anything unforeseen must still reach every rank
            error, cause = f"cannot save strategy to {path!r}: {type(failure).__name__}: {failure}", failure
    if is_multi_rank() and not broadcast_flag(error is None):
        message = [error]
        dist.broadcast_object_list(message, src=0)
        error = message[0]
    if error is not None:
        raise StrategyFileError(f"save_strategy_to_file: {error}") from cause
    _log(f"strategy saved to {path}")


def _log(message: str) -> None:
    logger.info(message)


def _enable_verbose_logging() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[atorch %(levelname)s] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)

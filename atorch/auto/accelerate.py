"""auto_accelerate: the user-facing entry point (semi-automatic mode: ``load_strategy``)."""
from __future__ import annotations

import logging
import os
from collections import namedtuple
from typing import Any, Callable, Optional

import torch

from atorch.auto.apply import apply_strategy_together, dry_run_strategy, resolve_strategy
from atorch.auto.dryrun import dry_run_copy
from atorch.auto.model_context import ModelContext
from atorch.auto.search.options import SEARCH_KARGS, SearchOptions
from atorch.auto.search.strategy_search import search
from atorch.auto.strategy import Strategy
from atorch.checkpoint.agreement import main_rank_error
from atorch.distributed.agreement import is_main_rank
from atorch.distributed.init import init_from_launcher
from atorch.errors import DryRunError, InputError, StrategyFileError, nearest_name
from atorch.utils.batch import SampleRowsDataset, batch_size_of, loss_value
from atorch.utils.memory import collecting_only_new_objects

logger = logging.getLogger("atorch")

AutoAccelerateResult = namedtuple(
    "AutoAccelerateResult", ["model", "optim", "dataloader", "loss_func", "prepare_input", "lr_scheduler", "args"]
)
# the search's kargs (also ``verbose`` and ``dryrun_steps`` for semi-automatic mode) are validated,
# with their defaults, by SearchOptions.from_kargs; find_unused_parameters goes to DDP
KARGS = ("find_unused_parameters", "sample_batch", "batch_size", "loss_items", *SEARCH_KARGS)
# kargs that only the search reads: refused in semi-automatic mode rather than ignored
SEARCH_ONLY_KARGS = ("time_limit", "search_topk", "report_dir", "use_profile_cache", "search_exhaustive",
                     "ranks_per_node", "intra_node_bandwidth", "inter_node_bandwidth")
# kargs of semi-automatic mode's dry run: refused when the dry run is skipped rather than ignored
DRY_RUN_KARGS = ("dryrun_steps", "dryrun_collective_timeout", "memory_limit", "sample_batch", "batch_size")


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
    _check_arguments(load_strategy, excluded, included, finetune_strategy, save_strategy_to_file,
                     ignore_dryrun_on_load_strategy, kargs)
    searching = load_strategy is None or finetune_strategy
    options = SearchOptions.from_kargs(kargs, excluded, included if searching else None)  # every value, both modes
    if not searching:
        _refuse_unused_in_semi_automatic_mode(included, ignore_dryrun_on_load_strategy, kargs)
    trial_dataset, dataloader_args = _sample_batch_plan(kargs, dataset, dataloader_args, optim_func, loss_func,
                                                        options.dryrun_steps)
    if kargs.get("verbose"):
        _enable_verbose_logging()
    init_from_launcher()

    def make_context(target: torch.nn.Module, local: bool = False, batch_size: Optional[int] = None,
                     trial: bool = True) -> ModelContext:
        """A fresh context on ``target``; ``local=True`` measures this rank alone with a per-rank
        batch of ``batch_size`` (the search's single-rank profiles). Dry runs and the search train
        on ``sample_batch``'s rows when it is given (``trial``); the result's context does not."""
        return ModelContext(
            target, optim_func, trial_dataset if trial else dataset, loss_func, prepare_input=prepare_input,
            model_input_format=model_input_format, optim_args=optim_args, optim_param_func=optim_param_func,
            dataloader_args=dataloader_args, distributed_sampler_cls=distributed_sampler_cls,
            lr_scheduler_cls=lr_scheduler_cls, lr_scheduler_args=lr_scheduler_args,
            find_unused_parameters=bool(kargs.get("find_unused_parameters", False)), local=local,
            per_rank_batch_size=batch_size, loss_items=kargs.get("loss_items"),
        )

    if trial_dataset is not dataset:
        make_context(model)  # the sample's rows checked like a dataset, before anything else happens
    ctx = make_context(model, trial=False)  # checks the inputs before anything else happens
    if searching:
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
            report = dry_run_strategy(lambda: make_context(dry_run_copy(model)), strategy, options.dryrun_steps,
                                      options.collective_timeout_s)
            _log(str(report))
            if not report.ok:
                raise DryRunError(f"the loaded strategy failed its dry run: {report.error}")
            limit = options.memory_limit
            if limit is not None and report.peak_memory_bytes > limit:  # the peak is the max over ranks: all agree
                raise DryRunError(
                    f"the loaded strategy's dry run peaked at {report.peak_memory_bytes / 2**20:.1f} MiB per rank, "
                    f"above memory_limit={kargs['memory_limit']!r} ({limit / 2**20:.1f} MiB); raise memory_limit or "
                    "load a strategy that uses less memory (fsdp, checkpoint, amp_native)")
            ctx.args.dryrun = report

    if save_strategy_to_file:  # before the model is wrapped: a strategy that cannot be saved fails first
        _save(strategy, save_strategy_to_file)
    apply_strategy_together(ctx, strategy, options.collective_timeout_s)
    ctx.args.extras["strategy"] = strategy  # save_checkpoint records the strategy that ran
    checked_loss = None if ctx.loss_func is None else LossCheckedOnce(ctx.loss_func)
    result = AutoAccelerateResult(
        ctx.model, ctx.optim, ctx.dataloader, checked_loss, ctx.prepare_input, ctx.lr_scheduler, ctx.args
    )
    return True, result, strategy


def _check_arguments(load_strategy: Any, excluded: Any, included: Any, finetune_strategy: Any,
                     save_strategy_to_file: Any, ignore_dryrun: Any, kargs: dict) -> None:
    """The checks of auto_accelerate's own arguments that no other layer makes (the search options'
    values are SearchOptions.from_kargs's, the training inputs ModelContext's)."""
    unknown = sorted(set(kargs) - set(KARGS))
    if unknown:
        hints = []
        for name in unknown:
            close = nearest_name(name, KARGS)
            hints.append(f"{name!r}" + (f" (did you mean {close!r}?)" if close else ""))
        raise InputError(f"unknown keyword argument(s) {unknown}: {', '.join(hints)}; supported kargs: {list(KARGS)}")
    for name, value in (("finetune_strategy", finetune_strategy), ("ignore_dryrun_on_load_strategy", ignore_dryrun),
                        ("find_unused_parameters", kargs.get("find_unused_parameters", False))):
        if not isinstance(value, bool):
            raise InputError(f"{name}={value!r} is not valid: give True or False")
    for name, value in (("excluded", excluded), ("included", included)):
        if value is None:
            continue
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise InputError(f"{name} must be a list of method names, got {type(value).__name__}: {value!r}")
        for entry in value:
            if name == "excluded" and not isinstance(entry, str):
                raise InputError(f"excluded must be a list of method names (str), got the entry {entry!r}")
            if name == "included" and not (isinstance(entry, str) or (
                    isinstance(entry, (list, tuple)) and entry and isinstance(entry[0], str))):
                raise InputError(f"included must be a list of method names or (name, config) pairs, got the entry "
                                 f"{entry!r}")
    if finetune_strategy and load_strategy is None:
        raise InputError("finetune_strategy=True needs load_strategy: the search starts from the loaded strategy")
    if save_strategy_to_file is not None and not (
            isinstance(save_strategy_to_file, (str, os.PathLike)) and os.fspath(save_strategy_to_file)):
        raise InputError(f"save_strategy_to_file must be a file path (str or pathlib.Path; .json for JSON, any other "
                         f"suffix for a pickle) or None, got {save_strategy_to_file!r}")


def _sample_batch_plan(kargs: dict, dataset: Any, dataloader_args: Optional[dict], optim_func: Any,
                       loss_func: Any, dryrun_steps: int) -> tuple[Any, Optional[dict]]:
    """``sample_batch`` / ``batch_size`` (ATorch's kargs for a run without a dataset): (the dataset
    dry runs and the search train on, the dataloader_args every context gets). Without
    ``sample_batch``: (dataset, dataloader_args) unchanged. With it: the sample's rows repeated into
    a dataset of enough global batches of ``batch_size`` rows (default: the sample's rows, or
    dataloader_args['batch_size']) for every dry-run step; the result then has no dataloader."""
    sample, batch_size = kargs.get("sample_batch"), kargs.get("batch_size")
    if sample is None:
        if batch_size is not None:
            raise InputError("batch_size is the global batch of sample_batch's dry runs: give sample_batch with it, "
                             "or set dataloader_args['batch_size'] for a dataset")
        return dataset, dataloader_args
    if dataset is not None:
        raise InputError("sample_batch stands in for a dataset in dry runs and the search; with a dataset given, "
                         "drop sample_batch (the dataset's batches are used)")
    if optim_func is None or not callable(loss_func):
        raise InputError("sample_batch is trained on by dry runs and the search, which need optim_func and a callable "
                         "loss_func(batch, output): give both, or drop sample_batch")
    given = (dataloader_args or {}).get("batch_size") if isinstance(dataloader_args, dict) else None
    if batch_size is None:
        batch_size = given if given is not None else batch_size_of(sample)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int (the global batch of the dry runs), got {batch_size!r}")
    if given is not None and given != batch_size:
        raise InputError(f"batch_size={batch_size} and dataloader_args['batch_size']={given!r} disagree: give one")
    args = dict(dataloader_args) if isinstance(dataloader_args, dict) else {} if dataloader_args is None else None
    if args is None:
        raise InputError(f"dataloader_args must be a dict of DataLoader arguments, got {dataloader_args!r}")
    args["batch_size"] = batch_size
    return SampleRowsDataset(sample, batch_size * (dryrun_steps + 2)), args


def _refuse_unused_in_semi_automatic_mode(included: Any, ignore_dryrun: bool, kargs: dict) -> None:
    """Arguments that a loaded strategy (no search) would silently ignore are refused instead."""
    given = [name for name in kargs if kargs[name] is not None]
    if included:
        raise InputError(f"included={included!r} applies to the search only; with load_strategy (and "
                         "finetune_strategy=False) put the methods in load_strategy, or pass finetune_strategy=True")
    search_only = [name for name in SEARCH_ONLY_KARGS if name in given]
    if search_only:
        raise InputError(f"{search_only} apply to the search only (load_strategy=None, or finetune_strategy=True); "
                         "with load_strategy they would be ignored: drop them")
    dry_run_only = [name for name in DRY_RUN_KARGS if name in given]
    if ignore_dryrun and dry_run_only:
        bound = " (memory_limit then bounds its peak memory)" if "memory_limit" in dry_run_only else ""
        raise InputError(f"{dry_run_only} configure the dry run of the loaded strategy, which "
                         "ignore_dryrun_on_load_strategy=True skips: pass ignore_dryrun_on_load_strategy=False to "
                         f"dry-run it{bound}, or drop {dry_run_only}")


class LossCheckedOnce:
    """``result.loss_func``: the strategy's loss_func, whose FIRST value is checked to be a scalar
    tensor (or a list/tuple starting with one), so that a wrong loss is an InputError naming
    loss_func at the first step, not a raw autograd error. Every value is returned unchanged."""

    def __init__(self, loss_func: Callable):
        self.loss_func = loss_func
        self.checked = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        value = self.loss_func(*args, **kwargs)
        if not self.checked:
            if isinstance(value, (list, tuple)) and not value:
                raise InputError(f"loss_func must return a scalar tensor (or a list/tuple starting with one), got an "
                                 f"empty {type(value).__name__}")
            loss_value(value)  # InputError: "loss_func must return a scalar tensor ..."
            self.checked = True
        return value


@collecting_only_new_objects
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
    previous file byte-identical); rank 0's outcome then reaches every rank (``main_rank_error``),
    so on failure every rank raises the same StrategyFileError instead of waiting in a barrier."""
    error, cause = None, None
    if is_main_rank():
        try:
            strategy.save(path)
        except StrategyFileError as failure:
            error, cause = str(failure), failure
        except Exception as failure:  # anything unforeseen must still reach every rank
            error, cause = f"cannot save strategy to {path!r}: {type(failure).__name__}: {failure}", failure
    error = main_rank_error(error)
    if error is not None:
        raise StrategyFileError(f"save_strategy_to_file: {error}") from cause
    _log(f"strategy saved to {path}")


def _log(message: str) -> None:
    logger.info(message)


def _enable_verbose_logging() -> None:
    """atorch's own stderr handler; the "atorch" logger then stops propagating, so a program that
    already configured the root logger (``logging.basicConfig``) sees each line once, not twice."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[atorch %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO)

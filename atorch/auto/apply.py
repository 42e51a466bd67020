"""From a strategy to a wrapped model: validate it for this process layout, apply it, dry-run it.

Shared by both modes: semi-automatic mode applies the user's strategy, the search applies and
dry-runs its candidates the same way, so a strategy behaves identically whichever mode chose it.
"""
from __future__ import annotations

import functools
import gc
import logging
from typing import Callable, Optional

import torch.distributed as dist

from atorch.auto import opt_lib
from atorch.auto.dryrun import DryRunResult, dry_run
from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib import data_parallel
from atorch.auto.opt_lib.compat import check_compatible
from atorch.auto.strategy import Strategy, StrategyItem
from atorch.distributed import mesh
from atorch.distributed.agreement import is_multi_rank
from atorch.distributed.agreement import world_size as current_world_size
from atorch.distributed.fault import run_isolated
from atorch.distributed.shutdown import register_gil_release_at_exit
from atorch.distributed.timeouts import DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S
from atorch.errors import AtorchError, InputError, MethodConfigError, PeerRankError, RequirementError
from atorch.utils.memory import collecting_only_new_objects

logger = logging.getLogger("atorch")


def resolve_strategy(strategy: Strategy, excluded: Optional[list] = None) -> Strategy:
    """Validate names and configs for this process layout; returns the strategy that will run.

    Every config is validated, also those of distributed-only methods, which are then dropped
    (logged) in a single process (``check_structure``: there is no world size to fit them to). Under
    several ranks a missing mesh method (the one that ``provides_mesh``) is added with its defaults
    (data parallel over all ranks), and the ``mesh_dims`` each method declares must be in its
    config. Method names appear nowhere here: every rule is a fact a method declares.
    """
    world_size = current_world_size()
    distributed = dist.is_initialized()
    items: list[StrategyItem] = []
    checked: list[tuple[str, object]] = []  # every item, normalized (dropped ones too): compatibility
    dropped = []
    for item in strategy:
        method = opt_lib.get_optimization(item.name)
        if excluded and item.name in excluded:
            raise InputError(f"method {item.name!r} is both in load_strategy and in excluded")
        if method.distributed_only and not distributed:
            checked.append((item.name, method.check_structure(item.config)))  # no world size to fit it to
            dropped.append(item.name)
            continue
        config = method.normalize(item.config)
        checked.append((item.name, config))
        reason = method.requirements(config)
        if reason:
            if method.ignored_when_unavailable:
                logger.warning("%s is ignored: %s", item.name, reason)
                continue
            raise RequirementError(f"{item.name} cannot run here: {reason}")
        items.append(StrategyItem(item.name, config, item.tunable))
    check_compatible(checked)
    if dropped:
        logger.warning("single process: dropping distributed-only method(s) %s", dropped)
    mesh_method = _mesh_method()
    if distributed and world_size > 1 and mesh_method.name not in [i.name for i in items]:
        logger.info("%d ranks and no %s in the strategy: adding data parallel over all ranks", world_size,
                    mesh_method.name)
        items.insert(0, StrategyItem(mesh_method.name, mesh_method.normalize(None), True))
    _log_parallel_adjustment(strategy, items, world_size)
    if distributed and world_size > 1:
        _check_required_dims(items, world_size)
    check_compatible([(i.name, i.config) for i in items])
    return Strategy(items)


def _mesh_method() -> opt_lib.Optimization:
    """The registered method whose config is the device mesh (``provides_mesh``)."""
    return next(m for m in opt_lib.registered_methods() if m.provides_mesh)


def _check_required_dims(items: list[StrategyItem], world_size: int) -> None:
    """Each method's declared ``mesh_dims`` must be above 1 in the mesh method's config."""
    layout = next(i.config for i in items if i.name == _mesh_method().name)
    needed = opt_lib.required_dims()
    lacking = {item.name: [d for d in needed.get(item.name, ()) if layout.size(d) <= 1] for item in items}
    lacking = {name: dims for name, dims in lacking.items() if dims}
    if lacking:
        (first, missing), *others = lacking.items()
        also = f" ({', '.join(name for name, _ in others)} too)" if others else ""
        raise MethodConfigError(first, _mesh_method().missing_dims_message(missing, list(layout.dims), world_size)
                                + also)


def apply_strategy(ctx: ModelContext, strategy: Strategy) -> ModelContext:
    """Record every method's wrappers (DDP when no method claims data parallelism), then apply
    them in the canonical order of ``STAGES``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        register_gil_release_at_exit()  # gloo: no abort at exit after collectives on Python-owned tensors
    for item in strategy:
        opt_lib.get_optimization(item.name).transform(ctx, item.config)
    if ctx.data_parallel_wrapper is None:
        ctx.set_data_parallel_wrapper(data_parallel.NAME, data_parallel.wrap_data_parallel)
    ctx.apply_wrappers()
    return ctx


def apply_strategy_together(ctx: ModelContext, strategy: Strategy,
                            collective_timeout_s: float = DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S) -> ModelContext:
    """``apply_strategy`` for the run the user gets, on every rank at once.

    Applying runs collectives (FSDP's and DDP's set-up, the tensor plan's check on a sample). When
    one rank raises there while its peers wait inside one, ``run_isolated`` ends every rank within
    ``collective_timeout_s``: a rank that refused (an atorch error) or failed first re-raises its own
    error, the others raise ``PeerRankError`` with the first failure's reason, and the process group
    stays usable. A success costs one small all-reduce."""
    if not is_multi_rank():
        return apply_strategy(ctx, strategy)
    raised: list[BaseException] = []

    def work() -> None:
        try:
            apply_strategy(ctx, strategy)
        except Exception as error:
            raised.append(error)
            raise

    outcome = run_isolated(work, collective_timeout_s)
    if outcome.ok:
        return ctx
    if raised and (outcome.failed_rank == dist.get_rank() or isinstance(raised[0], AtorchError)):
        raise raised[0]  # its own refusal (on every rank when all refused alike), or the first failure
    raise PeerRankError(f"applying the strategy failed on rank {outcome.failed_rank}: {outcome.error}",
                        failed_rank=outcome.failed_rank)


@collecting_only_new_objects
def dry_run_strategy(make_context: Callable[[], ModelContext], strategy: Strategy, steps: int,
                     collective_timeout_s: float = DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S) -> DryRunResult:
    """Dry-run on a fresh context (a copy of the model) so the user's model and optimizer stay
    untouched; applying the strategy is part of the isolated work, so a rank-local failure there
    (inside FSDP's or DDP's set-up collectives) fails every rank cleanly too."""
    ctx = make_context()
    result = dry_run(ctx, warmup_steps=1, timed_steps=steps, setup=functools.partial(apply_strategy, ctx, strategy),
                     collective_timeout_s=collective_timeout_s)
    del ctx  # the copy and its optimizer state go before the real run is built
    gc.collect()
    return result


def _log_parallel_adjustment(original: Strategy, items: list[StrategyItem], world_size: int) -> None:
    name = _mesh_method().name
    given = original.get(name)
    final = next((i.config for i in items if i.name == name), None)
    if given is not None and final is not None and mesh.parse_parallel_config(given).dims != final.dims:
        logger.warning("%s %s adjusted to %s for world size %d", name, given, final, world_size)

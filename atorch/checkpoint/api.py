"""``save_checkpoint`` and ``load_checkpoint``: the training state under any strategy, as one directory.

A save reads the model's tensors (``tensors.py``) and the optimizer's (``optimizer_state.py``), has
every process write its shards with DCP, then the RNG files, then process 0 the metadata
(``train_state.py``) and the rename into place (``files.py``). Every step ends with an agreement
(``agreement.py``), so a failure on one process raises on all. ``async_save=True`` hands the same
write to a thread (``async_save.py``). A load reads the metadata, the tensors in place (resharded
by DCP, through ``SafeFileSystemReader``), then each process's own state.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name

from atorch.auto.strategy import Strategy
from atorch.checkpoint.agreement import agree, agreed_tmp_dir, attempt, gather, on_every_rank
from atorch.checkpoint.async_save import PendingSave, start_background, wait_for_checkpoint
from atorch.checkpoint.files import META_FILE, RNG_DIR, check_path, replace_dir, resolve_checkpoint, write_json
from atorch.checkpoint.optimizer_state import (
    OptimizerView,
    load_optimizer,
    optimizer_destinations,
    optimizer_state_tensors,
)
from atorch.checkpoint.safe_load import SafeFileSystemReader
from atorch.checkpoint.tensors import (
    host_copy,
    in_saved_order,
    into_live_order,
    model_tensors,
    param_names,
    saved_order_destinations,
    saved_orders,
)
from atorch.checkpoint.train_state import (
    check_extra,
    check_model_keys,
    check_step,
    check_unexpected_keys,
    local_metadata,
    merge,
    metadata,
    read_meta,
    read_rng,
    restore_dataloader,
    rng_state,
    scheduler_of,
    set_rng_state,
)
from atorch.distributed.agreement import is_main_rank
from atorch.errors import AtorchError, CheckpointError

if TYPE_CHECKING:  # the result type lives in the entry point's layer
    from atorch.auto.accelerate import AutoAccelerateResult


# --- save --------------------------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike, result: "AutoAccelerateResult", step: Optional[int] = None,
                    extra: Optional[dict] = None, *, lr_scheduler: Any = None,
                    async_save: bool = False) -> Optional[PendingSave]:
    """Save the training state of ``result`` to the directory ``path`` (collective: every process calls it).

    Saved: the model, the optimizer state, the grad scaler (amp fp16), ``result.lr_scheduler`` or the
    ``lr_scheduler`` given here, the strategy, ``step``, ``extra`` (a JSON-serialisable dict), every
    process's RNG states and the dataloader position. Each process writes its own shards. Written to
    ``<path>.tmp-<id>`` and renamed to ``path`` when complete: an earlier checkpoint at ``path`` stays
    loadable until then. Raises CheckpointError (on every process) when something cannot be saved.

    ``async_save=True`` returns as soon as the tensors are copied to host memory, with a
    ``PendingSave``: a background thread writes the files and renames them into place as a
    synchronous save does, so training goes on meanwhile. The next ``save_checkpoint`` /
    ``load_checkpoint``, ``wait_for_checkpoint()`` and the end of the process wait for it, and raise
    its CheckpointError.
    """
    wait_for_checkpoint()
    target = check_path(path, "save_checkpoint")
    extra = check_extra(extra)
    check_step(step)
    scheduler = scheduler_of(result, lr_scheduler, "save_checkpoint")
    tensors, model, view, merged = _collect(result)
    meta, rng = on_every_rank(lambda: (metadata(result, step, extra, view, scheduler, merged),
                                       rng_state(result.dataloader)))  # local: must not leave the others waiting
    tmp = agreed_tmp_dir(target)
    if async_save:
        staged = on_every_rank(lambda: {k: host_copy(v) for k, v in tensors.items()})  # training changes the live ones
        return start_background(target, lambda group: write(tmp, staged, meta, rng, target, group))
    write(tmp, tensors, meta, rng, target)
    return None


def _collect(result: Any) -> tuple[dict, dict, Optional[OptimizerView], dict]:
    """(the tensors to save by key, the model's by name, the optimizer view, every rank's metadata
    merged); collective."""
    def prepare() -> tuple:
        model = model_tensors(result.model)
        view = OptimizerView(result.optim) if result.optim is not None else None
        return model, param_names(model), view

    model, names, view = on_every_rank(prepare)
    optim = on_every_rank(lambda: optimizer_state_tensors(view, names) if view is not None else {})
    local = on_every_rank(lambda: local_metadata(model, optim, view, names))
    tensors = {f"model/{k}": v for k, v in model.items()}
    tensors.update(optim)
    tensors = in_saved_order(tensors, model, saved_orders(result.model))  # collective where an order applies
    return tensors, model, view, merge(gather(local))


def write(tmp: str, tensors: dict, meta: dict, rng: dict, target: str,
          group: Optional[dist.ProcessGroup] = None) -> None:
    """DCP shards from every process, then the rng files, then (process 0) the metadata and the
    rename. Every phase ends with an agreement, so a failure on one process raises on all. Every
    collective runs on ``group`` (the default group when None)."""
    agree(attempt(lambda: os.makedirs(os.path.join(tmp, RNG_DIR), exist_ok=True)), "save_checkpoint: creating", tmp,
          group=group)
    try:
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True), process_group=group)
    except (Exception, CheckpointException) as error:  # DCP raises the same CheckpointException on every rank
        raise CheckpointError(f"save_checkpoint: writing the shards to {tmp!r} failed: {error}") from error
    rank = dist.get_rank() if dist.is_initialized() else 0
    agree(attempt(lambda: write_json(os.path.join(tmp, RNG_DIR, f"rank-{rank}.json"), rng)), "writing rng to", tmp,
          group=group)
    error = None
    if is_main_rank():
        error = attempt(lambda: (write_json(os.path.join(tmp, META_FILE), meta), replace_dir(tmp, target)))
    agree(error, "save_checkpoint: writing the metadata and renaming into place", target, only_main=True, group=group)


# --- load --------------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike, result: "AutoAccelerateResult", *, lr_scheduler: Any = None,
                    strict: bool = True) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` into ``result`` (collective), under any
    strategy and number of processes. Returns ``{"step", "extra", "strategy", "world_size"}``.

    The model's weights and the optimizer state are loaded in place (resharded as needed); the
    optimizer's hyperparameters, the grad scaler, the lr scheduler (``result.lr_scheduler`` or
    ``lr_scheduler``), the RNG states and the dataloader position are restored. Call it before
    iterating ``result.dataloader``: the next epoch iterator continues where the saved one stopped.
    ``strict=False`` leaves model keys missing from the checkpoint as they are (optimizer state of
    such parameters too). CheckpointError names the first key that does not fit.
    """
    wait_for_checkpoint()
    target = check_path(path, "load_checkpoint")
    source, meta = on_every_rank(lambda: _found(target))
    scheduler = scheduler_of(result, lr_scheduler, "load_checkpoint")

    def prepare() -> tuple:
        model = model_tensors(result.model)
        check_model_keys(model, meta, strict, source)
        names = param_names(model)
        view = OptimizerView(result.optim) if result.optim is not None else None
        return model, names, view, optimizer_destinations(view, names, meta) if view is not None else {}

    model, names, view, optim_targets = on_every_rank(prepare)
    check_unexpected_keys(model, meta, strict, source)
    optim_targets = _read_tensors(source, result, meta, model, optim_targets)
    if view is not None and view.partitions is not None:
        view.partitions.sync_master_weights()
    # the rest is local: agreed, so that no process trains on while another has failed
    on_every_rank(lambda: _restore_local_state(result, source, meta, view, names, optim_targets, scheduler))
    strategy = Strategy.from_json(meta["strategy"]) if meta.get("strategy") else None
    return {"step": meta.get("step"), "extra": meta.get("extra"), "strategy": strategy,
            "world_size": meta.get("world_size")}


def _found(target: str) -> tuple[str, dict]:
    """(the checkpoint directory to read, its metadata)."""
    source = resolve_checkpoint(target)
    return source, read_meta(source)


def _read_tensors(source: str, result: Any, meta: dict, model: dict, optim_targets: dict) -> dict:
    """DCP reads the model's tensors in place and the optimizer state into ``optim_targets``
    (collective); returns ``optim_targets`` with state kept in another order converted."""
    orders = saved_orders(result.model)
    destinations = {f"model/{k}": v for k, v in model.items() if k in meta["model"]}
    destinations.update({key: tensor for key, (tensor, _, _) in optim_targets.items()})
    reordered = saved_order_destinations(destinations, model, orders)
    destinations.update(reordered)
    try:
        with torch.no_grad():
            dcp.load(destinations, storage_reader=SafeFileSystemReader(source))
    except AtorchError:
        raise
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"load_checkpoint: reading the tensors of {source!r} failed: {error}") from error
    return into_live_order(reordered, model, orders, optim_targets)


def _restore_local_state(result: Any, source: str, meta: dict, view: Optional[OptimizerView],
                         names: dict[int, str], optim_targets: dict, scheduler: Any) -> None:
    """Optimizer state and hyperparameters, grad scaler, lr scheduler, RNG states and the dataloader
    position: what each process restores on its own once the tensors are read."""
    if view is not None:
        load_optimizer(view, names, meta, optim_targets)
        if view.scaler is not None and meta.get("scaler"):
            view.scaler.load_state_dict(meta["scaler"])
    if scheduler is not None and meta.get("lr_scheduler") is not None:
        scheduler.load_state_dict(meta["lr_scheduler"])
    rng = read_rng(source, meta)
    if rng is not None:
        set_rng_state(rng)
    restore_dataloader(result.dataloader, meta, rng)

"""The canonical stage order, and what the context itself does at each stage.

Methods declare their own facts (their stages, what their wrappers read and write on the context:
``atorch/auto/opt_lib/base.py``); the contract of a stage is the context's own work there plus the
declarations of the methods registered at it, assembled by the registry
(``atorch.auto.opt_lib.stage_contract()``). This module names no method.
"""
from __future__ import annotations

from typing import NamedTuple

# The canonical wrapper order (one list, in one place).
STAGES = (
    "parallel_mode",    # build the device mesh; then the batch plan (data-parallel size, per-rank batch)
    "module_replace",
    "fp8",
    "half",
    "pipeline",         # cut into pipeline stages (before tensor parallel splits the stage's layers)
    "model_parallel",   # tensor parallelism (split layers)
    "checkpoint",
    "data_parallel",    # the data-parallel wrapper a method claims, or DDP (the default)
    "compile",          # torch.compile, after the parallel wrappers
    "optimizer",        # build the optimizer (a method's optimizer_factory when one is set)
    "amp",              # autocast + grad scaler
    "micro_batch",      # one call runs the per-rank batch as micro-steps (wraps the finished model / loss / optim)
    "dataloader",
)


class StageContract(NamedTuple):
    """One stage: who acts there (methods, the default data-parallel wrapper, the context) and the
    context attributes they read and write."""

    stage: str
    methods: tuple[str, ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]


class StageWork(NamedTuple):
    """What the context itself does at a stage, after that stage's wrappers: the ``ModelContext``
    method it runs, and what that reads and writes."""

    step: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]


CONTEXT_WORK = {
    "parallel_mode": StageWork("plan_batches", ("local", "dataset", "global_batch_size", "per_rank_batch_size"),
                               ("data_parallel_size", "per_rank_batch_size", "args")),
    "data_parallel": StageWork("_wrap_data_parallel", ("local", "data_parallel_wrapper", "meta_init", "model",
                                                       "device"),
                               ("meta_init", "materialized")),
    "optimizer": StageWork("_build_optimizer",
                           ("model", "optim_func", "optim_args", "optim_param_func", "optimizer_factory",
                            "sync_toggles", "settlers", "grad_partition_group", "backward_in_forward"),
                           ("optim", "raw_optim")),
    # and, after the last stage, _build_lr_scheduler, _route_torch_clipping (the final model and optimizer) and
    # _weigh_loss_items (the final loss_func, weighted over the data-parallel ranks unless a method weighs it)
    "dataloader": StageWork("_build_dataloader",
                            ("local", "dataset", "dataloader_args", "distributed_sampler_cls", "global_batch_size",
                             "per_rank_batch_size", "data_parallel_size", "lr_scheduler_cls", "lr_scheduler_args",
                             "raw_optim", "model", "optim", "loss_func", "loss_items", "items_weighted", "device"),
                            ("dataloader", "lr_scheduler", "loss_func")),
}

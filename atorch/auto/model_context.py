"""ModelContext: what the user gave, the facts methods share, and the build of the results.

Methods never call each other. A method's ``transform`` (record time) writes facts and registers
wrappers on the context; ``apply_wrappers`` (apply time) runs the wrappers in the one canonical
order of ``STAGES``. Every fact one method leaves for another is a declared attribute of
``ModelContext`` below, and ``STAGE_CONTRACT`` lists, per stage, what its wrappers read and write;
``docs/architecture.md`` shows the same table.
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from atorch.errors import IncompatibleMethodsError, InputError
from atorch.distributed import mesh
from atorch.auto.optimizer import AtorchOptimizer
from atorch.utils.batch import cast_floating, move_to_device

logger = logging.getLogger(__name__)

# The canonical wrapper order (one list, in one place).
STAGES = (
    "parallel_mode",    # build the device mesh; then the batch plan (data-parallel size, per-rank batch)
    "module_replace",
    "fp8",
    "half",
    "pipeline",         # cut into pipeline stages (before tensor parallel splits the stage's layers)
    "model_parallel",   # tensor / mixed parallel
    "checkpoint",
    "data_parallel",    # fsdp / zero2 / DDP (the default data-parallel wrapper)
    "compile",          # native_dynamo, after the parallel wrappers
    "optimizer",        # build the optimizer (zero1 swaps its factory)
    "amp",              # autocast + grad scaler
    "dataloader",
)


class StageContract(NamedTuple):
    stage: str
    methods: tuple[str, ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]


# What the wrappers of each stage read from and write to the context (apply time). Record-time
# facts (written by ``transform`` before any stage runs) are listed under ``RECORD_TIME_FACTS``.
STAGE_CONTRACT = (
    StageContract("parallel_mode", ("parallel_mode",), ("device", "global_batch_size", "local"),
                  ("data_parallel_size", "per_rank_batch_size")),
    StageContract("module_replace", ("module_replace",), ("model", "device", "amp_dtype", "half_dtype"), ("model",)),
    StageContract("fp8", ("fp8",), ("model",), ("model",)),
    StageContract("half", ("half",), ("model",), ("model", "input_dtype")),
    StageContract("pipeline", ("pipeline_parallel", "mixed_parallel"),
                  ("model", "loss_func", "model_input_format", "amp_dtype", "per_rank_batch_size", "device"),
                  ("model", "loss_func", "model_parallel", "backward_in_forward", "grad_partition_group", "args")),
    StageContract("model_parallel", ("tensor_parallel", "mixed_parallel"), ("model", "sequence_parallel"),
                  ("model", "model_parallel")),
    StageContract("checkpoint", ("checkpoint",), ("model",), ("model",)),
    StageContract("data_parallel", ("fsdp", "zero2", "zero1 (DeepSpeed)", "ds_3d_parallel", "ddp (default)"),
                  ("model", "device", "amp_dtype", "half_dtype", "model_parallel", "find_unused_parameters",
                   "per_rank_batch_size", "data_parallel_wrapper", "local"),
                  ("model", "sync_toggles", "grad_partition_group", "args")),
    StageContract("compile", ("native_dynamo",), ("model",), ("model",)),
    StageContract("optimizer", ("context; zero1 / DeepSpeed through optimizer_factory",),
                  ("model", "optim_func", "optim_args", "optim_param_func", "optimizer_factory", "sync_toggles",
                   "grad_partition_group", "backward_in_forward", "per_rank_batch_size", "amp_dtype"),
                  ("optim", "raw_optim", "model", "loss_func", "args")),
    StageContract("amp", ("amp_native",), ("model", "loss_func", "optim", "amp_dtype", "device"),
                  ("model", "loss_func", "optim", "args")),
    StageContract("dataloader", ("context",),
                  ("dataset", "dataloader_args", "distributed_sampler_cls", "per_rank_batch_size",
                   "data_parallel_size"), ("dataloader", "args")),
)

# Facts a method's transform writes at record time, so that wrappers of other stages can read them.
RECORD_TIME_FACTS = {
    "amp_dtype": "amp_native",
    "half_dtype": "half",
    "sequence_parallel": "sequence_parallel",
    "optimizer_factory": "zero1, zero2 (not_use_fsdp), DeepSpeed ZeRO, ds_3d_parallel",
    "data_parallel_wrapper": "fsdp, zero2, DeepSpeed ZeRO, ds_3d_parallel (ddp when none claims it)",
    "backward_in_forward": "ds_3d_parallel",
    "args": "DeepSpeed ZeRO, ds_3d_parallel (use_optim_backward)",
}

MODEL_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict")
Wrapper = Callable[["ModelContext"], None]


@dataclass
class TrainingArgs:
    """``result.args``: how the user's loop must drive what auto_accelerate returns."""

    use_optim_backward: bool = False
    requires_set_gradient_accumulation_boundary: bool = False
    model_input_format: Optional[str] = None
    data_parallel_size: int = 1
    per_rank_batch_size: Optional[int] = None
    dryrun: Any = None  # DryRunResult when a dry run ran (step time, peak memory)
    extras: dict = field(default_factory=dict)


class ModelContext:
    """Everything auto_accelerate works on, before and after the strategy is applied.

    Attributes, by who writes them:

    Given by the user (read by methods, never replaced except ``model`` / ``loss_func``, which
    wrappers wrap): ``model``, ``optim_func``, ``optim_args``, ``optim_param_func``, ``dataset``,
    ``dataloader_args``, ``distributed_sampler_cls``, ``loss_func``, ``user_prepare_input``,
    ``model_input_format``, ``lr_scheduler_cls``, ``lr_scheduler_args``, ``find_unused_parameters``.

    The batch plan, computed once: ``global_batch_size`` (``dataloader_args['batch_size']``, the
    batch of one optimizer step over all ranks); after the mesh exists, ``data_parallel_size`` and
    ``per_rank_batch_size`` (``global_batch_size / data_parallel_size``). With ``local=True`` (the
    search measuring one rank alone) there is no data-parallel wrapper and the per-rank batch is the
    one given.

    Facts methods share (see ``STAGE_CONTRACT`` and ``RECORD_TIME_FACTS``): ``device``,
    ``amp_dtype``, ``half_dtype``, ``input_dtype``, ``sequence_parallel``, ``model_parallel``,
    ``backward_in_forward``, ``grad_partition_group``, ``sync_toggles``, ``optimizer_factory``,
    ``data_parallel_wrapper``.

    Results: ``optim`` (what the user steps), ``raw_optim`` (the torch optimizer inside it),
    ``dataloader``, ``lr_scheduler``, ``args`` (``result.args``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim_func: Optional[Callable] = None,
        dataset: Optional[Dataset] = None,
        loss_func: Optional[Callable] = None,
        prepare_input: Optional[Callable] = None,
        model_input_format: Optional[str] = None,
        optim_args: Optional[dict] = None,
        optim_param_func: Optional[Callable] = None,
        dataloader_args: Optional[dict] = None,
        distributed_sampler_cls: Optional[type] = None,
        lr_scheduler_cls: Optional[type] = None,
        lr_scheduler_args: Optional[dict] = None,
        find_unused_parameters: bool = False,
        device: Optional[torch.device] = None,
        local: bool = False,
        per_rank_batch_size: Optional[int] = None,
    ):
        # given by the user
        self.model = model
        self.optim_func = optim_func
        self.dataset = dataset
        self.loss_func = loss_func
        self.user_prepare_input = prepare_input
        self.model_input_format = model_input_format
        self.optim_args = dict(optim_args or {})
        self.optim_param_func = optim_param_func
        self.dataloader_args = dict(dataloader_args or {})
        self.distributed_sampler_cls = distributed_sampler_cls
        self.lr_scheduler_cls = lr_scheduler_cls
        self.lr_scheduler_args = dict(lr_scheduler_args or {})
        self.find_unused_parameters = find_unused_parameters
        self.device: torch.device = device or default_device()
        self.local = local  # this process alone: the search's single-rank measurement

        # the batch plan
        self.global_batch_size: int = self.dataloader_args.get("batch_size", 1)
        self.data_parallel_size: int = 1
        self.per_rank_batch_size: Optional[int] = per_rank_batch_size  # set by plan_batches() unless given

        # facts methods share
        self.wrappers: dict[str, list[tuple[str, Wrapper]]] = defaultdict(list)
        self.data_parallel_wrapper: Optional[tuple[str, Wrapper]] = None
        self.optimizer_factory: Optional[Callable[["ModelContext", Any], Any]] = None
        self.input_dtype: Optional[torch.dtype] = None  # half: floating inputs are cast to it
        self.amp_dtype: Optional[torch.dtype] = None  # amp_native; sharding picks its mixed-precision policy from it
        self.half_dtype: Optional[torch.dtype] = None  # half; module_replace checks its pairs' dtypes against it
        self.sequence_parallel = False  # sequence_parallel; tensor_parallel reads it
        self.model_parallel = False  # tensor / pipeline parallel: parameters are DTensors or stage-local
        self.backward_in_forward = False  # pipeline schedules run backward inside model(...)
        self.grad_partition_group: Any = None  # ranks hold disjoint gradient shares (clipping reduces over it)
        self.sync_toggles: list[Callable[[bool], None]] = []  # gradient sync on/off (accumulation)
        self.args = TrainingArgs(model_input_format=model_input_format)

        # results
        self.optim: Any = None
        self.raw_optim: Optional[torch.optim.Optimizer] = None
        self.dataloader: Optional[DataLoader] = None
        self.lr_scheduler: Any = None
        self.check_inputs()

    # --- input checks ------------------------------------------------------------------------
    def check_inputs(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise InputError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if self.model_input_format not in MODEL_INPUT_FORMATS:
            raise InputError(
                f"model_input_format={self.model_input_format!r} is not valid; choose one of {list(MODEL_INPUT_FORMATS)}"
            )
        if self.optim_func is not None and not callable(self.optim_func):
            raise InputError("optim_func must be callable: an optimizer class or fn(parameters, **optim_args)")
        if self.dataset is not None:
            if not isinstance(self.dataset, (Dataset, IterableDataset)) and not (
                hasattr(self.dataset, "__getitem__") and hasattr(self.dataset, "__len__")
            ):
                raise InputError(f"dataset must be a torch Dataset, got {type(self.dataset).__name__}")
            if self.loss_func is None or not callable(self.loss_func):
                raise InputError(
                    "a dataset was given but loss_func is not callable: auto_accelerate needs "
                    "loss_func(input, output) -> loss to run (and dry-run) training steps"
                )
        for name in ("prepare_input", "optim_param_func"):
            value = self.user_prepare_input if name == "prepare_input" else self.optim_param_func
            if value is not None and not callable(value):
                raise InputError(f"{name} must be callable, got {type(value).__name__}")
        if self.lr_scheduler_cls is not None and self.optim_func is None:
            raise InputError("lr_scheduler_cls needs optim_func: a scheduler wraps the optimizer")
        batch_size = self.dataloader_args.get("batch_size", 1)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise InputError(f"dataloader_args['batch_size'] must be a positive int, got {batch_size!r}")

    # --- recording ---------------------------------------------------------------------------
    def add_wrapper(self, stage: str, method: str, wrapper: Wrapper) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown wrapper stage {stage!r}; stages: {STAGES}")
        self.wrappers[stage].append((method, wrapper))

    def set_data_parallel_wrapper(self, method: str, wrapper: Wrapper) -> None:
        """Claim the data-parallel slot (fsdp, zero2, ...) instead of the default DDP."""
        if self.data_parallel_wrapper is not None:
            raise IncompatibleMethodsError(
                f"{method} and {self.data_parallel_wrapper[0]} both want to wrap the model for data parallelism; keep one"
            )
        self.data_parallel_wrapper = (method, wrapper)

    # --- applying ----------------------------------------------------------------------------
    def apply_wrappers(self) -> None:
        self.model.to(self.device)
        for stage in STAGES:
            for method, wrapper in self.wrappers.get(stage, []):
                logger.debug("applying %s at stage %s", method, stage)
                wrapper(self)
            if stage == "parallel_mode":
                self.plan_batches()
            elif stage == "data_parallel":
                self._wrap_data_parallel()
            elif stage == "optimizer":
                self._build_optimizer()
            elif stage == "dataloader":
                self._build_dataloader()
        self._build_lr_scheduler()

    def _wrap_data_parallel(self) -> None:
        if not self.local and self.data_parallel_wrapper is not None:
            self.data_parallel_wrapper[1](self)

    def add_sync_toggle(self, toggle: Callable[[bool], None]) -> None:
        """Register how to stop/restart gradient communication for gradient accumulation."""
        self.sync_toggles.append(toggle)
        self.args.requires_set_gradient_accumulation_boundary = True

    def optimizer_params(self) -> Any:
        if self.optim_param_func is not None:
            return self.optim_param_func(self.model)
        return [p for p in self.model.parameters() if p.requires_grad]

    def _build_optimizer(self) -> None:
        if self.optim_func is None:
            return
        if self.optimizer_factory is not None:
            built = self.optimizer_factory(self, self.optimizer_params())
        else:
            built = self.optim_func(self.optimizer_params(), **self.optim_args)
        if isinstance(built, AtorchOptimizer):
            self.optim = built
            self.raw_optim = built.torch_optimizer
        else:
            self.raw_optim = built
            self.optim = AtorchOptimizer(built, self.sync_toggles, self.grad_partition_group,
                                         backward_in_forward=self.backward_in_forward)

    def _build_lr_scheduler(self) -> None:
        if self.lr_scheduler_cls is not None and self.raw_optim is not None:
            self.lr_scheduler = self.lr_scheduler_cls(self.raw_optim, **self.lr_scheduler_args)

    def plan_batches(self) -> None:
        """The one place the per-rank batch is derived from the global batch (needs the mesh)."""
        if self.local:
            self.data_parallel_size = 1
            self.per_rank_batch_size = self.per_rank_batch_size or self.global_batch_size
        else:
            self.data_parallel_size = mesh.data_parallel_size()
            if self.dataset is not None and self.global_batch_size % self.data_parallel_size:
                raise InputError(
                    f"dataloader_args['batch_size']={self.global_batch_size} is the GLOBAL batch and must divide "
                    f"evenly over the {self.data_parallel_size} data-parallel ranks"
                )
            self.per_rank_batch_size = max(self.global_batch_size // self.data_parallel_size, 1)
        self.args.data_parallel_size = self.data_parallel_size
        self.args.per_rank_batch_size = self.per_rank_batch_size

    def _build_dataloader(self) -> None:
        if self.dataset is None:
            return
        args = dict(self.dataloader_args)
        args.pop("batch_size", None)
        if self.data_parallel_size > 1 and not isinstance(self.dataset, IterableDataset):
            if args.get("sampler") is not None or args.get("batch_sampler") is not None:
                raise InputError(
                    "dataloader_args 'sampler'/'batch_sampler' cannot shard data over data-parallel ranks; "
                    "pass distributed_sampler_cls instead"
                )
            sampler_cls = self.distributed_sampler_cls or DistributedSampler
            args["sampler"] = sampler_cls(
                self.dataset,
                num_replicas=self.data_parallel_size,
                rank=mesh.data_parallel_rank(),
                shuffle=bool(args.pop("shuffle", False)),
                drop_last=bool(args.get("drop_last", False)),
            )
        self.dataloader = DataLoader(self.dataset, batch_size=self.per_rank_batch_size, **args)

    # --- running a step (used by dry runs; mirrors the user's loop) --------------------------
    def prepare_input(self, data: Any, device: Optional[torch.device] = None) -> Any:
        device = device or self.device
        if self.user_prepare_input is not None:
            data = self.user_prepare_input(data, device)
        else:
            data = move_to_device(data, device)
        if self.input_dtype is not None:
            data = cast_floating(data, self.input_dtype)
        return data

    def call_model(self, model: torch.nn.Module, data: Any) -> Any:
        if self.model_input_format == "unpack_sequence":
            return model(*data)
        if self.model_input_format == "unpack_dict":
            return model(**data)
        return model(data)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")

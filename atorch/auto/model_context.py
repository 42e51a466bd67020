"""ModelContext: what the user gave, the facts methods share, and the build of the results.

Methods never call each other. A method's ``transform`` (record time) writes facts and registers
wrappers on the context; ``apply_wrappers`` (apply time) runs the wrappers in the one canonical
order of ``STAGES`` (``atorch/auto/stages.py``). Every fact one method leaves for another is a
declared attribute of ``ModelContext`` below; each method declares which it reads and writes, and
``atorch.auto.opt_lib.stage_contract()`` assembles them per stage (the table of
``docs/architecture.md``).
"""
from __future__ import annotations

import collections.abc
import copy
import inspect
import logging
import os
import random
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from atorch.auto.given_model import unwrap_given_model
from atorch.auto.gradients import route_torch_clipping
from atorch.auto.loss_items import DataParallelItemLoss, LossItems, resolve_loss_items
from atorch.auto.no_sync import route_no_sync
from atorch.auto.optimizer import AtorchOptimizer
from atorch.auto.optimizer_kernels import check_low_precision_update, optimizer_args
from atorch.auto.stages import CONTEXT_WORK, STAGES
from atorch.checkpoint.save_pretrained import route_save_pretrained
from atorch.distributed import mesh
from atorch.distributed.agreement import exchange_outside_collectives, is_multi_rank
from atorch.distributed.distributed import get_data_partition_rank_and_size  # noqa: F401  (ATorch's import path)
from atorch.errors import AtorchError, IncompatibleMethodsError, InputError, nearest_name
from atorch.utils.batch import call_with_batch, cast_floating, dict_of_forward_arguments, move_to_device, stacking_dims
from atorch.utils.data import RankShareCollate, ResumableDataLoader
from atorch.utils.meta_init import InitPlan, MaterializeRecord, has_meta_tensors, materialize, plan_initialisation

logger = logging.getLogger(__name__)

MODEL_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict")
# the keys dataloader_args may hold: DataLoader's own arguments but the dataset (auto_accelerate's
# ``dataset``) and batch_sampler (the per-rank batch comes from ``batch_size``, the global batch)
DATALOADER_KEYS = tuple(name for name in inspect.signature(DataLoader.__init__).parameters
                        if name not in ("self", "dataset", "batch_sampler"))
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

    # mapping access, as ATorch's ``args`` is a dict: args["use_optim_backward"], "x" in args, .get, keys
    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(f"result.args has no key {key!r}; valid keys: {self.keys()}")
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def items(self) -> list[tuple[str, Any]]:
        return [(key, getattr(self, key)) for key in self.keys()]

    def values(self) -> list[Any]:
        return [getattr(self, key) for key in self.keys()]


class ModelContext:
    """Everything auto_accelerate works on, before and after the strategy is applied.

    Attributes, by who writes them:

    Given by the user (read by methods, never replaced except ``model`` / ``loss_func``, which
    wrappers wrap): ``model``, ``optim_func``, ``optim_args``, ``optim_param_func``, ``dataset``,
    ``dataloader_args``, ``distributed_sampler_cls``, ``loss_func``, ``user_prepare_input``,
    ``model_input_format``, ``lr_scheduler_cls``, ``lr_scheduler_args``, ``find_unused_parameters``,
    ``loss_items`` (resolved: ``atorch.auto.loss_items.LossItems`` or None).

    The batch plan, computed once: ``global_batch_size`` (``dataloader_args['batch_size']``, the
    batch of one optimizer step over all ranks); after the mesh exists, ``data_parallel_size`` and
    ``per_rank_batch_size`` (``global_batch_size / data_parallel_size``). With ``local=True`` (the
    search measuring one rank alone) there is no data-parallel wrapper and the per-rank batch is the
    one given.

    Facts methods share (each method declares which; ``opt_lib.stage_contract()``): ``device``,
    ``amp_dtype``, ``half_dtype``, ``input_dtype``, ``sequence_parallel``, ``model_parallel``,
    ``backward_in_forward``, ``items_weighted``, ``grad_partition_group``, ``sync_toggles``, ``settlers``,
    ``optimizer_factory``, ``data_parallel_wrapper``.

    Results: ``optim`` (what the user steps), ``raw_optim`` (the torch optimizer inside it),
    ``dataloader``, ``lr_scheduler``, ``args`` (``result.args``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim_func: Optional[Callable] = None,
        dataset: Optional[Dataset] = None,
        loss_func: Optional[Callable] = None,
        *,
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
        loss_items: Any = None,
    ):
        # given by the user
        self.model = model
        self.optim_func = optim_func
        self.dataset = dataset
        self.loss_func = loss_func
        self.user_prepare_input = prepare_input
        self.model_input_format = model_input_format
        self.optim_args = _as_dict("optim_args", optim_args)
        self.optim_param_func = optim_param_func
        self.dataloader_args = _as_dict("dataloader_args", dataloader_args)
        self.distributed_sampler_cls = distributed_sampler_cls
        self.lr_scheduler_cls = lr_scheduler_cls
        self.lr_scheduler_args = _as_dict("lr_scheduler_args", lr_scheduler_args)
        self.find_unused_parameters = find_unused_parameters
        self.loss_items: Optional[LossItems] = resolve_loss_items(loss_items)  # what loss_func averages over
        self.device: torch.device = device or default_device()
        self.local = local  # this process alone: the search's single-rank measurement

        # the batch plan
        self.global_batch_size: int = self.dataloader_args.get("batch_size", 1)
        self.data_parallel_size: int = 1
        self.per_rank_batch_size: Optional[int] = per_rank_batch_size  # set by plan_batches() unless given

        # facts methods share
        self.wrappers: dict[str, list[tuple[str, Wrapper]]] = defaultdict(list)
        self.data_parallel_wrapper: Optional[tuple[str, Wrapper, bool]] = None  # (method, wrapper, shards meta)
        self.meta_init: Optional[InitPlan] = None  # a meta-device model's initialisers, until materialised
        self.materialized: Optional[MaterializeRecord] = None
        self.optimizer_factory: Optional[Callable[["ModelContext", Any], Any]] = None
        self.input_dtype: Optional[torch.dtype] = None  # floating inputs are cast to it
        self.amp_dtype: Optional[torch.dtype] = None  # autocast's dtype; sharding picks its mixed precision from it
        self.half_dtype: Optional[torch.dtype] = None  # the dtype parameters are cast to
        self.sequence_parallel = False  # the residual stream between split projections is sequence-sharded
        self.model_parallel = False  # tensor / pipeline parallel: parameters are DTensors or stage-local
        self.backward_in_forward = False  # pipeline schedules run backward inside model(...)
        self.items_weighted = False  # a method weighs its micro-batches' losses by loss_items itself
        self.grad_partition_group: Any = None  # ranks hold disjoint gradient shares (clipping reduces over it)
        self.sync_toggles: list[Callable[[bool], None]] = []  # gradient sync on/off (accumulation)
        self.settlers: list[Callable[[], None]] = []  # make gradients final before the optimizer reads them
        self.args = TrainingArgs(model_input_format=model_input_format)

        # results
        self.optim: Any = None
        self.raw_optim: Optional[torch.optim.Optimizer] = None
        self.dataloader: Optional[DataLoader] = None
        self.lr_scheduler: Any = None
        self.check_inputs()
        self._unwrap_given_model()
        self._infer_input_format()
        self._check_loss_items()

    def _unwrap_given_model(self) -> None:
        """A model the script wrapped before handing it over (DDP, nn.DataParallel, torch.compile): the strategy
        is applied to the module inside, with a warning; one already sharded is refused (atorch.auto.given_model).
        A wrapper's ``forward(*args, **kwargs)`` hid the batch's format and its parameter names, so tensor and
        pipeline parallelism failed at their sample row."""
        self.model = unwrap_given_model(self.model)

    def _infer_input_format(self) -> None:
        """``model_input_format=None`` says ``model(batch)``; where the batch is a dict of the forward's own
        arguments (an HF model's ``input_ids`` / ``attention_mask`` / ``labels``), ``model(batch)`` would pass
        the whole dict as its first argument, which no model can mean: atorch calls it as ``model(**batch)``
        ("unpack_dict") instead, and says so. Before, every call atorch makes itself (a tensor plan's sample,
        a pipeline stage, the search's dry runs) failed or fell back on such a model. Read from a map-style
        dataset's first row only: an iterable one is not read here (``unpack_dict`` must be given)."""
        # a map-style row only: reading one from an iterable dataset here could move a stream's position
        if self.model_input_format is not None or self.dataset is None or isinstance(self.dataset, IterableDataset):
            return
        try:
            batch = self.sample_batch()
        except Exception:  # a dataset that cannot give a row here is reported where it is read
            return
        if dict_of_forward_arguments(self.model, batch):
            logger.info("auto_accelerate: the batch is a dict of the model's forward arguments (%s): it is passed as "
                        "model(**batch) (model_input_format='unpack_dict')", ", ".join(map(str, batch)))
            self.model_input_format = self.args.model_input_format = "unpack_dict"

    def _check_loss_items(self) -> None:
        """``loss_items`` counts a map-style dataset's first row here, so a preset that finds no 'labels' or a
        function that fails is an InputError before anything is applied, not a failure in the first step.
        Every rank raises it where one rank's count failed (the user's function may fail on one rank only):
        before, that rank left alone and its peers waited in their next collective until they gave up on
        it (RankLostError, 13 s, the reason lost)."""
        if self.loss_items is None or self.dataset is None or isinstance(self.dataset, IterableDataset):
            return
        error = ""
        try:
            batch = self.sample_batch()
        except Exception:  # a dataset that cannot give a row here is reported where it is read
            batch = None
        if batch is not None:
            try:
                self.loss_items.count(batch, self.device)
            except InputError as failed:
                error = str(failed)
        # through the store: no collective is in flight here, but one of another shape may follow on a peer
        errors = exchange_outside_collectives(error) if is_multi_rank() and not self.local else [error]
        failed_ranks = [(rank, text) for rank, text in enumerate(errors) if text]
        if failed_ranks:
            rank, text = failed_ranks[0]
            where = f" (on rank {rank})" if len(errors) > 1 else ""
            raise InputError(f"{text}{where}")

    def release_training_objects(self) -> None:
        """Drop the model, optimizer, data loader and the wrappers' hooks this context built, after work
        on it failed: they hold the process group (DDP's reducer, FSDP's and DTensor's groups), and while
        anything holds it gloo keeps its connections open, so a peer blocked in a collective with this rank
        would wait for the collective timeout instead of failing at once. The context is not usable after."""
        self.model = self.optim = self.raw_optim = self.dataloader = self.lr_scheduler = None
        self.wrappers.clear()
        self.data_parallel_wrapper = self.grad_partition_group = self.optimizer_factory = None
        self.sync_toggles = []
        self.settlers = []

    # --- input checks ------------------------------------------------------------------------
    def check_inputs(self) -> None:
        """Everything that can be checked without a training step, before anything is applied: each
        bad argument raises InputError naming it and what is valid."""
        if not isinstance(self.model, torch.nn.Module):
            raise InputError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if self.model_input_format not in MODEL_INPUT_FORMATS:
            raise InputError(
                f"model_input_format={self.model_input_format!r} is not valid; "
                f"choose one of {list(MODEL_INPUT_FORMATS)}"
            )
        if self.optim_func is not None and not callable(self.optim_func):
            raise InputError("optim_func must be callable: an optimizer class or fn(parameters, **optim_args)")
        self._check_dataset()
        for name in ("prepare_input", "optim_param_func"):
            value = self.user_prepare_input if name == "prepare_input" else self.optim_param_func
            if value is not None and not callable(value):
                raise InputError(f"{name} must be callable, got {type(value).__name__}")
        self._check_lr_scheduler()
        if self.optim_func is None and self.optim_args:
            raise InputError(f"optim_args {sorted(self.optim_args)} were given without optim_func: pass optim_func "
                             "(an optimizer class or fn(parameters, **optim_args)), or drop optim_args")
        if self.optim_func is not None:
            check_call_keywords("optim_args", self.optim_args, self.optim_func, "optim_func")
        self._check_dataloader_args()

    def _check_dataset(self) -> None:
        if self.dataset is None:
            return
        if not isinstance(self.dataset, (Dataset, IterableDataset)) and not (
            hasattr(self.dataset, "__getitem__") and hasattr(self.dataset, "__len__")
        ):
            raise InputError(f"dataset must be a torch Dataset (map-style with __getitem__ and __len__, or an "
                             f"IterableDataset), got {type(self.dataset).__name__}")
        if self.loss_func is None or not callable(self.loss_func):
            raise InputError(
                "a dataset was given but loss_func is not callable: auto_accelerate needs "
                "loss_func(input, output) -> loss to run (and dry-run) training steps"
            )
        if isinstance(self.dataset, IterableDataset):
            if self.distributed_sampler_cls is not None:
                raise InputError("distributed_sampler_cls does not apply to an IterableDataset (it has no sampler): "
                                 "atorch gives each data-parallel process its share of every global batch; drop "
                                 "distributed_sampler_cls")
            return
        length = dataset_length(self.dataset)
        if length is None:
            raise InputError(f"dataset {type(self.dataset).__name__} is map-style (a torch Dataset without "
                             "__iter__) but has no __len__: the data-parallel sampler needs its length; give it "
                             "__len__, or make it a torch.utils.data.IterableDataset")
        if length == 0:
            raise InputError(f"dataset {type(self.dataset).__name__} is empty (len 0): there is nothing to train on")

    def _check_lr_scheduler(self) -> None:
        if self.lr_scheduler_cls is None:
            if self.lr_scheduler_args:
                raise InputError(f"lr_scheduler_args {sorted(self.lr_scheduler_args)} were given without "
                                 "lr_scheduler_cls: pass lr_scheduler_cls (e.g. torch.optim.lr_scheduler.StepLR), or "
                                 "drop lr_scheduler_args")
            return
        if not callable(self.lr_scheduler_cls):
            raise InputError(f"lr_scheduler_cls must be a scheduler class (e.g. torch.optim.lr_scheduler.StepLR) "
                             f"built as lr_scheduler_cls(optimizer, **lr_scheduler_args), "
                             f"got {self.lr_scheduler_cls!r}")
        if self.optim_func is None:
            raise InputError("lr_scheduler_cls needs optim_func: a scheduler wraps the optimizer")
        check_call_keywords("lr_scheduler_args", self.lr_scheduler_args, self.lr_scheduler_cls, "lr_scheduler_cls")

    def _check_dataloader_args(self) -> None:
        given = self.dataloader_args
        if "batch_sampler" in given:
            raise InputError("dataloader_args['batch_sampler'] is not supported: the per-rank batch comes from "
                             "dataloader_args['batch_size'] (the global batch); give a sampler, or "
                             "distributed_sampler_cls to shard data over data-parallel ranks")
        if "dataset" in given:
            raise InputError("dataloader_args['dataset'] is not valid: pass the dataset as auto_accelerate's dataset "
                             "argument")
        check_keys("dataloader_args", given, DATALOADER_KEYS, "torch.utils.data.DataLoader's arguments")
        batch_size = given.get("batch_size", 1)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise InputError(f"dataloader_args['batch_size'] must be a positive int, got {batch_size!r}")
        sampler_cls = self.distributed_sampler_cls
        if sampler_cls is not None and not callable(sampler_cls):  # a class (or a factory such as a partial)
            raise InputError(
                f"distributed_sampler_cls must be a sampler class (not an instance) with DistributedSampler's "
                f"signature (dataset, num_replicas=, rank=, shuffle=, drop_last=), got {sampler_cls!r}")

    # --- recording ---------------------------------------------------------------------------
    def add_wrapper(self, stage: str, method: str, wrapper: Wrapper) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown wrapper stage {stage!r}; stages: {STAGES}")
        self.wrappers[stage].append((method, wrapper))

    def set_data_parallel_wrapper(self, method: str, wrapper: Wrapper, *, shards_meta: bool = False) -> None:
        """Claim the data-parallel slot instead of the default DDP. ``shards_meta``: the wrapper
        shards a model still on the meta device (FSDP2), so it is materialised after it, each process
        allocating only its shards."""
        if self.data_parallel_wrapper is not None:
            raise IncompatibleMethodsError(
                f"{method} and {self.data_parallel_wrapper[0]} both want to wrap the model for data parallelism; "
                "keep one"
            )
        self.data_parallel_wrapper = (method, wrapper, shards_meta)

    # --- applying ----------------------------------------------------------------------------
    def apply_wrappers(self) -> None:
        self.meta_init = plan_initialisation(self.model) if has_meta_tensors(self.model) else None
        if self.meta_init is None:
            self.model.to(self.device)
        for stage in STAGES:
            for method, wrapper in self.wrappers.get(stage, []):
                logger.debug("applying %s at stage %s", method, stage)
                wrapper(self)
            work = CONTEXT_WORK.get(stage)  # the context's own step there (the batch plan, the optimizer, ...)
            if work is not None:
                getattr(self, work.step)()
        self._build_lr_scheduler()
        self._route_torch_clipping()
        self._weigh_loss_items()
        if self.model is not None:  # a Hugging Face model's save_pretrained, over several processes
            route_save_pretrained(self.model)
            route_no_sync(self.model, self.optim)  # a DDP loop's ``with model.no_sync():``

    def _wrap_data_parallel(self) -> None:
        """The data-parallel wrapper; a model built on the meta device gets its real storage here,
        before a wrapper that needs values (DDP broadcasts them) or after one that shards on meta
        (FSDP2), so each process allocates only its part."""
        wrapper = None if self.local else self.data_parallel_wrapper
        if self.meta_init is not None and not (wrapper is not None and wrapper[2]):
            self._materialize()
        if wrapper is not None:
            wrapper[1](self)
        if self.meta_init is not None:
            self._materialize()

    def _materialize(self) -> None:
        """Methods may have cut the model since the initialisers were found (a pipeline stage keeps
        its own layers): find them again on what this process holds. A local context (a process training
        alone while its peers do other work) draws from its own seed: there is nothing to agree with."""
        self.materialized = materialize(self.model, self.device, seed=torch.initial_seed() if self.local else None)
        self.meta_init = None

    def add_sync_toggle(self, toggle: Callable[[bool], None]) -> None:
        """Register how to stop/restart gradient communication for gradient accumulation."""
        self.sync_toggles.append(toggle)
        self.args.requires_set_gradient_accumulation_boundary = True

    def optimizer_params(self) -> Any:
        if self.optim_param_func is not None:
            return check_param_groups(self.optim_param_func(self.model))
        return [p for p in self.model.parameters() if p.requires_grad]

    def optim_args_for(self, params: Any) -> dict:
        """The keyword arguments every method builds the user's optimizer with over ``params``: the
        user's ``optim_args``, with torch's fused kernel chosen where it is the same update
        (``atorch.auto.optimizer_kernels``)."""
        return optimizer_args(self.optim_func, self.optim_args, params)

    def _build_optimizer(self) -> None:
        if self.optim_func is None:
            return
        params = self.optimizer_params()
        try:
            if self.optimizer_factory is not None:
                built = self.optimizer_factory(self, params)
            else:
                built = self.optim_func(params, **self.optim_args_for(params))
        except (TypeError, ValueError) as error:  # e.g. a learning rate the optimizer refuses
            if isinstance(error, AtorchError):
                raise
            raise InputError(f"building the optimizer, optim_func(parameters, **optim_args) with optim_args="
                             f"{self.optim_args}, raised {type(error).__name__}: {error}") from error
        if isinstance(built, AtorchOptimizer):
            built.settlers.extend(self.settlers)
            self.optim = built
            self.raw_optim = built.torch_optimizer
            if isinstance(self.raw_optim, torch.optim.Optimizer):
                check_low_precision_update(self.raw_optim)
            return
        if not isinstance(built, torch.optim.Optimizer):
            raise InputError(f"optim_func must return a torch.optim.Optimizer (it is called as "
                             f"optim_func(parameters, **optim_args)), got {type(built).__name__}")
        check_low_precision_update(built)
        self.raw_optim = built
        self.optim = AtorchOptimizer(built, self.sync_toggles, self.grad_partition_group, settlers=self.settlers,
                                     backward_in_forward=self.backward_in_forward)

    def _route_torch_clipping(self) -> None:
        """The user's ``torch.nn.utils.clip_grad_norm_`` on the model's parameters clips as
        ``optim.clip_grad_norm_`` does: by their global norm, unscaled under fp16 amp
        (``atorch.auto.gradients``)."""
        if self.model is not None and self.optim is not None:  # the final optimizer, amp's and micro_batch's on it
            route_torch_clipping(self.optim, self.model)

    def _weigh_loss_items(self) -> None:
        """Under data parallelism the ranks' gradients are averaged: with ``loss_items`` each rank's loss
        is weighted by its share of the global batch's items (``atorch.auto.loss_items``); without, a
        batch whose rows hold different numbers of labelled tokens warns once. A method that splits the
        call into micro-batches (a pipeline, micro_batch) weighs its pieces itself (``items_weighted``)."""
        if self.local or self.loss_func is None or self.items_weighted or self.data_parallel_size <= 1:
            return
        self.loss_func = DataParallelItemLoss(self.loss_func, self.loss_items, self.data_parallel_size, self.device)

    def _build_lr_scheduler(self) -> None:
        if self.lr_scheduler_cls is not None and self.raw_optim is not None:
            try:
                self.lr_scheduler = self.lr_scheduler_cls(self.raw_optim, **self.lr_scheduler_args)
            except (TypeError, ValueError, KeyError) as error:
                if isinstance(error, AtorchError):
                    raise
                raise InputError(f"lr_scheduler_cls(optimizer, **lr_scheduler_args) with lr_scheduler_args="
                                 f"{self.lr_scheduler_args} raised {type(error).__name__}: {error}") from error

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
        batch_size = self.per_rank_batch_size
        if isinstance(self.dataset, IterableDataset):
            batch_size = self._share_stream(args)
        elif self.data_parallel_size > 1:
            self._shard_with_sampler(args)
        try:
            self.dataloader = ResumableDataLoader(self.dataset, batch_size=batch_size,
                                                  same_batch_groups=self._same_batch_groups(), **args)
        except (TypeError, ValueError) as error:
            raise InputError(f"dataloader_args={self.dataloader_args} are not valid for torch.utils.data.DataLoader: "
                             f"{error}") from error
        self._check_batches()

    def _same_batch_groups(self) -> list:
        """The groups whose ranks read the same batches (tensor, pipeline: the dimensions that do not
        split the batch), so the loader draws their random numbers alike (``ResumableDataLoader``)."""
        if self.local:
            return []
        return [mesh.parallel_group(name) for name in ("tensor", "pipeline") if mesh.parallel_group_size(name) > 1]

    def _shard_with_sampler(self, args: dict) -> None:
        """A map-style dataset: the data-parallel sampler gives each process its indices. The sampler
        always drops the epoch's last samples that do not divide over the processes (fewer than their
        number; logged), whatever the loader's ``drop_last``: DistributedSampler would otherwise pad
        the epoch by repeating its first samples, training them twice where one process trains them
        once, and the last global batch would not split evenly."""
        if args.get("sampler") is not None:
            raise InputError(
                "dataloader_args 'sampler' cannot shard data over data-parallel ranks; "
                "pass distributed_sampler_cls instead"
            )
        sampler_cls = self.distributed_sampler_cls or DistributedSampler
        try:
            args["sampler"] = sampler_cls(
                self.dataset,
                num_replicas=self.data_parallel_size,
                rank=mesh.data_parallel_rank(),
                shuffle=bool(args.pop("shuffle", False)),
                drop_last=True,
            )
        except TypeError as error:
            raise InputError(f"distributed_sampler_cls {getattr(sampler_cls, '__name__', sampler_cls)} must "
                             "take DistributedSampler's arguments (dataset, num_replicas=, rank=, shuffle=, "
                             f"drop_last=): {error}") from error
        left_over = (dataset_length(self.dataset) or 0) % self.data_parallel_size
        if left_over and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning("the dataset's last %d sample(s) of each epoch do not divide over the %d data-parallel "
                           "processes: left out of that epoch (a one-process run would train on them; repeating "
                           "others, as DistributedSampler pads, would train those twice)", left_over,
                           self.data_parallel_size)

    def _share_stream(self, args: dict) -> int:
        """An IterableDataset has no sampler to shard: under data parallelism every process reads
        whole global batches of the same stream and collates its share of each (``RankShareCollate``,
        atorch/utils/data.py). Returns the batch size the loader reads."""
        split = getattr(self.dataset, "_distributed", None)  # HF datasets' split_dataset_by_node
        if split is not None and getattr(split, "world_size", 1) > 1:
            raise InputError(
                f"dataset was already split by node ({split}, datasets.distributed.split_dataset_by_node): atorch "
                "splits an IterableDataset over the data-parallel processes itself, so each process would train on "
                "a share of its share; pass the dataset before the split")
        if self.data_parallel_size == 1:
            return self.per_rank_batch_size
        args["collate_fn"] = RankShareCollate(args.get("collate_fn"), mesh.data_parallel_rank(),
                                              self.data_parallel_size)
        logger.info("%s split over %d data-parallel processes: each reads global batches of %d and keeps its %d",
                    type(self.dataset).__name__, self.data_parallel_size, self.global_batch_size,
                    self.per_rank_batch_size)
        return self.global_batch_size

    def _check_batches(self) -> None:
        """0 batches per epoch (a global batch above the dataset with drop_last) is refused here,
        not found as an empty loop later."""
        if isinstance(self.dataset, IterableDataset):
            return
        try:
            batches = len(self.dataloader)
        except TypeError:  # a sampler without __len__
            return
        if batches:
            return
        length = dataset_length(self.dataset) or 0
        largest = length // self.data_parallel_size * self.data_parallel_size
        fix = (f"lower dataloader_args['batch_size'] to at most {largest}, or set drop_last=False" if largest
               else f"give at least {self.data_parallel_size} samples, one per data-parallel process")
        raise InputError(
            f"dataloader_args['batch_size']={self.global_batch_size} (the global batch: {self.per_rank_batch_size} per "
            f"rank over a data-parallel size of {self.data_parallel_size}) with drop_last="
            f"{bool(self.dataloader_args.get('drop_last', False))} gives 0 batches per epoch over the dataset's "
            f"{length} samples; {fix}"
        )

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

    def sample_batch(self, copies: int = 1) -> Any:
        """One row of the dataset (``copies`` times), collated and prepared as the training loop's batches
        are (None without a dataset): what methods trace or check a model with before training starts."""
        if self.dataset is None:
            return None
        collate = self.dataloader_args.get("collate_fn") or torch.utils.data.default_collate
        return self.prepare_input(collate([_copied(self._first_row()) for _ in range(copies)]))

    def _first_row(self) -> Any:
        """The dataset's first row, read once per context: every method's check and trace reads the same
        row, and an IterableDataset is started once for it, not once per reader (each reader collates its
        own copies: a collate may pop keys from the rows it is given)."""
        if "_first_row_read" not in self.__dict__:
            if isinstance(self.dataset, torch.utils.data.IterableDataset):
                self._first_row_read = next(iter(self.dataset))
            else:
                self._first_row_read = self.dataset[0]
        return self._first_row_read

    def row_stacking(self) -> Optional[list[tuple[str, tuple[int, ...], Optional[int]]]]:
        """Where the data pipeline (the collate_fn, then prepare_input) stacks a batch's rows, input by
        input (``atorch.utils.batch.stacking_dims``): one row collated once and twice. The random state
        is left as it was (a collate may draw: masking for a masked LM). None without a dataset."""
        if self.dataset is None:
            return None
        state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):
                return stacking_dims(self.sample_batch(1), self.sample_batch(2))
        finally:
            random.setstate(state)

    def call_model(self, model: torch.nn.Module, data: Any) -> Any:
        return call_with_batch(model, data, self.model_input_format)


def _copied(row: Any) -> Any:
    """A copy of a dataset row for one reader (the row itself where it cannot be copied)."""
    try:
        return copy.deepcopy(row)
    except Exception:  # an object that refuses copying (a handle, a lock): readers share it
        return row


def _as_dict(argument: str, value: Any) -> dict:
    """A copy of a user's mapping argument (None: empty); InputError unless it is a dict."""
    if value is None:
        return {}
    if not isinstance(value, collections.abc.Mapping):
        raise InputError(f"{argument} must be a dict of keyword arguments (or None), got {type(value).__name__}: "
                         f"{value!r}")
    bad = [key for key in value if not isinstance(key, str)]
    if bad:
        raise InputError(f"{argument} keys must be argument names (str), got {bad}")
    return dict(value)


def check_keys(argument: str, given: Iterable[str], valid: Iterable[str], what: str) -> None:
    """InputError naming each unknown key of ``argument``, its nearest valid key and every valid one."""
    valid = list(valid)
    unknown = [key for key in given if key not in valid]
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = nearest(key, valid)
        parts.append(f"{key!r}" + (f" (did you mean {close!r}?)" if close else ""))
    noun = "key" if len(unknown) == 1 else "keys"
    raise InputError(f"{argument}: unknown {noun} {', '.join(parts)}; valid keys ({what}): {', '.join(valid)}")


def nearest(name: str, valid: Iterable[str]) -> Optional[str]:
    """The valid name a misspelt or abbreviated ``name`` most likely meant ('learning_rate' -> 'lr',
    'wd' -> 'weight_decay', 'shuffel' -> 'shuffle'), or None."""
    valid = list(valid)
    close = nearest_name(name, valid)
    if close:
        return close

    def initials(text: str) -> str:
        return "".join(part[0] for part in text.split("_") if part)

    return next((v for v in valid if len(v) > 1 and (initials(name) == v or initials(v) == name)), None)


def check_call_keywords(argument: str, given: dict, function: Callable, function_argument: str) -> None:
    """``given`` must fit ``function(first, **given)``: no unknown key (unless it takes **kwargs), no
    required one missing. Functions without an inspectable signature are not checked."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise InputError(f"{function_argument} {_name(function)} takes no positional argument, but atorch calls it "
                         f"as {function_argument}(first, **{argument})")
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and not (positional and p is positional[0])]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        check_keys(argument, given, [p.name for p in named], f"the arguments of {function_argument} "
                   f"{_name(function)}")
    missing = [p.name for p in named if p.default is p.empty and p.name not in given]
    if missing:
        raise InputError(f"{argument} misses {missing}, required by {function_argument} {_name(function)}"
                         f"{signature}")


def check_param_groups(params: Any) -> list:
    """What ``optim_param_func(model)`` returned, as a list: parameters, (name, parameter) pairs or
    param-group dicts with a 'params' key."""
    expected = ("optim_param_func(model) must return an iterable of parameters, of (name, parameter) pairs, or of "
                "param-group dicts each with a 'params' key")
    if params is None or isinstance(params, (torch.Tensor, str, bytes, collections.abc.Mapping)) or not isinstance(
            params, collections.abc.Iterable):
        raise InputError(f"{expected}; got {type(params).__name__}")
    params = list(params)
    if not params:
        raise InputError(f"{expected}; it returned no parameters (an empty iterable)")
    for index, item in enumerate(params):
        if isinstance(item, torch.Tensor):
            continue
        if isinstance(item, collections.abc.Mapping) and "params" in item:
            continue
        if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            continue
        shown = f"dict with keys {sorted(item)} (no 'params')" if isinstance(item, collections.abc.Mapping) else (
            type(item).__name__)
        raise InputError(f"{expected}; item {index} is a {shown}")
    return params


def dataset_length(dataset: Any) -> Optional[int]:
    """len(dataset), or None when it has none."""
    try:
        return len(dataset)
    except (TypeError, NotImplementedError):
        return None


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")

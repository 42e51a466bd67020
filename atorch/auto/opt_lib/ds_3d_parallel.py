"""ds_3d_parallel: DeepSpeed's pipeline engine (pipeline × data) — optional.

DeepSpeed pipelines a list of layers, each taking the previous one's output. Two ways in:

- A model given as ``nn.Sequential`` with ``model_input_format`` None: its layers are DeepSpeed's
  layers (the first receives the whole input), partitioned by DeepSpeed (``partition_method``:
  "parameters" by default, "uniform", or "type:<regex>").
- Any other model (an HF transformer, nn.TransformerEncoder, a torchtitan-, timm- or nanoGPT-style
  model), ``model_input_format`` "unpack_dict" or None: cut at its repeated blocks exactly as
  pipeline_parallel cuts it (``pipeline_parallel.cut_stages``: the block chain read from a traced
  forward, balanced by matmul parameters), at the same ``pipeline`` stage, so a model built on the
  meta device is materialised as this rank's stage only; one DeepSpeed layer per stage, which
  DeepSpeed builds only on its own ranks (a ``LayerSpec`` returning the stage cut). A stage runs the
  user's unchanged model with the other stages' blocks as pass-throughs
  (``pipeline_parallel.StageModule``); what crosses a stage is the hidden state and the micro-batch's
  row indices, from which every stage rebuilds its rows of the batch (masks, positions). Weights tied
  across stages (GPT-2's embedding and head) have their copies' gradients summed over the pipeline at
  DeepSpeed's tied-gradient reduction, before the data-parallel reduce.
  ``partition_method`` applies to ``nn.Sequential`` only.

``num_micro_batch`` micro-batches run per step. Tensor parallelism inside DeepSpeed needs a Megatron
model, so a ``tensor`` dimension above 1 is refused; use ``mixed_parallel`` for tensor × pipeline on
any model. As with pipeline_parallel, ``model(batch)`` runs the whole step and returns a
``PipelineOutput``, ``loss_func`` returns its loss, ``optim.backward`` is a no-op, and ``optim.step`` takes
the step DeepSpeed's ``train_batch`` would have ended with (deferred, so the loop's gradient clipping,
taken over every stage's gradients, applies as under any other method). In evaluation the
``PipelineOutput`` also reads through to the model's outputs for the whole batch on every stage, as
pipeline_parallel's does (``eval_outputs``).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from atorch.auto.loss_items import MicroBatchItemWeights
from atorch.auto.loss_probe import WindowScales
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason, without_shared_memory_allreduce
from atorch.auto.opt_lib.eval_outputs import MicroOutputs
from atorch.auto.opt_lib.pipeline_parallel import (
    PIPELINE_WHY,
    PipelineOutput,
    SharedWeights,
    StageModule,
    cut_stages,
    pipeline_loss,
)
from atorch.auto.opt_lib.pipeline_structure import refuse_collecting_switches
from atorch.auto.opt_lib.read_through import read_through
from atorch.auto.opt_lib.row_layout import check_rows_first
from atorch.auto.opt_lib.same_batch import check_same_batch
from atorch.auto.optimizer import AtorchOptimizer
from atorch.checkpoint.adapters import register_optimizer_adapter
from atorch.distributed import mesh
from atorch.distributed.agreement import all_ranks_true
from atorch.errors import CheckpointError, MethodConfigError, RequirementError
from atorch.utils.batch import batch_of_call, batch_size_of, loss_value, select_rows
from atorch.utils.config import MethodConfig, option
from atorch.utils.modules import full_state_dict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DS3DParallelConfig(MethodConfig):
    num_micro_batch: int = option(2, doc="micro-batches per step (DeepSpeed's gradient accumulation steps)", minimum=1)
    partition_method: Optional[str] = option(None, doc="an nn.Sequential's split by DeepSpeed: 'parameters' (None: "
                                             "this), 'uniform' or 'type:<regex>'; other models are cut at their "
                                             "blocks as pipeline_parallel cuts them")
    eval_outputs: bool = option(True, doc="in evaluation, also return the model's outputs for the whole batch on "
                                "every stage (merged from the last stage's micro-batches); False: the loss only, "
                                "no outputs kept or sent")



class DS3DParallelOptimization(Optimization):
    name = "ds_3d_parallel"
    distributed_only = True
    config_class = DS3DParallelConfig
    # the cut at "pipeline" (a model that is not an nn.Sequential); the engine (built by the optimizer factory)
    # is the data-parallel wrapper
    stages = ("pipeline", "data_parallel", "optimizer")
    reads = {"pipeline": ("model", "model_input_format", "device", "dataset", "dataloader_args", "user_prepare_input",
                          "input_dtype"),
             "optimizer": ("model", "loss_func", "model_input_format", "per_rank_batch_size", "optim_func",
                           "optim_args", "device", "dataset", "dataloader_args", "user_prepare_input",
                           "input_dtype", "loss_items")}
    writes = {"pipeline": ("model",), "optimizer": ("model", "loss_func", "settlers", "items_weighted")}
    record_writes = ("data_parallel_wrapper", "optimizer_factory", "backward_in_forward", "args")
    excludes = {"sharding": "choose one sharding level",
                "tensor parallel": "mixed_parallel already includes tensor parallel",
                "pipeline parallel": "mixed_parallel already includes pipeline parallel",
                "micro-batches": "a pipeline splits the batch into micro-batches itself: set its num_micro_batch"}

    def normalize(self, config: Any) -> DS3DParallelConfig:
        config = super().normalize(config)
        method = config.partition_method
        if method is not None and method not in ("parameters", "uniform") and not method.startswith("type:"):
            raise MethodConfigError(self.name, f"partition_method {method!r} is none of 'parameters', 'uniform', "
                                               "'type:<regex>'")
        return config

    def requirements(self, config: Any = None) -> Optional[str]:
        return deepspeed_unavailable_reason()

    def transform(self, ctx, config: DS3DParallelConfig) -> None:
        reason = deepspeed_unavailable_reason()
        if reason:
            raise RequirementError(f"ds_3d_parallel: {reason}")
        shared_inputs = check_rows_first(ctx, self.name)
        sequential = isinstance(ctx.model, nn.Sequential)
        if sequential and ctx.model_input_format is not None:
            raise MethodConfigError(self.name, "an nn.Sequential model needs model_input_format None: its first "
                                               "layer receives the whole batch")
        if not sequential and config.partition_method is not None:
            raise MethodConfigError(self.name, f"partition_method {config.partition_method!r} applies to an "
                                               f"nn.Sequential (DeepSpeed splits its layers); a "
                                               f"{type(ctx.model).__name__} is cut at its repeated blocks as "
                                               "pipeline_parallel cuts it: leave partition_method out")
        if not sequential and ctx.model_input_format not in ("unpack_dict", None):
            raise MethodConfigError(self.name, f"needs model_input_format 'unpack_dict' or None (a single input), "
                                               f"got {ctx.model_input_format!r}")
        if ctx.optim_func is None:
            raise MethodConfigError(self.name, "needs optim_func: DeepSpeed builds the optimizer into its engine")
        cut = _Cut()
        if not sequential:  # this rank's stage replaces the model before it is materialised
            ctx.add_wrapper("pipeline", self.name, cut.take)
        ctx.set_data_parallel_wrapper(self.name, lambda ctx: None)  # the engine does data parallelism
        ctx.optimizer_factory = lambda ctx, params: _build_engine(ctx, config, cut.stages, shared_inputs)
        ctx.backward_in_forward = True
        ctx.args.use_optim_backward = True


class _Cut:
    """This rank's stage of a model cut at its blocks, taken at the ``pipeline`` stage (None for an
    nn.Sequential, which DeepSpeed partitions itself)."""

    stages: Optional["DeepSpeedStages"] = None

    def take(self, ctx) -> None:
        _check_no_tensor_dimension()
        self.stages = DeepSpeedStages(ctx, mesh.parallel_group_size("pipeline"))
        # the cut traces the user's model, which may raise on one rank only: every rank passes a collective
        # (which a peer's failure ends) before any other rank goes on to wait for it elsewhere
        all_ranks_true(True)
        ctx.model = self.stages.stage


def _check_no_tensor_dimension() -> None:
    if mesh.parallel_group_size("tensor") > 1:
        raise MethodConfigError("ds_3d_parallel",
                                "a tensor dimension above 1 needs a Megatron model; use mixed_parallel")


def _build_engine(ctx, config: DS3DParallelConfig, stages: Optional["DeepSpeedStages"],
                  shared_inputs: frozenset[str] = frozenset()) -> "EngineStepOptimizer":
    """DeepSpeed's engine over ``stages`` (this rank's stage, cut at the ``pipeline`` stage), or over the
    layers of the nn.Sequential model when ``stages`` is None; ``shared_inputs``: the inputs every
    micro-batch takes whole (``row_layout.check_rows_first``)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    _check_no_tensor_dimension()
    pp, dp = mesh.parallel_group_size("pipeline"), mesh.data_parallel_size()
    per_rank = ctx.per_rank_batch_size
    micro = config.num_micro_batch
    if per_rank % micro:
        raise MethodConfigError("ds_3d_parallel",
                                f"the per-rank batch {per_rank} does not split into {micro} micro-batches")
    # every rank passes a collective (which a peer's failure ends) before DeepSpeed makes its groups, whose
    # creation waits on the store for every rank
    all_ranks_true(True)
    without_shared_memory_allreduce()
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)  # wraps our process group
    holder: dict = {}
    topology = _topology_like_the_mesh(pp, dp)
    loss_fn = lambda output, index: holder["wrapper"].micro_loss(output, index)  # noqa: E731
    if stages is None:
        module = DSPipelineModule(layers=list(ctx.model), num_stages=pp, topology=topology, loss_fn=loss_fn,
                                  partition_method=config.partition_method or "parameters", dynamic_shape=True)
    else:
        module = stages.pipeline_module(DSPipelineModule, topology, loss_fn)
        ctx.args.extras["ds_3d_parallel"] = stages.describe()
    _check_same_pipelines(module)
    # DeepSpeed clips the global gradient norm at 1.0 unless told otherwise: a step plain PyTorch would not
    # take (GPT-2 with its tied embedding, norm 1.10, had every update scaled by 0.908); clipping stays the
    # user's, as under every other method
    ds_config = {"train_micro_batch_size_per_gpu": per_rank // micro, "gradient_accumulation_steps": micro,
                 "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1, "gradient_clipping": 0.0}
    optimizer = ctx.optim_func([p for p in module.parameters() if p.requires_grad], **ctx.optim_args)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config,
                                           dist_init_required=False)
    item_weights = MicroBatchItemWeights(ctx.loss_items, dp, ctx.device, "ds_3d_parallel")
    wrapper = DeepSpeedPipeline(engine, ctx.loss_func, micro, stages, item_weights, config.eval_outputs,
                                shared_inputs)
    holder["wrapper"] = wrapper
    check_same_batch(wrapper, module.mpu().get_pipe_parallel_group(), "ds_3d_parallel", "pipeline")
    ctx.model = wrapper
    ctx.settlers.append(wrapper.settle)
    ctx.loss_func = pipeline_loss
    ctx.items_weighted = True
    logger.info("ds_3d_parallel: DeepSpeed pipeline of %d stages x %d data ranks, %d micro-batches", pp, dp, micro)
    _defer_the_step(engine)
    return EngineStepOptimizer(optimizer, module.mpu().get_pipe_parallel_group(), sequential=stages is None)


def _topology_like_the_mesh(pp: int, dp: int) -> Any:
    """DeepSpeed's process grid laid out as atorch's mesh lays out the ranks, so that a DeepSpeed pipeline
    is an atorch pipeline group: its stages load the same batch (the dataloader shards by atorch's data
    rank). The mesh varies its first-listed dimension fastest; DeepSpeed its last axis."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    dims = [name for name, _ in mesh.parallel_config().dims] if mesh.parallel_config() else []
    pipeline_fastest = "pipeline" in dims and all(dims.index("pipeline") < dims.index(d) for d in dims
                                                   if d != "pipeline" and d in ("data", "zero"))
    if pipeline_fastest:
        return ProcessTopology(axes=["data", "pipe"], dims=[dp, pp])
    return ProcessTopology(axes=["pipe", "data"], dims=[pp, dp])


def _check_same_pipelines(module: nn.Module) -> None:
    """MethodConfigError unless every DeepSpeed pipeline is one of atorch's pipeline groups, its stages in
    the same order (a parallel_mode rank order can place ranks where DeepSpeed's grid cannot follow):
    otherwise a stage would compute on another data shard's batch, or hold another stage's layers (the
    stage cut for this rank is its pipeline rank's), silently."""
    group = mesh.parallel_group("pipeline")
    ours = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
    stage = dist.get_rank(group) if group is not None else 0
    same = torch.tensor([int(sorted(ours) == sorted(module.mpu().pp_group) and module.stage_id == stage)])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if not same.item():
        raise MethodConfigError("ds_3d_parallel", f"DeepSpeed's pipeline groups do not follow parallel_mode's "
                                f"(this rank: DeepSpeed {sorted(module.mpu().pp_group)}, atorch {sorted(ours)}); "
                                "leave out parallel_mode's rank order")


class _BatchHolder:
    """The step's batch, where every stage reads its micro-batch's rows (a plain object: not a module)."""

    batch: Any = None
    rows: Optional[int] = None  # the batch's rows (``batch_size_of``)
    shared: frozenset = frozenset()  # the inputs the data pipeline stacks no rows into (row_layout): whole


class DeepSpeedStage(nn.Module):
    """One pipeline stage of a model that is not an ``nn.Sequential``, as DeepSpeed's layer: it receives
    the micro-batch's row indices (first stage) or the previous stage's hidden state with them, runs the
    user's model on those rows of the batch (``StageModule``), and passes its hidden state and the
    indices on; the last stage returns the user's own output object to the loss."""

    def __init__(self, build: Callable[[int], StageModule], index: int, holder: _BatchHolder,
                 input_format: Optional[str]):
        super().__init__()
        self.stage = build(index)
        self.holder = holder
        self.input_format = input_format

    def forward(self, received: Any) -> Any:
        if self.stage.is_first:
            index, hidden = received, ()
        else:
            hidden_state, index = received
            hidden = (hidden_state,)
        rows = select_rows(self.holder.batch, index, self.holder.rows, self.holder.shared)
        inputs = dict(rows) if self.input_format == "unpack_dict" else {"input": rows}
        output = self.stage(*hidden, **inputs)
        if self.stage.is_last:
            return self.stage.rebuild_output(output)
        return output, index


class DeepSpeedStages:
    """A model cut as pipeline_parallel cuts it (``cut_stages``), as DeepSpeed's pipeline module: this
    rank's stage (its pipeline rank's) cut from the user's model (no copy; on meta, before it is
    materialised), and one ``LayerSpec`` per stage, of which DeepSpeed builds this rank's."""

    def __init__(self, ctx, pp: int):
        self.pp = pp
        self.holder = _BatchHolder()
        self.input_format = ctx.model_input_format
        self.device = ctx.device
        try:
            structure, self.bounds, self.tied = cut_stages(ctx, pp, detail=f" ({pp} pipeline ranks)")
        except MethodConfigError as error:  # the same cut, refused for the same reason: said as this method's
            raise MethodConfigError("ds_3d_parallel", f"a model that is not an nn.Sequential is cut as "
                                    f"pipeline_parallel cuts it, which refuses it: {error}") from error
        group = mesh.parallel_group("pipeline")
        index = dist.get_rank(group) if group is not None else 0
        self.stage = StageModule(ctx.model, structure, index, self.bounds, ctx.model_input_format, tuple(self.tied))

    def _this_stage(self, index: int) -> StageModule:
        """What DeepSpeed's LayerSpec builds: the stage cut for this rank (``_check_same_pipelines`` refuses
        a grid whose stage ``index`` here is not this rank's pipeline rank)."""
        return self.stage

    def pipeline_module(self, base: type, topology: Any, loss_fn: Callable) -> nn.Module:
        from deepspeed.pipe import LayerSpec

        specs = [LayerSpec(DeepSpeedStage, self._this_stage, index, self.holder, self.input_format)
                 for index in range(self.pp)]
        module = _with_tied_stage_weights(base)(layers=specs, num_stages=self.pp, topology=topology, loss_fn=loss_fn,
                                                partition_method="uniform",  # one layer per stage
                                                dynamic_shape=True)
        module.shared = SharedWeights([self.stage], self.tied, module.mpu().get_pipe_parallel_group(), self.device)
        if module.shared:
            module.shared.copies()  # every stage holding a tied weight takes the lowest holder's value, now
        return module

    def describe(self) -> dict:
        return {"stages": self.pp, "blocks_per_stage": [b - a for a, b in self.bounds],
                "tied": {name: stages for name, stages in self.tied.items()}}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights by the user's names."""
        return {k.removeprefix("model."): v for k, v in full_state_dict(self.stage).items()}


@functools.cache
def _with_tied_stage_weights(base: type) -> type:
    """DeepSpeed's PipelineModule whose tied-gradient step sums the copies of weights tied across stages
    (``SharedWeights``). DeepSpeed asks a pipeline module for its tied weights once a step, on every
    stage, at its ReduceTiedGrads instruction, after the last micro-batch's backward and before the
    data-parallel reduce; the copies are summed there and DeepSpeed is handed none of its own."""

    class StagePipelineModule(base):
        shared: Optional[SharedWeights] = None

        def get_tied_weights_and_groups(self) -> list:
            if self.shared:
                self.shared.sum_gradients({name: [None] * len(params)
                                           for name, params in self.shared.copies().items()})
            return []

    return StagePipelineModule


class DeepSpeedPipeline(nn.Module):
    def __init__(self, engine: Any, loss_func: Any, micro: int, stages: Optional[DeepSpeedStages] = None,
                 item_weights: Optional[MicroBatchItemWeights] = None, eval_outputs: bool = True,
                 shared_inputs: frozenset[str] = frozenset()):
        super().__init__()
        self.shared_inputs = shared_inputs  # the inputs the data pipeline stacks no rows into (row_layout)
        self.item_weights = item_weights  # the micro-batches' losses weighted by loss_items (atorch.auto.loss_items)
        self.eval_outputs = eval_outputs
        self.micro_outputs = MicroOutputs()  # the last stage's micro-batch outputs in evaluation
        self.engine = engine
        self.user_loss = loss_func
        self.micro = micro
        self.stages = stages
        self._batch: Any = None
        self._batch_rows: Optional[int] = None  # the batch's rows (batch_size_of), read by micro_loss
        self.window = WindowScales("ds_3d_parallel")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            stages = self.__dict__.get("stages")
            engine = self.__dict__.get("_modules", {}).get("engine")
            user_model = stages.stage.model if stages is not None else getattr(engine, "module", None)
            return read_through(self, name, user_model, PIPELINE_WHY)

    def settle(self) -> None:
        """Scale the window's gradients as the loop scaled its calls' losses (``atorch.auto.loss_probe``)."""
        self.window.settle(p for p in self.engine.parameters() if p.requires_grad)

    def forward(self, *args: Any, **kwargs: Any) -> PipelineOutput:
        batch = batch_of_call(args, kwargs, self.stages.input_format if self.stages is not None else None)
        refuse_collecting_switches("ds_3d_parallel", batch, kwargs)
        size = batch_size_of(batch, self.engine.train_micro_batch_size_per_gpu() * self.micro, self.shared_inputs)
        self._batch, self._batch_rows = batch, size
        if size % self.micro:
            raise MethodConfigError("ds_3d_parallel", f"a batch of {size} rows does not split into its {self.micro} "
                                    "micro-batches, and DeepSpeed's engine runs a fixed count (an epoch's last "
                                    "batch): set drop_last=True in dataloader_args")
        index = torch.arange(size, device=next(self.engine.parameters()).device)
        if self.stages is not None:  # every stage reads its micro-batch's rows of the batch
            self.stages.holder.batch, self.stages.holder.rows = batch, size
            self.stages.holder.shared = self.shared_inputs
            chunks = [(part, part) for part in index.chunk(self.micro)]
        else:
            chunks = [(select_rows(batch, part, size, self.shared_inputs), part) for part in index.chunk(self.micro)]
        training = self.training and torch.is_grad_enabled()
        # the last stage keeps its micro-batches' outputs in evaluation only (a training call's are spent)
        self.micro_outputs.begin(not training and self.eval_outputs and self.engine.is_last_stage())
        if self.item_weights is not None:
            self.item_weights.begin(batch, self.micro, training)
        if training:
            loss = self.engine.train_batch(data_iter=iter(chunks))
        else:  # evaluation (model.eval() or torch.no_grad()): forward only, no gradients touched
            loss = self.engine.eval_batch(data_iter=iter(chunks), num_micro_batches=self.micro)
        loss = loss.detach().float() if torch.is_tensor(loss) else torch.tensor(float(loss))
        last = self.engine.grid.stage_to_global(self.engine.num_stages - 1)
        group = self.engine.module.mpu().get_pipe_parallel_group()
        if self.item_weights is not None:  # the last stage's item mean, on every stage as DeepSpeed's loss is
            loss = self.item_weights.mean(loss) if self.engine.is_last_stage() else loss.clone()
            dist.broadcast(loss, src=last, group=group)
        if training:
            return PipelineOutput(self.window.probe(loss))
        if not self.eval_outputs:
            return PipelineOutput(loss)
        return PipelineOutput(loss, self.micro_outputs.share(self.item_weights, dist.get_group_rank(group, last),
                                                             group, index.device))

    @property
    def stage_modules(self) -> Optional[list[StageModule]]:
        """This rank's stage of a model cut at its blocks, as pipeline_parallel's ``PipelineModule`` names
        its stages: what ``load_pretrained`` reads the user's names from (None for an nn.Sequential). A
        property, not a child module: the engine already holds the stage's parameters."""
        return [self.stages.stage] if self.stages is not None else None

    def micro_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        rows = select_rows(self._batch, index, self._batch_rows, self.shared_inputs)
        self.micro_outputs.keep(int(index[0]), output, len(index))
        loss = loss_value(self.user_loss(rows, output))
        return self.item_weights.weigh(rows, loss, int(index[0])) if self.item_weights is not None else loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's weights gathered over the pipeline, keyed as in the user's model (an
        nn.Sequential's by its layers' indices)."""
        mine = {}
        if self.stages is not None:
            mine = self.stages.full_state_dict()
        else:
            for key, value in self.engine.module.state_dict().items():
                mine[key] = value.detach().float().cpu().clone()  # DeepSpeed names layers by their global index
        group = self.engine.module.mpu().get_pipe_parallel_group()
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        out = {}
        for part in gathered:
            out.update(part)
        return out


class EngineStepOptimizer(AtorchOptimizer):
    """The seed loop's optimizer under DeepSpeed's pipeline engine: ``train_batch`` (the model call) ran the
    forwards, the backwards and the gradient reductions, so ``backward`` only tells how the loop scaled the loss
    (``DeepSpeedPipeline.settle`` scales the window's gradients by it before the step); ``step`` and
    ``zero_grad`` are the torch optimizer's own (DeepSpeed's step is deferred to them: ``_defer_the_step``),
    so the user's ``clip_grad_norm_`` sees the step's gradients, its norm taken over the pipeline stages."""

    def __init__(self, optimizer: torch.optim.Optimizer, pipeline_group: Any = None, sequential: bool = False):
        super().__init__(optimizer, grad_partition_group=pipeline_group, backward_in_forward=True)
        self.sequential = sequential  # DeepSpeed partitioned an nn.Sequential: its layers carry no user names


def _defer_the_step(engine: Any) -> None:
    """DeepSpeed's ``train_batch`` ends with its optimizer step; the seed loop's ``optim.step()`` takes it
    instead, after whatever the loop does between (clipping the gradient norm above all), as under
    pipeline_parallel. DeepSpeed's step still keeps its own books (its step count); only the optimizer's
    step and its zeroing of the gradients are left out of it."""
    take = engine._take_model_step

    def take_without_stepping(*args: Any, **kwargs: Any) -> None:
        optimizer = engine.optimizer
        optimizer.step = lambda *a, **k: None  # instance attributes over the class's methods, for this call
        engine.zero_grad = lambda *a, **k: None
        try:
            take(*args, **kwargs)
        finally:
            del optimizer.step
            del engine.zero_grad

    engine._take_model_step = take_without_stepping


def _checkpoints_refused(optim: EngineStepOptimizer) -> Optional[CheckpointError]:
    """None for a model cut at its blocks: its stage is the user's model (``DeepSpeedPipeline.stage_modules``,
    the user's names) and its optimizer the user's torch optimizer over the stage's parameters, stepped by
    the loop (DeepSpeed keeps no copy of the weights or state in fp32 without ZeRO), so checkpoints read
    both as pipeline_parallel's. An nn.Sequential that DeepSpeed partitioned by its layer indices: refused."""
    if not optim.sequential:
        return None
    return CheckpointError("save_checkpoint/load_checkpoint: ds_3d_parallel over an nn.Sequential is not supported: "
                           "DeepSpeed's pipeline engine partitioned its layers by index; give the model as it is "
                           "written (cut at its blocks, as pipeline_parallel cuts it), use pipeline_parallel / "
                           "mixed_parallel, or DeepSpeed's own engine.save_checkpoint", key="ds_3d_parallel")


register_optimizer_adapter(EngineStepOptimizer, unsupported=_checkpoints_refused)

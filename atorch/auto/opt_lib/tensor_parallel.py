"""tensor_parallel: Megatron-style splitting found from the model's structure, applied with DTensor.

How the plan is found (``docs/model-parallel.md``): one forward of a sample batch of the user's data
is recorded (``atorch.utils.dataflow``) and read by ``tp_discovery``: MLP pairs (a Linear reaching
other Linears only through activations, gates and dropout: column then row), attention (projections
feeding ``scaled_dot_product_attention`` or a matmul-softmax-matmul: column; the projection its
result reaches: row; fused q|k|v and k|v projections reordered so every rank holds its heads of
each part; head counts from the projection widths and the operands' head size), per-head score
biases (T5) and per-head norms (Qwen3's q / k norms: their parameters replicated, their input this
rank's heads, so DTensor sums their gradients over the ranks), and Mixture-of-Experts banks whose experts'
weights are stacked in 3-D parameters, split by expert (``tp_experts``). Names play no part;
``nn.MultiheadAttention`` is first swapped for an equivalent with separate projections (``tp_mha``).
Without a sample to run (no dataset) the older name lists serve as a fast path.
A user's ``{"plan": ...}`` replaces both.

Around that, as before: the token embedding is split on the vocabulary (each rank looks up its
rows, one all-reduce) and so is the LM head (column-wise, its logits all-gathered, so any loss_func
sees the full logits); weights tied between them stay tied. Everything else stays replicated. One
all-reduce per block half in forward (and one in backward) restores full activations.
``parallelize_module`` applies the plan on the ``tensor`` dimension of the mesh; GPT-2's ``Conv1D``
(a Linear with its weight transposed) gets the same styles with the dims swapped. Under pipeline
parallelism the plan is found and checked on the whole model before it is cut, then applied to each
stage.

Shapes the model's code reads at run time (``reshape(B, N, C)`` with C from the input, a split by
``self.n_embd``, T5's zeros of ``n_heads``) are made local by ``tp_shapes``; and every plan is
**checked before it is accepted**: the split model runs the sample forward and backward and must
reproduce the unsplit model's output, or ``auto_accelerate`` refuses with a MethodConfigError naming
what was split. The plan is reported in ``result.args.extras["tensor_parallel"]``.

Refused with a MethodConfigError: head counts or widths not divisible by the tensor size (naming the
module); a model where nothing can be split (a CNN), since every rank would compute the whole model.
With ``ctx.sequence_parallel`` the residual stream between the split projections is sequence-sharded
(``atorch.auto.opt_lib.sequence_parallel``).

Config: None (detect), or ``{"plan": {"<module-name glob>": "colwise" | "rowwise", ...}}`` which
replaces detection.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.same_batch import check_same_batch
from atorch.auto.opt_lib.sequence_parallel import apply_sequence_parallel, plan_sequence_parallel, replicate_params
from atorch.auto.opt_lib.tp_agreement import (
    draw_apart_in_split_parts,
    draw_apart_on_token_shards,
    share_initial_weights,
    share_random_state,
)
from atorch.auto.opt_lib.tp_check import Probe, check_plan, probe_from_context
from atorch.auto.opt_lib.tp_experts import gradient_summed, split_expert_bank
from atorch.auto.opt_lib.tp_mha import split_mha
from atorch.auto.opt_lib.tp_outputs import refuse_head_outputs
from atorch.auto.opt_lib.tp_plan import TPPlan, _is_linear, find_tp_plan, plan_from_patterns, split_share
from atorch.auto.opt_lib.tp_shapes import install_localizer, install_shared_head_gradients, localize_attributes
from atorch.checkpoint.tensors import SAVED_ORDERS_ATTR
from atorch.distributed import mesh
from atorch.distributed.agreement import max_over_ranks
from atorch.errors import MethodConfigError
from atorch.utils.batch import dict_of_forward_arguments
from atorch.utils.config import MethodConfig, option
from atorch.utils.forward_patch import patch_forward
from atorch.utils.modules import unwrap_model

logger = logging.getLogger(__name__)

Style = Literal["colwise", "rowwise"]


@dataclass(frozen=True)
class TensorParallelConfig(MethodConfig):
    plan: Optional[tuple[tuple[str, Style], ...]] = option(
        None, doc="{module-name glob: 'colwise' | 'rowwise'} (kept as pairs) replacing detection; None: detect the "
        "attention and MLP projections")


# --- styles for GPT-2's Conv1D (weight stored [in, out]) -----------------------------------------
class ConvColwise(ColwiseParallel):
    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if type(module).__name__ != "Conv1D":
            return super()._apply(module, device_mesh)
        return _distribute(self, module, device_mesh, weight=Shard(1), bias=Shard(0))


class ConvRowwise(RowwiseParallel):
    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if type(module).__name__ != "Conv1D":
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return _distribute(self, module, device_mesh, weight=Shard(0), bias=Replicate())

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        """The reduced output as a tensor of its own: DTensor's local view of it may not be changed in
        place (Llama 4 adds its routed experts into its shared expert's output with ``add_``)."""
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) else out


class EmbeddingRowwise(RowwiseParallel):
    """A vocabulary-split embedding whose summed output is handed on as a tensor of its own. RowwiseParallel
    hands on the pending all-reduce (an AsyncCollectiveTensor): passed into a block native_dynamo compiled,
    its gradient came back as a plain tensor where the all-reduce's backward needs a DTensor (HF Llama under
    tensor_parallel and native_dynamo: "'Tensor' object has no attribute '_local_tensor'")."""

    _prepare_output_fn = staticmethod(ConvRowwise._prepare_output_fn)


def _distribute(style, module, device_mesh, weight, bias):
    def partition(name, mod, mesh_):
        for pname, placement in (("weight", weight), ("bias", bias)):
            param = getattr(mod, pname, None)
            if param is not None and not isinstance(param, DTensor):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh_, [placement]),
                                                          requires_grad=param.requires_grad))

    return distribute_module(
        module, device_mesh, partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


# --- fused q|k|v -------------------------------------------------------------------------------------
# a module's SAVED_ORDERS_ATTR ({param attr: PermutedOrder}) tells checkpoints the user's order


@dataclass(frozen=True)
class PermutedOrder:
    """A parameter whose live order is its saved (user's) order with dimension ``dim`` permuted:
    ``live.index_select(dim, i) == saved.index_select(dim, order[i])``. Kept on the module so that
    ``state_dict`` and checkpoints store the user's order, which any other strategy can load."""

    order: torch.Tensor
    dim: int

    def to_saved(self, live: torch.Tensor) -> torch.Tensor:
        """The user's order of a full (unsharded) live-order tensor."""
        return live.index_select(self.dim, torch.argsort(self.order).to(live.device))

    def to_live(self, saved: torch.Tensor) -> torch.Tensor:
        """The live order (full, unsharded) of a tensor in the user's order."""
        return saved.index_select(self.dim, self.order.to(saved.device))


def _interleave_fused(model: nn.Module, fused_name: str, parts: list[int], tp: int) -> None:
    """Reorder the fused [q | k | v] (or [k | v]) output columns so rank r's contiguous share is
    [q_r | k_r | v_r], and restore the original order in state_dict (and, through
    ``SAVED_ORDERS_ATTR``, in checkpoints)."""
    proj = model.get_submodule(fused_name)
    out_dim = 1 if type(proj).__name__ == "Conv1D" else 0
    order = _interleaved_order(parts, tp)
    with torch.no_grad():
        proj.weight.copy_(proj.weight.index_select(out_dim, order))
        if proj.bias is not None:
            proj.bias.copy_(proj.bias.index_select(0, order))
    orders = {"weight": PermutedOrder(order, out_dim)}
    if proj.bias is not None:
        orders["bias"] = PermutedOrder(order, 0)
    setattr(proj, SAVED_ORDERS_ATTR, orders)

    def restore(module, state, prefix, local_metadata):
        for key, order in orders.items():
            value = state.get(prefix + key)
            if value is not None:
                state[prefix + key] = order.to_saved(value.full_tensor() if isinstance(value, DTensor) else value)
        return state

    proj._register_state_dict_hook(restore)


def _interleaved_order(parts: list[int], tp: int) -> torch.Tensor:
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return torch.tensor([start + rank * (width // tp) + i for rank in range(tp)
                         for start, width in zip(starts, parts) for i in range(width // tp)])


# --- the method ----------------------------------------------------------------------------------------
class TensorParallelOptimization(Optimization):
    name = "tensor_parallel"
    distributed_only = True
    config_class = TensorParallelConfig
    stages = ("model_parallel",)
    reads = ("model", "sequence_parallel", "dataset", "dataloader_args", "user_prepare_input", "input_dtype",
             "model_input_format", "loss_func", "device")
    writes = ("model", "model_parallel", "args")
    mesh_dims = ("tensor",)
    excludes = {"tensor parallel": "mixed_parallel already includes tensor parallel"}

    def transform(self, ctx, config: TensorParallelConfig) -> None:
        ctx.add_wrapper("model_parallel", self.name, lambda ctx: apply_tensor_parallel(ctx, config))


def apply_tensor_parallel(ctx, config: TensorParallelConfig, given: Optional[TPPlan] = None) -> Optional[TPPlan]:
    """Find (or take ``given``: mixed_parallel finds it before the pipeline cut), check and apply the
    plan on the model, or on each pipeline stage."""
    tp_mesh = _tensor_mesh()
    if tp_mesh is None:
        return None
    tp = tp_mesh.size()
    stages = getattr(ctx.model, "stage_modules", None)
    sequence = getattr(ctx, "sequence_parallel", False)
    if stages:
        plan = given or TPPlan(found_by="names")
        for stage in stages:
            share_initial_weights(stage, tp_mesh)
            applied = _apply_to_stage(stage, plan, config, tp, tp_mesh, sequence)
            share_random_state(stage, tp_mesh)
        plan = given or applied
    else:
        share_initial_weights(ctx.model, tp_mesh)
        plan = _parallelize(ctx.model, config, tp, tp_mesh, sequence, probe_from_context(ctx))
        share_random_state(ctx.model, tp_mesh)
    check_same_batch(ctx.model, tp_mesh.get_group(), "tensor_parallel", "tensor")  # under a pipeline: its root
    ctx.model_parallel = True
    ctx.args.extras["tensor_parallel"] = plan.report()
    return plan


def find_plan_before_pipeline(ctx, config: TensorParallelConfig) -> Optional[TPPlan]:
    """mixed_parallel: find and check the plan on a copy of the whole model (a stage alone cannot run
    the sample), with the MultiheadAttention swap done on the model itself so the stages hold it."""
    tp_mesh = _tensor_mesh()
    if tp_mesh is None:
        return None
    split_mha(ctx.model)
    share_initial_weights(ctx.model, tp_mesh)
    copy_ = copy.deepcopy(ctx.model)
    plan = _parallelize(copy_, config, tp_mesh.size(), tp_mesh, getattr(ctx, "sequence_parallel", False),
                        probe_from_context(ctx))
    return plan


def _tensor_mesh():
    device_mesh = mesh.device_mesh()
    tp = mesh.parallel_group_size("tensor")
    if device_mesh is None or tp <= 1:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:  # resolve_strategy refuses this first; a wrapper applied without it still must not no-op
            dims = list(mesh.parallel_config().dims) if mesh.parallel_config() else None
            raise MethodConfigError("tensor_parallel", f"needs the 'tensor' dimension of parallel_mode above 1, but "
                                    f"parallel_mode is {dims} on {world} ranks; add ('tensor', N) to parallel_mode")
        logger.warning("tensor_parallel: one process: nothing to split")
        return None
    return device_mesh["tensor"] if len(device_mesh.mesh_dim_names) > 1 else device_mesh


def _apply_to_stage(stage: nn.Module, whole: TPPlan, config: TensorParallelConfig, tp: int, tp_mesh,
                    sequence: bool) -> TPPlan:
    """The whole model's plan on one pipeline stage (the stage keeps the model under ``model.``;
    blocks of other stages are pass-throughs and drop out)."""
    if config.plan is not None or whole.found_by == "names":
        return _parallelize(stage, config, tp, tp_mesh, sequence, None)
    tied = tuple(f"model.{n}" for n in whole.tied_head) if whole.tied_head else None
    vocab = _on_stage(stage, whole.vocab)
    plan = dataclasses.replace(whole, styles=_on_stage(stage, whole.styles), fused=_on_stage(stage, whole.fused),
                               vocab=vocab, tied_head=tied if tied and set(tied) <= set(vocab) else None,
                               head_bias=list(_on_stage(stage, whole.head_bias)),
                               head_norms=_on_stage(stage, whole.head_norms, linear=False),
                               head_module_lists=_on_stage(stage, whole.head_module_lists, linear=False),
                               feature_norms=_on_stage(stage, whole.feature_norms, linear=False),
                               feature_gains=_on_stage(stage, whole.feature_gains, linear=False),
                               shared_heads=_on_stage(stage, whole.shared_heads, linear=False),
                               shared_kv=_on_stage(stage, whole.shared_kv),
                               head_params=_on_stage(stage, whole.head_params, linear=False),
                               aliases=[(f"model.{o}" if o else "model", a, f"model.{n}") for o, a, n in whole.aliases
                                        if f"model.{n.rpartition('.')[0]}" in vocab],
                               experts=_on_stage(stage, whole.experts, linear=False),
                               regions=_on_stage(stage, whole.regions, linear=False),
                               region_heads=_on_stage(stage, whole.region_heads, linear=False),
                               region_head_dims=_on_stage(stage, whole.region_head_dims, linear=False), replicated=[])
    return _parallelize(stage, config, tp, tp_mesh, sequence, None, given=plan)


def _on_stage(stage: nn.Module, entries, linear: bool = True):
    """``entries`` (names of the whole model) as names on the stage, for the modules it holds."""
    names = dict(stage.named_modules())
    keyed = entries if isinstance(entries, dict) else dict.fromkeys(entries)
    out = {}
    for name, value in keyed.items():
        local = f"model.{name}" if name else "model"
        module = names.get(local)
        if module is not None and (not linear or isinstance(module, (nn.Linear, nn.Embedding)) or _is_linear(module)):
            out[local] = value
    return out if isinstance(entries, dict) else list(out)


def _keep_pipeline_tied_whole(model: nn.Module, plan: TPPlan) -> None:
    """A pipeline stage's embedding or head tied to a copy on another stage stays whole: each stage
    plans alone and cannot see whether the other copy is split, and the copies' gradients are
    summed element by element, so both must keep the same element order."""
    tied = set(getattr(model, "tied_modules", ()))
    kept = sorted(tied & set(plan.vocab))
    if not kept:
        return
    logger.info("tensor_parallel: %s hold weights tied to another pipeline stage; they stay replicated", kept)
    plan.vocab = {name: role for name, role in plan.vocab.items() if name not in tied}
    if plan.tied_head and set(plan.tied_head) & tied:
        plan.tied_head = None


def _parallelize(model: nn.Module, config: TensorParallelConfig, tp: int, tp_mesh, sequence: bool,
                 probe: Optional[Probe], given: Optional[TPPlan] = None) -> TPPlan:
    split_mha(model)
    flow, reference = _record(model, probe) if probe is not None and given is None else (None, None)
    if given is not None:
        plan = given
    elif config.plan is not None:
        plan = plan_from_patterns(model, dict(config.plan))
    else:
        plan = find_tp_plan(model, tp, flow)
    _keep_pipeline_tied_whole(model, plan)
    if sequence and plan.experts:  # a bank's tokens differ per rank there: it stays whole
        _keep_moe_layers_whole(plan)
    if given is None:
        plan.share = split_share(model, plan)
    sequence_plan = plan_sequence_parallel(model, plan.styles, flow) if sequence else None  # refusals first
    for fused, parts in plan.fused.items():
        _interleave_fused(model, fused, parts, tp)
    replicated_rows = sequence_plan.replicated_rows if sequence_plan is not None else set()
    styles = {name: (ConvColwise() if style == "colwise" else
                     ConvRowwise(output_layouts=Shard(-2) if sequence and name not in replicated_rows else Replicate()))
              for name, style in plan.styles.items()}  # Shard(-2): the token dimension, before the features
    styles.update({name: EmbeddingRowwise(input_layouts=Replicate()) if role == "embedding"
                   else ColwiseParallel(output_layouts=Replicate()) for name, role in plan.vocab.items()})
    styles.update({name: ColwiseParallel() for name in plan.head_bias})  # [.., heads] -> this rank's heads
    parallelize_module(model, tp_mesh, styles)
    if plan.tied_head:  # both sides are sharded Shard(0) on the vocabulary: tie the DTensor again
        head, embedding = (model.get_submodule(n) for n in plan.tied_head)
        head.weight = embedding.weight
    for owner, attr, split_name in plan.aliases:  # the LM head's bias its parent holds too
        model.get_submodule(owner).register_parameter(attr, model.get_parameter(split_name))
    for name, heads_dim in plan.head_norms.items():
        _run_on_local_heads(model.get_submodule(name), tp_mesh, heads_dim)
    for name, heads_dim in plan.head_module_lists.items():
        _run_on_gathered_heads(model.get_submodule(name), tp_mesh, heads_dim)
    for name in plan.feature_norms:
        _run_on_local_features(model.get_submodule(name), tp_mesh)
    for name in plan.feature_gains:
        _run_on_local_heads(model.get_submodule(name), tp_mesh, -1)
    for name, shared in plan.shared_heads.items():
        install_shared_head_gradients(model.get_submodule(name), shared, tp_mesh)
    for name in plan.shared_kv:
        _sum_output_gradient(model.get_submodule(name), tp_mesh)
    for name, params in plan.head_params.items():
        _split_head_params(model.get_submodule(name), params, tp_mesh)
    for name in plan.experts:
        split_expert_bank(model.get_submodule(name), tp_mesh)
    if sequence_plan is not None:
        apply_sequence_parallel(model, sequence_plan, tp_mesh)
        draw_apart_on_token_shards(model, [(model.get_submodule(r.blocks[0]), model.get_submodule(r.blocks[-1]))
                                           for r in sequence_plan.regions], tp_mesh.get_local_rank())
    regions = {name: model.get_submodule(name) for name in plan.regions}
    draw_apart_in_split_parts(model, [model.get_submodule(n) for n, s in plan.styles.items() if s == "colwise"],
                              [model.get_submodule(n) for n, s in plan.styles.items() if s == "rowwise"],
                              list(regions.values()), tp_mesh.get_local_rank())
    refuse_head_outputs(model, [name for name in plan.regions if plan.region_heads.get(name)])
    localizers = {name: install_localizer(module, plan.regions[name], tp, _fused_parts_in(plan, name),
                                          plan.region_head_dims.get(name, set()), tp_mesh.get_local_rank())
                  for name, module in regions.items()}
    if probe is not None and reference is not None:
        rows = frozenset(n for n, style in plan.styles.items() if style == "rowwise")
        whole_outputs = frozenset(n for n in rows if not sequence or n in replicated_rows)
        plan.shapes = check_plan(model, probe, reference, regions=regions, sizes=plan.regions, heads=plan.region_heads,
                                 localizers=localizers, tp=tp, group=tp_mesh.get_group(), described=_describe(plan),
                                 whole_outputs=whole_outputs, sharded_outputs=rows - whole_outputs)
    elif plan.shapes in ("heads", "attributes"):
        chosen = plan.region_heads if plan.shapes == "heads" else plan.regions
        for name, module in regions.items():
            localize_attributes(module, chosen.get(name, set()), tp)
    logger.info("tensor_parallel (%s): split %d projections and %s on the vocabulary over %d ranks; replicated: %s",
                plan.found_by, len(plan.styles), list(plan.vocab) or "nothing", tp,
                ", ".join(plan.replicated) or "nothing")
    return plan


def _fused_parts_in(plan: TPPlan, region: str) -> list[list[int]]:
    """The parts of the fused projections inside ``region`` (slices of their outputs are made local)."""
    prefix = f"{region}." if region else ""
    return [parts for name, parts in plan.fused.items() if name.startswith(prefix)]


def _sum_output_gradient(projection: nn.Module, tp_mesh) -> None:
    """A whole projection read by this rank's split heads only (multi-query attention's one key / value
    head) gets from them only their part of its output's gradient: summed over the tensor group, it is
    the gradient one process gets from every head."""
    projection.register_forward_hook(lambda module, args, output: gradient_summed(output, tp_mesh))


def _split_head_params(module: nn.Module, heads_dims: dict[str, int], tp_mesh) -> None:
    """An attention's own per-head parameters (gpt-oss's sinks and Swin's relative position bias table,
    heads last; Cohere's per-head norm weights, heads first): sharded on their heads dimension over the
    tensor group, so checkpoints see them whole, and this rank's heads' values as plain tensors while the
    module runs (its code mixes them with its own heads; their gradients flow back to the shards)."""
    names = list(heads_dims)
    for name, dim in heads_dims.items():
        param = getattr(module, name)
        if not isinstance(param, DTensor):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param.data, tp_mesh, [Shard(dim % param.dim())]), requires_grad=param.requires_grad))
    registered: dict[str, nn.Parameter] = {}

    def local_in(mod: nn.Module, args: tuple) -> None:
        registered.update(mod._parameters)  # in order: the optimizer and checkpoints read them in it
        for name in names:
            del mod._parameters[name]
            mod.__dict__[name] = registered[name].to_local()

    def whole_out(mod: nn.Module, args: tuple, output):
        if registered:
            for name in names:
                mod.__dict__.pop(name, None)
            mod._parameters.clear()
            mod._parameters.update(registered)
            registered.clear()

    module.register_forward_pre_hook(local_in)
    module.register_forward_hook(whole_out, always_call=True)


def _keep_moe_layers_whole(plan: TPPlan) -> None:
    """Under sequence parallelism each rank holds other tokens, so an expert bank stays whole, and so
    does everything else in the layer holding it (a shared expert beside the bank: Qwen2-MoE's,
    DeepSeek's, Llama 4's): with nothing split inside, the layer runs whole on the gathered sequence,
    its router, bank and shared expert alike (``sequence_parallel``), rather than each on its own with
    inputs and outputs in other layouts (flattened rows, rows repeated per expert)."""
    layers = {name.rpartition(".")[0] for name in plan.experts}
    inside = [n for n in plan.styles if any(n.startswith(layer + ".") for layer in layers)]
    why = "sequence parallelism: each rank holds other tokens, so its MoE layer runs whole"
    plan.why_whole.update(dict.fromkeys([*plan.experts, *inside], why))
    plan.styles = {n: style for n, style in plan.styles.items() if n not in inside}
    plan.experts = []


def _run_on_local_heads(module: nn.Module, tp_mesh, heads_dim: int) -> None:
    """A per-head norm (or, with ``heads_dim`` -1, a gain applied to every feature): its parameters become
    replicated DTensors and its input this rank's heads (sharded on ``heads_dim``, counted from the end),
    so it computes as in one process on those heads and its parameters' gradients, partial on each rank,
    are summed over the tensor group. Plain tensors it holds (xIELU's constant buffers) count as
    replicated in its forward."""
    def heads_in(mod: nn.Module, inputs: tuple, device_mesh) -> tuple:
        local = inputs[0]
        return (DTensor.from_local(local, device_mesh, [Shard(local.dim() + heads_dim)], run_check=False), *inputs[1:])

    distribute_module(module, tp_mesh, replicate_params, heads_in, lambda mod, output, device_mesh: output.to_local())
    if any(True for _ in module.buffers(recurse=False)):
        patch_forward(module, _with_implicit_replication)


def _run_on_gathered_heads(module: nn.Module, tp_mesh, heads_dim: int) -> None:
    """A module applying a module of its own to each head (StableLM 2's LayerNorm per head): its
    parameters become replicated DTensors, its input this rank's heads gathered from every rank (an
    all-gather over the tensor group, forward and backward), and its output is cut back to this rank's
    heads, so each head meets its own module as in one process. The gradient of the output is gathered
    back whole, so every rank computes the parameters' whole gradient."""
    def gathered_in(mod: nn.Module, inputs: tuple, device_mesh) -> tuple:
        local = inputs[0]
        sharded = DTensor.from_local(local, device_mesh, [Shard(local.dim() + heads_dim)], run_check=False)
        return (sharded.redistribute(device_mesh, [Replicate()]), *inputs[1:])

    def local_out(mod: nn.Module, output: DTensor, device_mesh) -> torch.Tensor:
        return output.redistribute(device_mesh, [Shard(output.dim() + heads_dim)]).to_local()

    distribute_module(module, tp_mesh, replicate_params, gathered_in, local_out)


def _with_implicit_replication(forward, options: dict, *args, **kwargs):
    with implicit_replication():
        return forward(*args, **kwargs)


def _run_on_local_features(module: nn.Module, tp_mesh) -> None:
    """A norm over a column-split projection's whole output: its parameters become ``Shard(0)``
    DTensors (this rank's features) and its input this rank's features (``Shard(-1)``), so its
    reduction over the features is summed over the tensor group (forward and backward) and it
    computes as in one process."""
    def shard_params(name: str, mod: nn.Module, device_mesh) -> None:
        for key, param in list(mod.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param.data, device_mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))

    def features_in(mod: nn.Module, inputs: tuple, device_mesh) -> tuple:
        return (DTensor.from_local(inputs[0], device_mesh, [Shard(inputs[0].dim() - 1)], run_check=False),
                *inputs[1:])

    def features_out(mod: nn.Module, output: DTensor, device_mesh) -> torch.Tensor:
        # an elementwise norm keeps the features sharded; one the DTensor rules compute whole (layer_norm
        # over a sharded dimension) is cut back to this rank's features, which the next projection reads
        return output.redistribute(device_mesh, [Shard(output.dim() - 1)]).to_local()

    distribute_module(module, tp_mesh, shard_params, features_in, features_out)


def _record(model: nn.Module, probe: Probe):
    """The sample forward's dataflow and output; MethodConfigError when the sample does not run on the
    model as it is (a plan from the name lists alone could not be checked, and would fail inside the
    training loop instead; the error says when the batch only needs ``model_input_format='unpack_dict'``).
    Every rank takes the same
    path: a sample that fails on some ranks only (a fault of that rank, not of the model) fails the
    method on every rank, its own error the reason, rather than leave the ranks with different plans,
    whose collectives would then wait for each other until they time out."""
    try:
        recorded, error = probe.record(model), None
    except Exception as raised:
        recorded, error = (None, None), raised
    failed = error is not None
    some_failed, some_ran = max_over_ranks([1.0 if failed else 0.0, 0.0 if failed else 1.0])  # one collective
    if failed and some_ran:
        raise MethodConfigError("tensor_parallel", f"the sample row failed on this rank only, so the ranks would "
                                f"split the model differently: {type(error).__name__}: {error}") from error
    if some_failed and not failed:
        raise RuntimeError("tensor_parallel: the sample row failed on another rank (its reason is reported)")
    if failed:
        hint = ""
        if probe.input_format is None and dict_of_forward_arguments(unwrap_model(model), probe.batch):
            hint = ("; the batch is a dict of the forward's arguments: pass model_input_format='unpack_dict' "
                    "(model(**batch))")
        raise MethodConfigError("tensor_parallel", f"the sample row does not run through the model "
                                f"({type(error).__name__}: {error}){hint}: the plan can neither be read from the "
                                "model's structure nor checked before training") from error
    return recorded


def _describe(plan: TPPlan) -> str:
    cols = [n for n, s in plan.styles.items() if s == "colwise"]
    rows = [n for n, s in plan.styles.items() if s == "rowwise"]
    return (f"column-wise {', '.join(cols[:4])}{', ...' if len(cols) > 4 else ''}; row-wise "
            f"{', '.join(rows[:4])}{', ...' if len(rows) > 4 else ''}")

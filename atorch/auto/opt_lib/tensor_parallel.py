"""tensor_parallel: Megatron-style splitting found automatically, applied with DTensor.

The plan is found on the unchanged model (``find_tp_plan``): in every attention block the q/k/v
projections (separate, or fused like GPT-2's ``c_attn``) are split column-wise and the output
projection row-wise, so each rank holds a share of the heads; in every MLP the up/gate projections
are split column-wise and the down projection row-wise (fc1/fc2, c_fc/c_proj, gate/up/down, T5's
wi/wo and wi_0/wi_1/wo, BERT / ViT intermediate/output dense). One all-reduce per block half in
forward (and one in backward) restores full activations. The token embedding is split on the
vocabulary (each rank looks up its rows, one all-reduce) and so is the LM head (column-wise, its
logits all-gathered, so any loss_func sees the full logits); weights tied between them stay tied.
Norms, position embeddings and anything else stay replicated (logged). ``parallelize_module``
applies the plan on the ``tensor`` dimension of the mesh; GPT-2's ``Conv1D`` (a Linear with its
weight transposed) gets the same styles with the dims swapped. Under pipeline parallelism each stage
is split the same way.

Heads: an embedding of an attention with one column per head (T5's ``relative_attention_bias``)
is split on its columns with the heads, and the attention's head-count attributes that describe the
split projections (``n_heads``, ``num_heads``, ``num_attention_heads``, ``inner_dim``,
``all_head_size``, ...; only those equal to a split head count or width) become the per-rank values,
so code that reads them (T5's zero position bias for cross attention) builds local-head tensors.
Checked on GPT-2 (tied and untied), Llama, Qwen2, Mistral, BERT, T5, ViT, CLIP (both towers and
their projections replicated) and plain fc1/fc2 blocks.

Refused with a MethodConfigError: a head count not divisible by the tensor size (naming the module
and the sizes); a model with no attention projections and no MLP Linear pair (a CNN), since every
rank would compute the whole model. With ``ctx.sequence_parallel`` the residual stream between the
split projections is sequence-sharded (``atorch.auto.opt_lib.sequence_parallel``).

Config: None (detect), or ``{"plan": {"<module-name glob>": "colwise" | "rowwise", ...}}`` which
replaces detection.
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from atorch.errors import MethodConfigError
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.sequence_parallel import apply_sequence_parallel, plan_sequence_parallel
from atorch.distributed import mesh
from atorch.utils.config import MethodConfig, option

logger = logging.getLogger(__name__)

QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"))
FUSED_QKV_NAMES = ("c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value")
OUT_NAMES = ("o_proj", "out_proj", "c_proj", "o", "out_lin", "dense")
MLP_PAIRS = ((("gate_proj", "up_proj"), "down_proj"), (("up_proj",), "down_proj"), (("fc1",), "fc2"),
             (("c_fc",), "c_proj"), (("w1", "w3"), "w2"), (("lin1",), "lin2"), (("wi_0", "wi_1"), "wo"), (("wi",), "wo"))
HEAD_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")
# per-attention counts that describe the split projections' width: they become the local (per-rank) values
HEAD_COUNT_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "inner_dim",
                    "all_head_size")
Style = Literal["colwise", "rowwise"]


@dataclass(frozen=True)
class TensorParallelConfig(MethodConfig):
    plan: Optional[tuple[tuple[str, Style], ...]] = option(
        None, doc="{module-name glob: 'colwise' | 'rowwise'} (kept as pairs) replacing detection; None: detect the "
        "attention and MLP projections")


@dataclass
class TPPlan:
    styles: dict[str, str] = field(default_factory=dict)        # module name -> colwise / rowwise
    fused_qkv: dict[str, str] = field(default_factory=dict)     # fused projection -> its attention module
    replicated: list[str] = field(default_factory=list)         # parameter-holding leaves left whole
    vocab: dict[str, str] = field(default_factory=dict)         # module name -> "embedding" / "head" (vocab split)
    tied_head: Optional[tuple[str, str]] = None                 # (head, embedding) sharing one weight
    head_bias: list[str] = field(default_factory=list)          # per-head embeddings (T5 relative bias): column split
    head_counts: dict[str, set] = field(default_factory=dict)   # attention -> its head counts / widths (made local)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _out_features(module: nn.Module) -> int:
    return module.weight.shape[0] if isinstance(module, nn.Linear) else module.weight.shape[1]


# --- finding the plan ------------------------------------------------------------------------------
def find_tp_plan(model: nn.Module, tp: int) -> TPPlan:
    """Detect attention and MLP projections; check that heads divide by ``tp``. A model with none
    is refused: tensor_parallel would silently leave every rank computing the whole model."""
    plan = TPPlan()
    for name, module in model.named_modules():
        children = {n: c for n, c in module.named_children() if _is_linear(c)}
        prefix = f"{name}." if name else ""
        qkv = next((t for t in QKV_NAMES if all(n in children for n in t)), None)
        fused = next((n for n in FUSED_QKV_NAMES if n in children), None)
        if qkv or fused:
            heads = _check_heads(name, module, [children[n] for n in (qkv or (fused,))], tp, fused=bool(fused) and not qkv)
            if heads:
                plan.head_counts[name] = {v for pair in heads for v in pair}
                plan.head_bias += _head_bias(module, prefix, heads[0][1])
            for n in qkv or (fused,):
                plan.styles[prefix + n] = "colwise"
            if fused and not qkv:
                plan.fused_qkv[prefix + fused] = name
            out = next((n for n in OUT_NAMES if n in children and n not in (qkv or ())), None)
            if out:
                plan.styles[prefix + out] = "rowwise"
            continue
        for ups, down in MLP_PAIRS:
            if all(n in children for n in ups) and down in children and prefix + down not in plan.styles:
                for n in ups:
                    plan.styles[prefix + n] = "colwise"
                plan.styles[prefix + down] = "rowwise"
                break
    _bert_style_outputs(model, plan)
    if not plan.styles:
        _refuse_nothing_to_split(model)
    _find_vocab_parallel(model, tp, plan)
    split = {*plan.styles, *plan.vocab, *plan.head_bias}
    for name, module in model.named_modules():
        leaf = not list(module.children())
        if leaf and any(True for _ in module.parameters(recurse=False)) and name not in split:
            plan.replicated.append(name)
    return plan


def _refuse_nothing_to_split(model: nn.Module) -> None:
    """The reason, with what the model does hold, so a user sees why (a CNN has no Linear pairs)."""
    linears = [n for n, m in model.named_modules() if _is_linear(m)]
    held = (f"its Linear layers ({', '.join(linears[:4])}{', ...' if len(linears) > 4 else ''}) form none"
            if linears else "it holds no Linear")
    raise MethodConfigError(
        "tensor_parallel", f"{type(model).__name__} has no attention q/k/v projections and no MLP up/down Linear pair "
        f"({held}): with nothing to split every rank would hold and compute the whole model; name the projections "
        "with {'plan': {...}} or use data parallelism")


def _head_bias(attention: nn.Module, prefix: str, heads: int) -> list[str]:
    """Embeddings of an attention with one column per head (T5's relative_attention_bias): split
    with the heads, so each rank adds the bias of its own heads."""
    return [prefix + n for n, child in attention.named_children()
            if isinstance(child, nn.Embedding) and child.embedding_dim == heads]


def _find_vocab_parallel(model: nn.Module, tp: int, plan: TPPlan) -> None:
    """The token embedding (the largest nn.Embedding) and the LM head (a Linear projecting to that
    vocabulary) are split on the vocabulary when it divides by ``tp``. A head whose parameters are
    shared with anything but that embedding stays replicated."""
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return
    embedding_name, embedding = max(embeddings, key=lambda item: item[1].num_embeddings)
    vocab = embedding.num_embeddings
    if vocab % tp:
        logger.info("tensor_parallel: vocabulary %d does not divide by %d; %s and the LM head stay replicated", vocab, tp,
                    embedding_name)
        return
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.out_features != vocab or name in plan.styles:
            continue
        shared = {o for p in module.parameters(recurse=False) for o in owners[id(p)]} - {name, embedding_name}
        if shared:
            logger.info("tensor_parallel: LM head %s shares parameters with %s; it stays replicated", name, sorted(shared))
            continue
        plan.vocab[name] = "head"
        if module.weight is embedding.weight:
            plan.tied_head = (name, embedding_name)
    others = set(owners[id(embedding.weight)]) - {embedding_name} - set(plan.vocab)
    if others:  # tied to a module that stays whole: splitting either side would untie them
        logger.info("tensor_parallel: %s shares its weight with %s; both stay replicated", embedding_name, sorted(others))
        plan.vocab = {n: r for n, r in plan.vocab.items() if model.get_submodule(n).weight is not embedding.weight}
        plan.tied_head = None
        return
    plan.vocab[embedding_name] = "embedding"


def _bert_style_outputs(model: nn.Module, plan: TPPlan) -> None:
    """BERT keeps the output projections in sibling modules: BertSelfOutput.dense after the self
    attention, and BertIntermediate.dense (column) / BertOutput.dense (row) for the MLP."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        children = dict(module.named_children())
        output = children.get("output")
        if output is None or not _is_linear(getattr(output, "dense", nn.Identity())):
            continue
        if "self" in children and any(k.startswith(prefix + "self.") for k in plan.styles):
            plan.styles[prefix + "output.dense"] = "rowwise"
        intermediate = children.get("intermediate")
        if intermediate is not None and _is_linear(getattr(intermediate, "dense", nn.Identity())):
            plan.styles[prefix + "intermediate.dense"] = "colwise"
            plan.styles[prefix + "output.dense"] = "rowwise"


def _check_heads(name: str, module: nn.Module, projections: list, tp: int, fused: bool) -> list[tuple[int, int]]:
    """(width, heads) of each projection, [] when the module names no head size; refuses head
    counts that do not divide by ``tp`` (a rank would hold part of a head)."""
    head_dim = next((getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)), None)
    if head_dim is None:
        return []
    found = []
    for projection in projections:
        width = _out_features(projection) // (3 if fused else 1)
        heads = width // head_dim
        if heads % tp:
            raise MethodConfigError(
                "tensor_parallel",
                f"{name or type(module).__name__} has {heads} heads of size {head_dim} ({width} features), "
                f"which do not divide over tensor size {tp}",
            )
        found.append((width, heads))
    return found


def plan_from_patterns(model: nn.Module, patterns: dict) -> TPPlan:
    plan = TPPlan()
    for name, module in model.named_modules():
        for pattern, style in patterns.items():
            if fnmatch.fnmatchcase(name, pattern):
                if not _is_linear(module):
                    raise MethodConfigError("tensor_parallel", f"plan pattern {pattern!r} matches {name}, which is not a Linear")
                plan.styles[name] = style
                break
    if not plan.styles:
        raise MethodConfigError("tensor_parallel", f"plan patterns {list(patterns)} match no module")
    return plan


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
SAVED_LAYOUTS_ATTR = "atorch_saved_layouts"  # module attribute: {param attr: PermutedLayout} (checkpointing reads it)


@dataclass(frozen=True)
class PermutedLayout:
    """A parameter whose live layout is its saved (user's) layout with dimension ``dim`` permuted:
    ``live.index_select(dim, i) == saved.index_select(dim, order[i])``. Kept on the module so that
    ``state_dict`` and checkpoints store the user's layout, which any other strategy can load."""

    order: torch.Tensor
    dim: int

    def to_saved(self, live: torch.Tensor) -> torch.Tensor:
        """The user's layout of a full (unsharded) live-layout tensor."""
        return live.index_select(self.dim, torch.argsort(self.order).to(live.device))

    def to_live(self, saved: torch.Tensor) -> torch.Tensor:
        """The live layout (full, unsharded) of a tensor in the user's layout."""
        return saved.index_select(self.dim, self.order.to(saved.device))


def _interleave_fused_qkv(model: nn.Module, fused_name: str, attention_name: str, tp: int) -> None:
    """Reorder the fused [q | k | v] output columns so rank r's contiguous share is [q_r | k_r | v_r],
    tell the attention its local split size, and restore the original layout in state_dict (and,
    through ``SAVED_LAYOUTS_ATTR``, in checkpoints)."""
    proj = model.get_submodule(fused_name)
    attention = model.get_submodule(attention_name) if attention_name else model
    out_dim = 1 if type(proj).__name__ == "Conv1D" else 0
    order = _interleaved_order(_out_features(proj), tp)
    with torch.no_grad():
        proj.weight.copy_(proj.weight.index_select(out_dim, order))
        if proj.bias is not None:
            proj.bias.copy_(proj.bias.index_select(0, order))
    if hasattr(attention, "split_size"):
        attention.split_size //= tp
    layouts = {"weight": PermutedLayout(order, out_dim)}
    if proj.bias is not None:
        layouts["bias"] = PermutedLayout(order, 0)
    setattr(proj, SAVED_LAYOUTS_ATTR, layouts)

    def restore(module, state, prefix, local_metadata):
        for key, layout in layouts.items():
            value = state.get(prefix + key)
            if value is not None:
                state[prefix + key] = layout.to_saved(value.full_tensor() if isinstance(value, DTensor) else value)
        return state

    proj._register_state_dict_hook(restore)


def _interleaved_order(width: int, tp: int) -> torch.Tensor:
    third, share = width // 3, width // 3 // tp
    return torch.tensor([part * third + rank * share + i for rank in range(tp) for part in range(3) for i in range(share)])


# --- the method ----------------------------------------------------------------------------------------
class TensorParallelOptimization(Optimization):
    name = "tensor_parallel"
    distributed_only = True
    config_class = TensorParallelConfig

    def transform(self, ctx, config: TensorParallelConfig) -> None:
        ctx.add_wrapper("model_parallel", self.name, lambda ctx: apply_tensor_parallel(ctx, config))


def apply_tensor_parallel(ctx, config: TensorParallelConfig) -> Optional[TPPlan]:
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
    tp_mesh = device_mesh["tensor"] if len(device_mesh.mesh_dim_names) > 1 else device_mesh
    targets = list(getattr(ctx.model, "stage_modules", None) or [ctx.model])  # pipeline stages, or the model
    plan = None
    for target in targets:
        plan = _parallelize(target, config, tp, tp_mesh, getattr(ctx, "sequence_parallel", False))
    ctx.model_parallel = True
    return plan


def _keep_pipeline_tied_whole(model: nn.Module, plan: TPPlan) -> None:
    """A pipeline stage's embedding or head tied to a copy on another stage stays whole: each stage
    plans alone and cannot see whether the other copy is split, and the copies' gradients are
    summed element by element, so both must keep the same layout."""
    tied = set(getattr(model, "tied_modules", ()))
    kept = sorted(tied & set(plan.vocab))
    if not kept:
        return
    logger.info("tensor_parallel: %s hold weights tied to another pipeline stage; they stay replicated", kept)
    plan.vocab = {name: role for name, role in plan.vocab.items() if name not in tied}
    if plan.tied_head and set(plan.tied_head) & tied:
        plan.tied_head = None


def _parallelize(model: nn.Module, config: TensorParallelConfig, tp: int, tp_mesh, sequence: bool) -> TPPlan:
    plan = plan_from_patterns(model, dict(config.plan)) if config.plan is not None else find_tp_plan(model, tp)
    _keep_pipeline_tied_whole(model, plan)
    sequence_plan = plan_sequence_parallel(model, plan.styles) if sequence else None  # refusals before any change
    for fused, attention in plan.fused_qkv.items():
        _interleave_fused_qkv(model, fused, attention, tp)
    row_output = Shard(-2) if sequence else Replicate()  # the token dimension, before the features
    styles = {name: (ConvColwise() if style == "colwise" else ConvRowwise(output_layouts=row_output))
              for name, style in plan.styles.items()}
    styles.update({name: RowwiseParallel(input_layouts=Replicate()) if role == "embedding"
                   else ColwiseParallel(output_layouts=Replicate()) for name, role in plan.vocab.items()})
    styles.update({name: ColwiseParallel() for name in plan.head_bias})  # [.., heads] -> this rank's heads
    parallelize_module(model, tp_mesh, styles)
    if plan.tied_head:  # both sides are sharded Shard(0) on the vocabulary: tie the DTensor again
        head, embedding = (model.get_submodule(n) for n in plan.tied_head)
        head.weight = embedding.weight
    for attention, counts in plan.head_counts.items():
        _localize_head_counts(model.get_submodule(attention) if attention else model, counts, tp)
    if sequence_plan is not None:
        apply_sequence_parallel(model, sequence_plan, tp_mesh)
    logger.info("tensor_parallel: split %d projections and %s on the vocabulary over %d ranks; replicated: %s",
                len(plan.styles), list(plan.vocab) or "nothing", tp, ", ".join(plan.replicated) or "nothing")
    return plan


def _localize_head_counts(attention: nn.Module, counts: set, tp: int) -> None:
    """Attention code that reads its head count (T5's n_heads for the zero position bias, older
    code's num_heads / all_head_size in views) must see this rank's share. Only attributes whose
    value is one of the split projections' head counts or widths are divided."""
    for attr in HEAD_COUNT_ATTRS:
        value = getattr(attention, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value in counts:
            setattr(attention, attr, value // tp)

"""tensor_parallel: Megatron-style splitting found from the model's structure, applied with DTensor.

How the plan is found (``docs/model-parallel.md``): one forward of a sample batch of the user's data
is recorded (``atorch.utils.dataflow``) and read by ``tp_discovery``: MLP pairs (a Linear reaching
other Linears only through activations, gates and dropout: column then row), attention (projections
feeding ``scaled_dot_product_attention`` or a matmul-softmax-matmul: column; the projection its
result reaches: row; fused q|k|v and k|v projections reordered so every rank holds its heads of
each part; head counts from the projection widths and the operands' head size), and per-head score
biases (T5). Names play no part; ``nn.MultiheadAttention`` is first swapped for an equivalent with
separate projections (``tp_mha``). Without a sample to run (no dataset) the older name lists serve
as a fast path. A user's ``{"plan": ...}`` replaces both.

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

from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.sequence_parallel import apply_sequence_parallel, plan_sequence_parallel
from atorch.auto.opt_lib.tp_check import Probe, check_plan, probe_from_context
from atorch.auto.opt_lib.tp_discovery import Discovery, discover
from atorch.auto.opt_lib.tp_mha import split_mha
from atorch.auto.opt_lib.tp_shapes import install_localizer, localize_attributes
from atorch.checkpoint.tensors import SAVED_LAYOUTS_ATTR
from atorch.distributed import mesh
from atorch.errors import MethodConfigError
from atorch.utils.config import MethodConfig, option
from atorch.utils.dataflow import Dataflow
from atorch.utils.modules import repeated_blocks

logger = logging.getLogger(__name__)

QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"))
FUSED_QKV_NAMES = ("c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value")
OUT_NAMES = ("o_proj", "out_proj", "c_proj", "o", "out_lin", "dense")
MLP_PAIRS = ((("gate_proj", "up_proj"), "down_proj"), (("up_proj",), "down_proj"), (("fc1",), "fc2"),
             (("c_fc",), "c_proj"), (("w1", "w3"), "w2"), (("lin1",), "lin2"), (("wi_0", "wi_1"), "wo"),
             (("wi",), "wo"))
HEAD_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")
Style = Literal["colwise", "rowwise"]


@dataclass(frozen=True)
class TensorParallelConfig(MethodConfig):
    plan: Optional[tuple[tuple[str, Style], ...]] = option(
        None, doc="{module-name glob: 'colwise' | 'rowwise'} (kept as pairs) replacing detection; None: detect the "
        "attention and MLP projections")


@dataclass
class TPPlan:
    styles: dict[str, str] = field(default_factory=dict)        # module name -> colwise / rowwise
    fused: dict[str, list[int]] = field(default_factory=dict)   # fused projection -> widths of its parts (q|k|v)
    replicated: list[str] = field(default_factory=list)         # parameter-holding leaves left whole
    vocab: dict[str, str] = field(default_factory=dict)         # module name -> "embedding" / "head" (vocab split)
    tied_head: Optional[tuple[str, str]] = None                 # (head, embedding) sharing one weight
    head_bias: list[str] = field(default_factory=list)          # per-head embeddings (T5 relative bias): column split
    regions: dict[str, set] = field(default_factory=dict)       # module holding a split group -> its full sizes
    region_heads: dict[str, set] = field(default_factory=dict)  # the same -> its full head counts
    found_by: str = "structure"                                 # structure / names / plan
    why_whole: dict[str, str] = field(default_factory=dict)     # Linear left whole -> why
    shapes: str = "views"                                       # how run-time shapes were made local (tp_shapes)
    share: float = 0.0                                          # share of the parameters split

    def report(self) -> dict:
        """What ``result.args.extras["tensor_parallel"]`` shows: what was split how, what stayed whole."""
        return {"found_by": self.found_by,
                "colwise": [n for n, s in self.styles.items() if s == "colwise"],
                "rowwise": [n for n, s in self.styles.items() if s == "rowwise"],
                "vocabulary": dict(self.vocab), "per_head": list(self.head_bias), "fused": dict(self.fused),
                "replicated": list(self.replicated), "why_whole": dict(self.why_whole), "run_time_shapes": self.shapes,
                "split_share": round(self.share, 4)}


def split_names(plan: "TPPlan") -> list[str]:
    return [*plan.styles, *plan.vocab, *plan.head_bias]


def split_share(model: nn.Module, plan: "TPPlan") -> float:
    """The share of the model's parameters (by count) that the plan splits."""
    split = {id(p) for name in split_names(plan) for p in model.get_submodule(name).parameters()}
    total = {id(p): p.numel() for p in model.parameters()}
    return sum(n for i, n in total.items() if i in split) / max(1, sum(total.values()))


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _out_features(module: nn.Module) -> int:
    return module.weight.shape[0] if isinstance(module, nn.Linear) else module.weight.shape[1]


# --- finding the plan ------------------------------------------------------------------------------
def find_tp_plan(model: nn.Module, tp: int, flow: Optional[Dataflow] = None) -> TPPlan:
    """The plan from the recorded dataflow of one forward (``flow``), or from the name lists when
    there is no sample to record. A model with nothing to split is refused: tensor_parallel would
    silently leave every rank computing the whole model."""
    plan = plan_from_structure(model, flow, tp) if flow is not None else _plan_from_names(model, tp)
    if not plan.styles:
        _refuse_nothing_to_split(model, plan)
    _find_vocab_parallel(model, tp, plan)
    split = set(split_names(plan))
    plan.why_whole = {n: why for n, why in plan.why_whole.items() if n not in split}
    for name, module in model.named_modules():
        leaf = not list(module.children())
        if leaf and any(True for _ in module.parameters(recurse=False)) and name not in split:
            plan.replicated.append(name)
    return plan


def plan_from_structure(model: nn.Module, flow: Dataflow, tp: int) -> TPPlan:
    """The plan ``tp_discovery`` reads off the dataflow, with head counts and widths checked."""
    found = discover(model, flow)
    plan = TPPlan(found_by="structure", why_whole=dict(found.why_whole))
    for name in found.colwise:
        plan.styles[name] = "colwise"
    for name in found.rowwise:
        plan.styles[name] = "rowwise"
    plan.fused = {n: parts for n, parts in found.fused.items()}
    plan.head_bias = list(found.head_bias)
    sizes = _full_sizes(model, found)
    widths = {n: {_out_features(model.get_submodule(n)), *found.fused.get(n, [])} for n in found.colwise}
    for cols, rows in found.groups:
        region = _common_parent([*cols, *rows])
        plan.regions.setdefault(region, set()).update(s for n in cols for s in sizes[n])
        plan.region_heads.setdefault(region, set()).update(s for n in cols for s in sizes[n] - widths[n])
    _check_divisible(model, found, sizes, tp)
    return plan


def _full_sizes(model: nn.Module, found: Discovery) -> dict[str, set[int]]:
    """Per column-split Linear, the sizes that become 1/tp on a rank: its width, its parts' widths,
    and the head counts of each part."""
    sizes: dict[str, set[int]] = {}
    for name in found.colwise:
        width = _out_features(model.get_submodule(name))
        sizes[name] = {width, *found.fused.get(name, [])}
    for attention in found.attentions:
        for name, heads in attention.heads.items():
            parts = len(found.fused.get(name, [1]))
            sizes[name] |= {heads // parts}
    return sizes


def _check_divisible(model: nn.Module, found: Discovery, sizes: dict[str, set[int]], tp: int) -> None:
    """Every split width and head count must divide by ``tp``: a rank holds whole heads."""
    for attention in found.attentions:
        for name, heads in attention.heads.items():
            per_part = heads // len(found.fused.get(name, [1]))
            if per_part % tp:
                raise MethodConfigError(
                    "tensor_parallel", f"{name} computes {per_part} heads of size {attention.head_dim} "
                    f"({_out_features(model.get_submodule(name))} features), which do not divide over tensor size {tp}")
    for name in found.colwise:
        width = _out_features(model.get_submodule(name))
        if width % tp:
            raise MethodConfigError("tensor_parallel", f"{name} has {width} output features, which do not divide over "
                                    f"tensor size {tp}")


def _common_parent(names: list[str]) -> str:
    """The innermost module holding all ``names`` ("" for the model itself)."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _plan_from_names(model: nn.Module, tp: int) -> TPPlan:
    """The fast path by the usual projection names (no sample batch to record a forward with)."""
    plan = TPPlan(found_by="names", shapes="attributes")
    for name, module in model.named_modules():
        children = {n: c for n, c in module.named_children() if _is_linear(c)}
        prefix = f"{name}." if name else ""
        qkv = next((t for t in QKV_NAMES if all(n in children for n in t)), None)
        fused = next((n for n in FUSED_QKV_NAMES if n in children), None)
        if qkv or fused:
            heads = _check_heads(name, module, [children[n] for n in (qkv or (fused,))], tp,
                                 fused=bool(fused) and not qkv)
            if heads:
                plan.regions[name] = {v for pair in heads for v in pair}
                plan.head_bias += _head_bias(module, prefix, heads[0][1])
            for n in qkv or (fused,):
                plan.styles[prefix + n] = "colwise"
            if fused and not qkv:
                width = _out_features(children[fused])
                plan.fused[prefix + fused] = [width // 3] * 3
                plan.regions.setdefault(name, set()).update({width // 3, width})
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
    return plan


def _refuse_nothing_to_split(model: nn.Module, plan: TPPlan) -> None:
    """The reason, with what the model does hold, so a user sees why (a CNN has no Linear pairs)."""
    linears = [n for n, m in model.named_modules() if _is_linear(m)]
    held = (f"its Linear layers ({', '.join(linears[:4])}{', ...' if len(linears) > 4 else ''}) form none"
            if linears else "it holds no Linear")
    whys = "; ".join(f"{n}: {why}" for n, why in list(plan.why_whole.items())[:3])
    how = "in its traced forward" if plan.found_by == "structure" else "by name (no sample batch to trace)"
    raise MethodConfigError(
        "tensor_parallel", f"{type(model).__name__} has no attention projections and no MLP Linear pair {how} "
        f"({held}{'; ' + whys if whys else ''}): with nothing to split every rank would hold and compute the whole "
        "model; name the projections with {'plan': {...}} or use data parallelism")


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
        logger.info("tensor_parallel: vocabulary %d does not divide by %d; %s and the LM head stay replicated",
                    vocab, tp, embedding_name)
        return
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    in_blocks = _inside_blocks(model)
    for name, module in model.named_modules():
        if (not isinstance(module, nn.Linear) or module.out_features != vocab or name in plan.styles
                or name in in_blocks):
            continue
        shared = {o for p in module.parameters(recurse=False) for o in owners[id(p)]} - {name, embedding_name}
        if shared:
            logger.info("tensor_parallel: LM head %s shares parameters with %s; it stays replicated", name,
                        sorted(shared))
            continue
        plan.vocab[name] = "head"
        if module.weight is embedding.weight:
            plan.tied_head = (name, embedding_name)
    others = set(owners[id(embedding.weight)]) - {embedding_name} - set(plan.vocab)
    if others:  # tied to a module that stays whole: splitting either side would untie them
        logger.info("tensor_parallel: %s shares its weight with %s; both stay replicated", embedding_name,
                    sorted(others))
        plan.vocab = {n: r for n, r in plan.vocab.items() if model.get_submodule(n).weight is not embedding.weight}
        plan.tied_head = None
        return
    plan.vocab[embedding_name] = "embedding"


def _inside_blocks(model: nn.Module) -> set[str]:
    """Names of modules inside the repeated blocks: an MLP whose width equals the vocabulary is no head."""
    classes = set(repeated_blocks(model)[0])
    blocks = [n for n, m in model.named_modules() if type(m).__name__ in classes]
    return {n for n, _ in model.named_modules() if any(n.startswith(b + ".") for b in blocks)}


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
                    raise MethodConfigError("tensor_parallel",
                                            f"plan pattern {pattern!r} matches {name}, which is not a Linear")
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
# a module's SAVED_LAYOUTS_ATTR ({param attr: PermutedLayout}) tells checkpoints the user's layout


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


def _interleave_fused(model: nn.Module, fused_name: str, parts: list[int], tp: int) -> None:
    """Reorder the fused [q | k | v] (or [k | v]) output columns so rank r's contiguous share is
    [q_r | k_r | v_r], and restore the original layout in state_dict (and, through
    ``SAVED_LAYOUTS_ATTR``, in checkpoints)."""
    proj = model.get_submodule(fused_name)
    out_dim = 1 if type(proj).__name__ == "Conv1D" else 0
    order = _interleaved_order(parts, tp)
    with torch.no_grad():
        proj.weight.copy_(proj.weight.index_select(out_dim, order))
        if proj.bias is not None:
            proj.bias.copy_(proj.bias.index_select(0, order))
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


def _interleaved_order(parts: list[int], tp: int) -> torch.Tensor:
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return torch.tensor([start + rank * (width // tp) + i for rank in range(tp)
                         for start, width in zip(starts, parts) for i in range(width // tp)])


# --- the method ----------------------------------------------------------------------------------------
class TensorParallelOptimization(Optimization):
    name = "tensor_parallel"
    distributed_only = True
    config_class = TensorParallelConfig

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
            applied = _apply_to_stage(stage, plan, config, tp, tp_mesh, sequence)
        plan = given or applied
    else:
        plan = _parallelize(ctx.model, config, tp, tp_mesh, sequence, probe_from_context(ctx))
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
                               regions=_on_stage(stage, whole.regions, linear=False),
                               region_heads=_on_stage(stage, whole.region_heads, linear=False), replicated=[])
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
    summed element by element, so both must keep the same layout."""
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
    if given is None:
        plan.share = split_share(model, plan)
    sequence_plan = plan_sequence_parallel(model, plan.styles, flow) if sequence else None  # refusals first
    for fused, parts in plan.fused.items():
        _interleave_fused(model, fused, parts, tp)
    replicated_rows = sequence_plan.replicated_rows if sequence_plan is not None else set()
    styles = {name: (ConvColwise() if style == "colwise" else
                     ConvRowwise(output_layouts=Shard(-2) if sequence and name not in replicated_rows else Replicate()))
              for name, style in plan.styles.items()}  # Shard(-2): the token dimension, before the features
    styles.update({name: RowwiseParallel(input_layouts=Replicate()) if role == "embedding"
                   else ColwiseParallel(output_layouts=Replicate()) for name, role in plan.vocab.items()})
    styles.update({name: ColwiseParallel() for name in plan.head_bias})  # [.., heads] -> this rank's heads
    parallelize_module(model, tp_mesh, styles)
    if plan.tied_head:  # both sides are sharded Shard(0) on the vocabulary: tie the DTensor again
        head, embedding = (model.get_submodule(n) for n in plan.tied_head)
        head.weight = embedding.weight
    if sequence_plan is not None:
        apply_sequence_parallel(model, sequence_plan, tp_mesh)
    regions = {name: model.get_submodule(name) for name in plan.regions}
    localizers = {name: install_localizer(module, plan.regions[name], tp) for name, module in regions.items()}
    if probe is not None and reference is not None:
        plan.shapes = check_plan(model, probe, reference, regions, plan.regions, plan.region_heads, localizers, tp,
                                 tp_mesh.get_group(), _describe(plan))
    elif plan.shapes in ("heads", "attributes"):
        chosen = plan.region_heads if plan.shapes == "heads" else plan.regions
        for name, module in regions.items():
            localize_attributes(module, chosen.get(name, set()), tp)
    logger.info("tensor_parallel (%s): split %d projections and %s on the vocabulary over %d ranks; replicated: %s",
                plan.found_by, len(plan.styles), list(plan.vocab) or "nothing", tp,
                ", ".join(plan.replicated) or "nothing")
    return plan


def _record(model: nn.Module, probe: Probe):
    """The sample forward's dataflow and output; (None, None) when the sample does not run on the
    model as it is (then the name lists serve, unchecked, and the log says so)."""
    try:
        return probe.record(model)
    except Exception as error:
        logger.warning("tensor_parallel: the sample row did not run through the model (%s: %s); the plan is taken "
                       "from projection names and cannot be checked before training", type(error).__name__, error)
        return None, None


def _describe(plan: TPPlan) -> str:
    cols = [n for n, s in plan.styles.items() if s == "colwise"]
    rows = [n for n, s in plan.styles.items() if s == "rowwise"]
    return (f"column-wise {', '.join(cols[:4])}{', ...' if len(cols) > 4 else ''}; row-wise "
            f"{', '.join(rows[:4])}{', ...' if len(rows) > 4 else ''}")

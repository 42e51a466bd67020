"""tensor_parallel's plan: which modules are split how, found from the recorded dataflow of one
forward (``tp_discovery``) or, without a sample, from the projection name lists (the fast path), or
given as patterns; with the vocabulary split of the embedding and LM head and the per-head biases.

``tensor_parallel.py`` applies the plan; this module only finds it (the search's model analysis
reads it too).
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from atorch.auto.opt_lib.tp_discovery import (
    SHARED_KV_WHY,
    Discovery,
    FoundAttention,
    discover,
    inside_repeated_blocks,
    through_feature_norms,
)
from atorch.auto.opt_lib.tp_experts import find_expert_banks
from atorch.errors import MethodConfigError
from atorch.utils.dataflow import SOFTMAX, Dataflow

logger = logging.getLogger("atorch.auto.opt_lib.tensor_parallel")  # the method's log lines, as before

QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"))
FUSED_QKV_NAMES = ("c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value")
OUT_NAMES = ("o_proj", "out_proj", "c_proj", "o", "out_lin", "dense")
MLP_PAIRS = ((("gate_proj", "up_proj"), "down_proj"), (("up_proj",), "down_proj"), (("fc1",), "fc2"),
             (("c_fc",), "c_proj"), (("w1", "w3"), "w2"), (("lin1",), "lin2"), (("wi_0", "wi_1"), "wo"),
             (("wi",), "wo"))
HEAD_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")


@dataclass
class TPPlan:
    styles: dict[str, str] = field(default_factory=dict)        # module name -> colwise / rowwise
    fused: dict[str, list[int]] = field(default_factory=dict)   # fused projection -> widths of its parts (q|k|v)
    replicated: list[str] = field(default_factory=list)         # parameter-holding leaves left whole
    vocab: dict[str, str] = field(default_factory=dict)         # module name -> "embedding" / "head" (vocab split)
    tied_head: Optional[tuple[str, str]] = None                 # (head, embedding) sharing one weight
    head_bias: list[str] = field(default_factory=list)          # per-head embeddings (T5 relative bias): column split
    head_norms: dict[str, int] = field(default_factory=dict)    # per-head norms (Qwen3 q / k norm) -> their heads dim
    # modules applying a module of their own to each head (StableLM 2's q / k LayerNorm per head, an
    # nn.ModuleList as long as the heads) -> their heads dim: run on every head, gathered, then cut back
    head_module_lists: dict[str, int] = field(default_factory=dict)
    feature_norms: dict[str, int] = field(default_factory=dict)  # norms over a split projection (OLMo 2) -> its width
    # elementwise modules with scalar parameters on a split tensor (xIELU's, PReLU's one gain): whole, run on the
    # rank's features, their gradients summed over the tensor group
    feature_gains: list[str] = field(default_factory=list)
    # attention module -> tensors it broadcasts from one head to all (MLA's rotary key): (ndim, heads dim, last size)
    shared_heads: dict[str, list] = field(default_factory=dict)
    # projections of the one key / value head every query head reads (multi-query attention): whole, the
    # gradient of their output summed over the tensor group
    shared_kv: list[str] = field(default_factory=list)
    # module in a split attention -> its own per-head parameters -> the dimension holding the heads: one
    # value per query head along the last (gpt-oss's attention sinks, Swin's relative position bias table),
    # or a norm's weight per head and feature, [heads, head size] (Cohere's q / k norms): split with the heads
    head_params: dict[str, dict[str, int]] = field(default_factory=dict)
    # (module, its attribute, the split parameter's full name): a parameter of a vocabulary-split head that a
    # module above it holds too (BERT-style LM heads' bias), pointed at the split parameter again
    aliases: list[tuple[str, str, str]] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)            # MoE expert banks split by expert (tp_experts)
    regions: dict[str, set] = field(default_factory=dict)       # module holding a split group -> its full sizes
    region_heads: dict[str, set] = field(default_factory=dict)  # the same -> its full head counts
    region_head_dims: dict[str, set] = field(default_factory=dict)  # the same -> its attention's head sizes
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
                "per_head_norms": list(self.head_norms), "per_head_module_lists": list(self.head_module_lists),
                "split_norms": list(self.feature_norms),
                "feature_gains": list(self.feature_gains),
                "experts": list(self.experts), "shared_kv": list(self.shared_kv),
                "per_head_params": [f"{m}.{n}" for m, names in self.head_params.items() for n in names],
                "replicated": list(self.replicated), "why_whole": dict(self.why_whole), "run_time_shapes": self.shapes,
                "split_share": round(self.share, 4)}


def split_names(plan: "TPPlan") -> list[str]:
    return [*plan.styles, *plan.vocab, *plan.head_bias, *plan.experts, *plan.feature_norms]


def split_param_ids(model: nn.Module, plan: "TPPlan", held_by=None) -> set[int]:
    """The ids of the parameters the plan splits: every parameter of a split module, and the attention
    modules' own per-head parameters. ``held_by(model, name)``: the module under that name (a swapped
    module's nearest holder), ``get_submodule`` by default."""
    held_by = held_by or (lambda m, name: m.get_submodule(name))
    split = {id(p) for name in split_names(plan) for p in held_by(model, name).parameters()}
    for name, params in plan.head_params.items():
        module = held_by(model, name)
        split |= {id(getattr(module, n)) for n in params if isinstance(getattr(module, n, None), torch.Tensor)}
    return split


def split_share(model: nn.Module, plan: "TPPlan") -> float:
    """The share of the model's parameters (by count) that the plan splits."""
    split = split_param_ids(model, plan)
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
    plan.experts, unsplit_banks = find_expert_banks(model, tp)
    plan.why_whole.update(unsplit_banks)
    if not plan.styles and not plan.experts:
        _refuse_nothing_to_split(model, plan)
    _find_vocab_parallel(model, tp, plan)
    split = set(split_names(plan))
    plan.why_whole = {n: why for n, why in plan.why_whole.items() if n not in split}
    for name, module in model.named_modules():
        leaf = not list(module.children())
        if (leaf and any(True for _ in module.parameters(recurse=False)) and name not in split
                and name not in plan.head_norms and name not in plan.feature_norms and name not in plan.head_params
                and name not in plan.feature_gains):
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
    # only a part-by-part layout ([q | k | v]) is reordered; a head-by-head one splits as it is
    plan.fused = {n: parts for n, parts in found.fused.items() if n not in found.parts_within_heads}
    plan.head_bias = list(found.head_bias)
    plan.shared_kv = list(found.shared_kv)
    plan.head_module_lists = _head_module_lists(model, flow, found)
    plan.head_norms, per_head_weights = _head_norms(model, flow, found, inside=tuple(plan.head_module_lists))
    plan.feature_norms, plan.feature_gains = _feature_modules(model, flow, found)
    plan.head_params = {**_head_params(model, found), **per_head_weights}
    for attention in found.attentions:
        if attention.shared_heads:
            names = [n for names in attention.inputs.values() for n in names] + attention.outputs
            plan.shared_heads.setdefault(_common_parent(names), []).extend(attention.shared_heads)
    sizes = _full_sizes(model, found)
    widths = {n: {_out_features(model.get_submodule(n)), *found.fused.get(n, [])} for n in found.colwise}
    for cols, rows in found.groups:
        region = _common_parent([*cols, *rows])
        plan.regions.setdefault(region, set()).update(s for n in cols for s in sizes[n])
        plan.region_heads.setdefault(region, set()).update(s for n in cols for s in sizes[n] - widths[n])
    for attention in found.attentions:
        region = _common_parent([n for names in attention.inputs.values() for n in names] + attention.outputs)
        if region in plan.regions and attention.head_dim:
            plan.region_head_dims.setdefault(region, set()).add(attention.head_dim)
    _check_divisible(model, found, sizes, tp)
    return plan


def _head_norms(model: nn.Module, flow: Dataflow, found: Discovery,
                inside: tuple[str, ...] = ()) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Modules inside a split attention that normalise each head's features: called on a tensor whose
    last dimension is the head size with a heads dimension before it. Those whose parameters are of one
    head's size (Qwen3's, Gemma 3's q / k norms: shared by the heads) run on this rank's heads with their
    parameters replicated, so their gradients are summed over the ranks: name -> the heads dimension,
    counted from the end (the first dict). Those whose parameters are that tensor's last two dimensions
    (Cohere's: a weight per head and feature, [heads, head size]) have them split on the heads
    dimension (0) like the heads they scale: name -> {parameter: 0} (the second, for ``head_params``).
    Modules under one of ``inside`` (a per-head module list's) are left to it."""
    shared: dict[str, int] = {}
    per_head: dict[str, dict[str, int]] = {}
    for attention, heads, name, module, shape in _on_the_heads(model, flow, found):
        params = dict(module.named_parameters(recurse=False))
        if not params or _is_linear(module) or any(name.startswith(f"{n}.") for n in inside):
            continue
        if all(p.numel() == attention.head_dim for p in params.values()):
            dim = next((d for d in range(-2, -len(shape) - 1, -1) if shape[d] in heads), None)
            if dim is not None:
                shared[name] = dim
        elif shape[-2] in heads and all(tuple(p.shape) == tuple(shape[-2:]) for p in params.values()):
            per_head[name] = dict.fromkeys(params, 0)
    return shared, per_head


def _on_the_heads(model: nn.Module, flow: Dataflow, found: Discovery):
    """(attention, its heads counts, name, module, input shape) for each module inside a split attention,
    other than its projections, called on a tensor whose last dimension is the attention's head size."""
    for attention in found.attentions:
        names = [n for names in attention.inputs.values() for n in names] + attention.outputs
        region = _common_parent(names)
        heads = {h for n in attention.heads for h in part_heads(attention, n)}
        prefix = f"{region}." if region else ""
        for name, module in model.named_modules():
            shape = flow.module_inputs.get(name, ())
            if name.startswith(prefix) and name not in names and len(shape) >= 3 and shape[-1] == attention.head_dim:
                yield attention, heads, name, module, shape


def _head_module_lists(model: nn.Module, flow: Dataflow, found: Discovery) -> dict[str, int]:
    """Modules inside a split attention that apply a module of their own to each head: called on a
    tensor whose last dimension is the head size, holding no parameters themselves but an
    ``nn.ModuleList`` as long as one of that tensor's dimensions, a heads count of the attention, whose
    modules hold parameters (StableLM 2's q / k ``LayerNorm`` per head, zipped with the heads split one
    by one). A rank holding some heads would pair them with the list's first modules: so such a module
    runs on every head, gathered over the tensor group, and keeps its rank's heads of the result
    (name -> the heads dimension, counted from the end)."""
    out: dict[str, int] = {}
    for _, heads, name, module, shape in _on_the_heads(model, flow, found):
        if any(True for _ in module.parameters(recurse=False)):
            continue
        lengths = {len(child) for child in module.children()
                   if isinstance(child, nn.ModuleList) and len(child) in heads
                   and all(any(True for _ in m.parameters()) for m in child)}
        dim = next((d for d in range(-2, -len(shape) - 1, -1) if shape[d] in lengths), None)
        if dim is not None:
            out[name] = dim
    return out


def _head_params(model: nn.Module, found: Discovery) -> dict[str, dict[str, int]]:
    """A split attention's own parameters with one value per query head along their last dimension, held
    by the attention's modules other than its Linears: gpt-oss's attention sinks (a logit per head joined
    to the scores), Swin's relative position bias tables ([relative positions, heads], a bias per head
    added to the scores; BEiT's, held by the layer outside its attention, is not found here). Each rank
    keeps its heads' values (their last dimension split)."""
    out: dict[str, dict[str, int]] = {}
    for attention in found.attentions:
        names = [n for names in attention.inputs.values() for n in names] + attention.outputs
        parent = _common_parent(names)
        q_heads = part_heads(attention, attention.inputs["q"][0])[0] if attention.inputs.get("q") else 0
        if q_heads < 2:
            continue
        for name, module in model.get_submodule(parent).named_modules(prefix=parent):
            if name in names or name in found.head_bias or _is_linear(module) or isinstance(module, nn.Embedding):
                continue  # per-head embeddings (T5's relative bias) are split as embeddings: head_bias
            found_here = {n: -1 for n, p in module.named_parameters(recurse=False)
                          if p.dim() in (1, 2) and p.shape[-1] == q_heads and (p.dim() == 1 or p.shape[0] != q_heads)}
            if found_here:
                out[name] = dict(sorted({**out.get(name, {}), **found_here}.items()))
    return out


def _feature_modules(model: nn.Module, flow: Dataflow, found: Discovery) -> tuple[dict[str, int], list[str]]:
    """Modules with parameters of their own that run on a split tensor's whole features, between the
    column-split projections and the row-wise ones.

    Norms (the first result, name -> width): own parameters all 1-D of that width, called on it (a norm
    over one head's features is a head norm instead): OLMo 2's q / k RMSNorm over every head's
    features, BitNet's ``attn_sub_norm`` after its attention and ``ffn_sub_norm`` inside its MLP. Split,
    they hold their parameters' share of the features and run on DTensors, whose reduction over the
    sharded features is summed over the tensor group, so they compute as in one process.

    Gains (the second): leaves whose parameters are all single values applied to every feature
    (Apertus's xIELU activation, a one-parameter PReLU). Whole, they run on this rank's features as
    DTensors, so the gradients of their parameters, partial on each rank, are summed over the group."""
    split = _split_feature_nodes(flow, found, found.feature_widths)
    head_dims = {attention.head_dim for attention in found.attentions}
    norms: dict[str, int] = {}
    gains: list[str] = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        shape = flow.module_inputs.get(name, ())
        if (not params or not shape or flow.module_input_nodes.get(name) not in split or _is_linear(module)
                or list(module.children())):
            continue
        if all(p.dim() == 1 and p.numel() == shape[-1] for p in params) and shape[-1] not in head_dims:
            norms[name] = shape[-1]
        elif all(p.numel() == 1 for p in params):
            gains.append(name)
    return norms, gains


def _split_feature_nodes(flow: Dataflow, found: Discovery, widths: frozenset) -> set[int]:
    """The tensors made from the column-split projections' outputs before a row-wise projection reads
    them: through column-local ops, norms over the features and the attention cores."""
    through_norms = through_feature_norms(flow, widths)

    def passes(op) -> bool:
        return through_norms(op) or op.kind in ("attention", "matmul") or op.name in SOFTMAX

    starts = [node for name in found.colwise for call in flow.calls_of(name) for node in call.outputs]
    return set(flow.forward_closure(starts, passes)[0])


def _full_sizes(model: nn.Module, found: Discovery) -> dict[str, set[int]]:
    """Per column-split Linear, the sizes that become 1/tp on a rank: its width, its parts' widths,
    and the head counts of each part."""
    sizes: dict[str, set[int]] = {}
    for name in found.colwise:
        width = _out_features(model.get_submodule(name))
        sizes[name] = {width, *found.fused.get(name, [])}
    for attention in found.attentions:
        for name in attention.heads:
            sizes[name] |= set(part_heads(attention, name))
    return sizes


def part_heads(attention: FoundAttention, name: str) -> list[int]:
    """The head count of each part of ``name`` (one entry when it is not fused)."""
    widths = attention.parts.get(name)
    return [w // attention.head_dim for w in widths] if widths else [attention.heads[name]]


def _check_divisible(model: nn.Module, found: Discovery, sizes: dict[str, set[int]], tp: int) -> None:
    """Every split width and head count must divide by ``tp``: a rank holds whole heads."""
    for attention in found.attentions:
        for name in attention.heads:
            for per_part in part_heads(attention, name):
                if per_part % tp:
                    raise MethodConfigError(
                        "tensor_parallel", f"{name} computes {per_part} heads of size {attention.head_dim}"
                        f"{' in one of its parts ' + str(attention.parts[name]) if name in attention.parts else ''} "
                        f"({_out_features(model.get_submodule(name))} features), which do not divide over tensor "
                        f"size {tp}")
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
            shared = _single_kv_heads(module, children, qkv) if qkv else []
            if shared:
                plan.shared_kv += [prefix + n for n in shared]
                plan.why_whole.update(dict.fromkeys((prefix + n for n in shared), SHARED_KV_WHY))
                qkv = tuple(n for n in qkv if n not in shared)
            if fused and not qkv and not _equal_thirds(module, children[fused]):
                why = ("fused, but its parts are not three equal thirds of its module's heads (multi-query or "
                       "grouped keys / values): without a sample batch to read them from, the attention stays whole")
                plan.why_whole.update({prefix + fused: why})
                continue
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
    in_blocks = inside_repeated_blocks(model)
    for name, module in model.named_modules():
        if (not isinstance(module, nn.Linear) or module.out_features != vocab or name in plan.styles
                or name in in_blocks):
            continue
        aliases = _ancestor_aliases(model, name, module)
        shared = {o for p in module.parameters(recurse=False) for o in owners[id(p)]} - {name, embedding_name}
        shared -= {owner for owner, _, _ in aliases}
        if shared:
            logger.info("tensor_parallel: LM head %s shares parameters with %s; it stays replicated", name,
                        sorted(shared))
            continue
        plan.vocab[name] = "head"
        plan.aliases += aliases
        if module.weight is embedding.weight:
            plan.tied_head = (name, embedding_name)
    others = set(owners[id(embedding.weight)]) - {embedding_name} - set(plan.vocab)
    if others:  # tied to a module that stays whole: splitting either side would untie them
        logger.info("tensor_parallel: %s shares its weight with %s; both stay replicated", embedding_name,
                    sorted(others))
        plan.vocab = {n: r for n, r in plan.vocab.items() if model.get_submodule(n).weight is not embedding.weight}
        plan.aliases = [alias for alias in plan.aliases if alias[2].rpartition(".")[0] in plan.vocab]
        plan.tied_head = None
        return
    plan.vocab[embedding_name] = "embedding"


def _ancestor_aliases(model: nn.Module, name: str, module: nn.Module) -> list[tuple[str, str, str]]:
    """Parameters of ``module`` that a module above it holds too under its own name (BERT's, RoBERTa's
    and DeBERTa's LM head: ``self.decoder.bias = self.bias``), as (that module, its name for it, the
    parameter's full name under ``module``): re-aliased to the split parameter after the split."""
    found = []
    for param_name, param in module.named_parameters(recurse=False):
        for owner_name, owner in model.named_modules():
            if not name.startswith(f"{owner_name}." if owner_name else ""):
                continue
            found += [(owner_name, attr, f"{name}.{param_name}") for attr, p in owner.named_parameters(recurse=False)
                      if p is param]
    return found


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


def _int_attribute(module: nn.Module, names: tuple[str, ...]) -> Optional[int]:
    """The first of ``names`` the module holds as an integer (its head size, its head count), or None."""
    return next((getattr(module, a) for a in names if isinstance(getattr(module, a, None), int)), None)


def _equal_thirds(module: nn.Module, fused: nn.Module) -> bool:
    """Whether a fused projection is [q | k | v] of equal widths by the module's head count and size
    (True where the module names neither: the older assumption, checked on the sample where there is one)."""
    head_dim = _int_attribute(module, HEAD_ATTRS)
    heads = _int_attribute(module, HEAD_COUNT_ATTRS)
    return not (head_dim and heads) or _out_features(fused) == 3 * heads * head_dim


def _single_kv_heads(module: nn.Module, children: dict[str, nn.Module], qkv: tuple[str, ...]) -> list[str]:
    """The key / value projections of one head beside several query heads (multi-query attention), by
    the module's head size: they stay whole (``TPPlan.shared_kv``)."""
    head_dim = _int_attribute(module, HEAD_ATTRS)
    if not head_dim or _out_features(children[qkv[0]]) // head_dim < 2:
        return []
    return [n for n in qkv[1:] if _out_features(children[n]) == head_dim]


def _check_heads(name: str, module: nn.Module, projections: list, tp: int, fused: bool) -> list[tuple[int, int]]:
    """(width, heads) of each projection, [] when the module names no head size; refuses head
    counts that do not divide by ``tp`` (a rank would hold part of a head)."""
    head_dim = _int_attribute(module, HEAD_ATTRS)
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



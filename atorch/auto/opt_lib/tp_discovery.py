"""Finding the tensor-parallel plan from a model's structure: its recorded dataflow, not its names.

One forward of a sample batch is recorded (``atorch.utils.dataflow``). In that graph:

- an **MLP pair** is a Linear whose output reaches other Linears only through column-local ops
  (activations, dropout, a gating product with a sibling Linear, reshapes): it and its siblings are
  split column-wise, the Linears they reach row-wise, provided those row-wise Linears read nothing but
  such outputs. Each expert of a Mixture-of-Experts is such a pair; its router, whose output goes to a
  softmax / top-k, is not, and stays whole;
- an **attention** is a ``scaled_dot_product_attention`` call, or a matmul of two activations
  followed (through scaling, masking and a softmax) by a second matmul. The Linears whose outputs reach
  its query / key / value operands are split column-wise (a fused q|k|v or k|v projection reaches
  several operands: its parts are reordered so every rank holds its heads of each part), the Linears
  its output reaches are split row-wise. The head size is the operands' last dimension, the head
  counts follow from the projection widths; both must divide by the tensor size. An embedding whose
  rows are added to the attention scores with one column per head (T5's relative position bias) is
  split with the heads. A norm over each head's features on the way to the operands (Qwen3's and
  Gemma 3's q / k norms: a reduction over a last dimension of the head size, with the heads before it)
  stays inside a head, so it does not stop the split (``tp_plan``'s ``head_norms`` run on this rank's heads);
  nor does a norm module over a split tensor's whole features (OLMo 2's q / k norms, BitNet's norms before
  its row-wise projections), which runs on the rank's features with its reduction over the tensor group;
- everything else (norms, routers, position embeddings, heads of a classifier) stays whole.

A Linear whose column split would leak, because its output also reaches a norm, a residual sum, a
reduction or the model's output, is not split. Every Linear keeps one role over all its calls, or it
stays whole. The plan is a proposal: ``tensor_parallel`` applies it and checks it on the sample
(forward and backward against the unsplit model) before accepting it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from atorch.utils.dataflow import BROADCASTS, SOFTMAX, Dataflow, Op, is_transparent
from atorch.utils.modules import repeated_blocks


@dataclass
class FoundAttention:
    """One attention core and the projections around it."""

    inputs: dict[str, list[str]] = field(default_factory=dict)    # "q" / "k" / "v" -> projections
    outputs: list[str] = field(default_factory=list)               # row-wise projections
    head_dim: int = 0
    heads: dict[str, int] = field(default_factory=dict)            # projection -> heads it computes (all parts)
    parts: dict[str, list[int]] = field(default_factory=dict)      # fused projection -> widths of its parts
    parts_within_heads: set = field(default_factory=set)           # fused per head ([h0: q k v | h1: ...])
    head_bias: list[str] = field(default_factory=list)             # per-head embeddings added to the scores
    # one head broadcast to every head (MLA's rotary key): (ndim, heads dim, last size) of the tensor expanded
    shared_heads: list[tuple[int, int, int]] = field(default_factory=list)
    # projections of the one key / value head every query head reads (multi-query attention): whole
    shared_kv: list[str] = field(default_factory=list)


@dataclass
class Discovery:
    """What the structure says; ``why_whole`` gives, for Linears left whole, the reason."""

    colwise: list[str] = field(default_factory=list)
    rowwise: list[str] = field(default_factory=list)
    attentions: list[FoundAttention] = field(default_factory=list)
    fused: dict[str, list[int]] = field(default_factory=dict)
    parts_within_heads: set = field(default_factory=set)   # fused projections laid out head by head: no reordering
    head_bias: list[str] = field(default_factory=list)
    groups: list[tuple[list[str], list[str]]] = field(default_factory=list)  # (colwise, rowwise) that belong together
    why_whole: dict[str, str] = field(default_factory=dict)
    shared_kv: list[str] = field(default_factory=list)     # FoundAttention.shared_kv of the attentions kept
    feature_widths: frozenset = frozenset()                # feature_norm_widths: reductions over them pass


def _passes(op: Op) -> bool:
    return is_transparent(op)


# reductions that keep the input's shape but for the dimensions they reduce (or normalise over)
HEAD_LOCAL_REDUCTIONS = frozenset({"mean", "sum", "var", "std", "amax", "norm", "layer_norm", "rms_norm",
                                   "var_mean", "std_mean", "logsumexp"})


def _within_head(flow: Dataflow, head_dim: int, feature_widths: frozenset = frozenset()):
    """``_passes``, and also a reduction or norm over only the last dimension of a tensor whose last
    dimension is one head's features with a heads dimension before it: per head, so a split of whole
    heads passes through it (Qwen3's q / k RMSNorm over ``head_dim``). A reduction over the last
    dimension of a whole projection of several heads (OLMo 2's q / k RMSNorm over every head's
    features) passes too when its width is one of ``feature_widths``, the widths of the model's
    norm modules: split, it runs on the rank's features with its reduction over the tensor group
    (``tp_plan``'s ``feature_norms``)."""
    def passes(op: Op) -> bool:
        if is_transparent(op):
            return True
        shape = _reduced_shape(flow, op)
        if shape is None:
            return False
        if len(shape) >= 3 and shape[-1] == head_dim:
            return _reduces_last_only(op, len(shape), head_dim)
        width = shape[-1] if shape else 0
        return (width in feature_widths and width > head_dim > 0 and width % head_dim == 0
                and _reduces_last_only(op, len(shape), width))
    return passes


def through_feature_norms(flow: Dataflow, feature_widths: frozenset):
    """``_passes``, and also a reduction or norm over only the last dimension of a tensor whose width is
    one of ``feature_widths`` (the model's norm modules' widths): a norm over a split tensor's whole
    features between the split and the Linear that reads it (BitNet's ``attn_sub_norm`` after the
    attention, its ``ffn_sub_norm`` inside the MLP). Split, it runs on the rank's features with its
    reduction over the tensor group (``tp_plan``'s ``feature_norms``), so it does not stop the split."""
    def passes(op: Op) -> bool:
        if is_transparent(op):
            return True
        shape = _reduced_shape(flow, op)
        return bool(shape) and shape[-1] in feature_widths and _reduces_last_only(op, len(shape), shape[-1])
    return passes


def _reduced_shape(flow: Dataflow, op: Op) -> Optional[tuple]:
    """The shape of the tensor a reduction or norm ``op`` reduces (None for any other op)."""
    if op.kind != "other" or op.name not in HEAD_LOCAL_REDUCTIONS or not op.operands or op.operands[0] is None:
        return None
    return flow.shapes.get(op.operands[0], ())


def feature_norm_widths(model: nn.Module, flow: Dataflow) -> frozenset:
    """Widths of the modules that look like a norm over a tensor's last dimension: no Linear, own
    parameters all 1-D of that width, called on a tensor of that width."""
    widths = set()
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        shape = flow.module_inputs.get(name, ())
        if (params and shape and not list(module.children()) and not isinstance(module, (nn.Linear, nn.Embedding))
                and all(p.dim() == 1 and p.numel() == shape[-1] for p in params)):
            widths.add(shape[-1])
    return frozenset(widths)


def _reduces_last_only(op: Op, ndim: int, head_dim: int) -> bool:
    """Whether ``op`` reduces (normalises) over the last dimension alone, from its recorded arguments."""
    if op.name in ("layer_norm", "rms_norm"):
        shape = op.args[0] if op.args else None
        return isinstance(shape, (list, tuple)) and list(shape) == [head_dim]
    dims = op.args[0] if op.args else None
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    return dims != [None] and all(isinstance(d, int) and d % ndim == ndim - 1 for d in dims)


def _scores_pass(op: Op) -> bool:
    return is_transparent(op) or op.name in SOFTMAX


def discover(model: nn.Module, flow: Dataflow) -> Discovery:
    found = Discovery()
    linear_modules = {op.module for op in flow.ops if op.kind == "linear"}
    role: dict[str, str] = {}
    widths = found.feature_widths = feature_norm_widths(model, flow)
    for attention in _attentions(flow, found, widths):
        found.attentions.append(attention)
        cols = [p for names in attention.inputs.values() for p in names]
        found.groups.append((list(dict.fromkeys(cols)), attention.outputs))
    for cols, rows in _mlp_groups(flow, linear_modules, found.why_whole):
        found.groups.append((cols, rows))
    # then pairs with a norm over the split features inside (BitNet's ffn_sub_norm), among the Linears no
    # pair or attention claimed: a low-rank projection through its norm into a split attention's input
    # (DeepSeek's q_a_proj -> q_a_layernorm -> q_b_proj) stays whole, its consumer split by heads
    # inside the repeated blocks only: a model's head (BERT's dense -> LayerNorm -> decoder) is split on its
    # vocabulary instead
    claimed = {n for cols, rows in found.groups for n in cols + rows}
    candidates = (linear_modules - claimed) & inside_repeated_blocks(model)
    lenient = _mlp_groups(flow, candidates, {}, through_feature_norms(flow, widths))  # the strict reasons stay
    found.groups += [(cols, rows) for cols, rows in lenient if not claimed & {*cols, *rows}]
    for cols, rows in found.groups:
        for name in cols:
            role.setdefault(name, "colwise")
        for name in rows:
            role.setdefault(name, "rowwise")
    conflicts = _conflicts(found.groups)
    kept = []
    for cols, rows in found.groups:
        bad = [n for n in cols + rows if n in conflicts]
        if bad:
            for name in cols + rows:
                found.why_whole.setdefault(name, f"{bad[0]} would need two roles (split both ways by different paths)")
            continue
        kept.append((cols, rows))
    found.groups = kept
    found.colwise = list(dict.fromkeys(n for cols, _ in kept for n in cols))
    found.rowwise = list(dict.fromkeys(n for _, rows in kept for n in rows))
    kept_attention = [a for a in found.attentions if all(n in found.colwise for v in a.inputs.values() for n in v)]
    found.attentions = kept_attention
    in_attention = {n for a in kept_attention for names in a.inputs.values() for n in names}
    for name in found.colwise:
        parts = None if name in in_attention else _mlp_parts(flow, name)
        if parts:
            found.fused[name] = parts
    for attention in kept_attention:
        found.shared_kv += [n for n in attention.shared_kv if n not in found.shared_kv]
        for name in attention.shared_kv:
            found.why_whole[name] = SHARED_KV_WHY
        found.fused.update(attention.parts)
        found.parts_within_heads |= attention.parts_within_heads
        found.head_bias += [b for b in attention.head_bias if b not in found.head_bias]
    for name in linear_modules - set(found.colwise) - set(found.rowwise):
        found.why_whole.setdefault(name, "its output reaches a norm, a reduction, a residual sum or the model's output "
                                   "(not only other projections or attention)")
    return found


def inside_repeated_blocks(model: nn.Module) -> set[str]:
    """Names of modules inside the repeated blocks: an MLP whose width equals the vocabulary is no head."""
    classes = set(repeated_blocks(model)[0])
    blocks = [n for n, m in model.named_modules() if type(m).__name__ in classes]
    return {n for n, _ in model.named_modules() if any(n.startswith(b + ".") for b in blocks)}


def _conflicts(groups: list[tuple[list[str], list[str]]]) -> set[str]:
    cols = [n for c, _ in groups for n in c]
    rows = [n for _, r in groups for n in r]
    return set(cols) & set(rows)


# --- MLPs ----------------------------------------------------------------------------------------------
def _mlp_groups(flow: Dataflow, linear_modules: set[str], why: dict[str, str],
                passes=_passes) -> list[tuple[list[str], list[str]]]:
    """(column Linears, row Linears) per MLP: every call of a column Linear reaches only Linears,
    and every call of a row Linear reads only column Linears' outputs (through ops that ``passes``)."""
    reaches: dict[str, set[str]] = {}
    for name in sorted(linear_modules):
        targets = _linear_targets(flow, name, passes)
        if targets:
            reaches[name] = targets
    groups: list[tuple[list[str], list[str]]] = []
    for down in sorted({t for ts in reaches.values() for t in ts}):
        sources = _row_sources(flow, down, passes)
        if not sources or any(s not in reaches or reaches[s] != {down} for s in sources):
            if sources:
                why.setdefault(down, f"it reads {sorted(sources)}, not all of which feed it alone")
            continue
        groups.append((sorted(sources), [down]))
    return groups


# ops that cut a tensor into parts (along the features, when their outputs are narrower there)
CUTS = frozenset({"chunk", "split", "split_with_sizes", "tensor_split", "unbind", "narrow", "__getitem__"})


def _mlp_parts(flow: Dataflow, name: str) -> Optional[list[int]]:
    """The widths of the parts an MLP's column Linear's output is cut into along its features (a fused
    ``[gate | up]``: ModernBERT's ``Wi(x).chunk(2, -1)``, Phi-3's and GLM's ``gate_up_proj``), None when
    it is not cut. Split contiguously, a rank would hold whole parts of one kind; like a fused [q | k |
    v], its columns are re-ordered so each rank holds its share of every part."""
    width = _width(flow, name)
    for call in flow.calls_of(name):
        seen, _ = flow.forward_closure(call.outputs, _passes)
        for node in [call.outputs[0], *seen]:
            shape = flow.shapes.get(node, ())
            if not shape or shape[-1] != width:
                continue
            cuts = [flow.ops[i] for i in flow.consumers.get(node, ()) if flow.ops[i].name in CUTS]
            widths = [flow.shapes[o][-1] for op in cuts for o in op.outputs
                      if len(flow.shapes.get(o, ())) == len(shape) and flow.shapes[o][-1] < width]
            if len(widths) > 1 and sum(widths) == width:
                return widths
    return None


def _linear_targets(flow: Dataflow, name: str, passes=_passes) -> set[str]:
    """The Linears every call of ``name`` reaches through column-local ops; empty when any call
    also reaches something else (its split would leak)."""
    targets: set[str] = set()
    for call in flow.calls_of(name):
        _, sinks = flow.forward_closure(call.outputs, passes)
        if not sinks or any(op.kind != "linear" or op.module == name for op, _ in sinks):
            return set()
        targets |= {op.module for op, _ in sinks}
    return targets


def _row_sources(flow: Dataflow, name: str, passes=_passes) -> set[str]:
    """The Linears whose outputs make up every call's input of ``name``; {"?"} when anything else
    (an attention, a norm, a model input) contributes."""
    sources: set[str] = set()
    for call in flow.calls_of(name):
        activation = _activation_operand(call)
        if activation is None:
            return {"?"}
        made_by = flow.backward_sources(activation, passes)
        if not made_by:
            return {"?"}
        for op in made_by:
            sources.add(op.module if op.kind == "linear" else "?")
    return sources


def _activation_operand(call: Op) -> Optional[int]:
    """The input activation of a Linear call (the one tensor operand that is not a parameter)."""
    operands = [n for n in call.operands if n is not None]
    return operands[0] if operands else (call.inputs[0] if call.inputs else None)


# --- attention -------------------------------------------------------------------------------------------
def _cores(flow: Dataflow) -> list[tuple[dict[str, int], list[int], Op, list[Op]]]:
    """Attention cores: ({"q": node, "k": node, "v": node}, output nodes, the op, score-path ops)."""
    cores = []
    matmuls = [op for op in flow.ops if op.kind == "matmul"]
    for op in flow.ops:
        if op.kind == "attention" and len(op.operands) >= 3 and None not in op.operands[:3]:
            q, k, v = op.operands[:3]
            cores.append(({"q": q, "k": k, "v": v}, op.outputs, op, []))
    for second in matmuls:
        probs, value = (second.operands + [None, None])[:2]
        if probs is None or value is None:
            continue
        for first in flow.backward_sources(probs, _scores_pass):
            if first.kind == "matmul" and None not in first.operands[:2] and _has_softmax(flow, first, probs):
                q, k = first.operands[:2]
                cores.append(({"q": q, "k": k, "v": value}, second.outputs, second, [first]))
    return cores


def _has_softmax(flow: Dataflow, first: Op, probs: int) -> bool:
    seen, _ = flow.forward_closure(first.outputs, _scores_pass)
    return probs in seen and any(flow.ops[flow.producer[n]].name in SOFTMAX for n in seen if n in flow.producer)


def _attentions(flow: Dataflow, found: Discovery, feature_widths: frozenset = frozenset()) -> list[FoundAttention]:
    out = []
    for slots, outputs, core, score_ops in _cores(flow):
        attention = FoundAttention()
        q_shape = flow.shapes.get(slots["q"], ())
        within_head = _within_head(flow, q_shape[-1] if len(q_shape) >= 3 else -1, feature_widths)
        heads = q_shape[-3] if len(q_shape) == 4 else 0
        ok = True
        for slot, node in slots.items():
            # side inputs mixed in on the way (rotary cos / sin) are not sources; the check confirms
            linears, shared = _operand_linears(flow, node, within_head, heads)
            attention.shared_heads += [s for s in shared if s not in attention.shared_heads]
            if not linears or any(not _feeds_attention_only(flow, n, within_head) for n in linears):
                ok = False  # an operand made by something else (a cache, a norm): nothing to split here
                break
            attention.inputs[slot] = list(dict.fromkeys(linears))
        if not ok:
            continue
        _, sinks = flow.forward_closure(outputs, through_feature_norms(flow, feature_widths))
        if not sinks or any(op.kind != "linear" for op, _ in sinks):
            for names in attention.inputs.values():
                for name in names:
                    found.why_whole.setdefault(name, "the attention it feeds hands its result to something other "
                                               "than a projection")
            continue
        attention.outputs = list(dict.fromkeys(op.module for op, _ in sinks))
        if not _heads(flow, slots, attention, found):
            continue
        attention.head_bias = _score_bias(flow, core, score_ops, slots, attention)
        out.append(attention)
    return _merge_calls(out)


def _operand_linears(flow: Dataflow, node: int, within_head, heads: int) -> tuple[list[str], list[tuple]]:
    """The Linears an attention operand is made from, and the broadcasts over the heads on the way.
    One whose output reaches it only broadcast over the heads (a single head shared by all, as
    multi-head latent attention's rotary key part, ``k_rot.expand(..., heads, ...)``) is a side input
    like rotary cos / sin, and stays whole, when the operand has a source of its own; with none
    (multi-query attention's one key head) it is the source. Each such broadcast is returned as
    (ndim, heads dimension, last size) of the tensor broadcast: split, each rank broadcasts it to its
    own heads only, so its gradient there is partial and is summed over the tensor group."""
    def passes(op: Op) -> bool:
        return within_head(op) and not _broadcast_over_heads(flow, op, heads)
    sources = flow.backward_sources(node, passes)
    own = [s.module for s in sources if s.kind == "linear"]
    if not own:
        return [s.module for s in flow.backward_sources(node, within_head) if s.kind == "linear"], []
    shared = []
    for op in sources:
        if _broadcast_over_heads(flow, op, heads):
            shape = flow.shapes[op.inputs[0]]
            shared.append((len(shape), next(d for d, (b, a) in enumerate(zip(shape, flow.shapes[op.outputs[0]]))
                                            if b == 1 and a == heads), shape[-1]))
    return own, shared


def _broadcast_over_heads(flow: Dataflow, op: Op, heads: int) -> bool:
    """An expand of a size-1 dimension to the attention's ``heads``."""
    if op.name not in BROADCASTS or heads < 2 or not op.inputs or not op.outputs:
        return False
    before, after = flow.shapes.get(op.inputs[0], ()), flow.shapes.get(op.outputs[0], ())
    return len(before) == len(after) and any(b == 1 and a == heads for b, a in zip(before, after))


def _feeds_attention_only(flow: Dataflow, name: str, passes=_passes) -> bool:
    """Every call of ``name`` reaches attention operands only (a split would not leak elsewhere)."""
    for call in flow.calls_of(name):
        _, sinks = flow.forward_closure(call.outputs, passes)
        if not sinks or any(op.kind not in ("attention", "matmul") for op, _ in sinks):
            return False
    return True


def _heads(flow: Dataflow, slots: dict[str, int], attention: FoundAttention, found: Discovery) -> bool:
    """Head size from the operands; each projection's heads from its width, split into parts when it
    feeds several operands (fused)."""
    shape = flow.shapes[slots["q"]]
    if len(shape) < 3:
        return False
    attention.head_dim = shape[-1]
    owners: dict[str, list[str]] = {}
    for slot, names in attention.inputs.items():
        for name in names:
            owners.setdefault(name, []).append(slot)
    heads = shape[-3] if len(shape) == 4 else 0
    for name, parts in owners.items():
        width = _width(flow, name)
        if len(parts) > 1 and _per_head_parts(flow, name, heads, width, attention.head_dim):
            attention.heads[name] = heads  # a contiguous split keeps whole heads of every part
            attention.parts_within_heads.add(name)
            continue
        widths = _part_widths(flow, name, [slots[p] for p in parts], attention.head_dim, width)
        if widths is None:
            found.why_whole.setdefault(
                name, f"its {width} outputs do not make whole heads of size {attention.head_dim}")
            return False
        attention.heads[name] = width // attention.head_dim
        if len(parts) > 1:
            attention.parts[name] = widths
            if _parts_within_heads(flow, name, attention.head_dim, [w // attention.head_dim for w in widths]):
                attention.parts_within_heads.add(name)
            elif _one_head_beside_many(widths, attention.head_dim):
                for whole in [*owners, *attention.outputs]:
                    found.why_whole.setdefault(whole, FUSED_MULTI_QUERY_WHY)
                return False
    _share_single_kv_heads(attention, owners, heads)
    return True


SHARED_KV_WHY = ("the one key / value head every query head reads (multi-query attention): whole on every rank, "
                 "the gradient of its output summed over the tensor group")
FUSED_MULTI_QUERY_WHY = ("multi-query attention in one fused projection: its one key / value head cannot be divided "
                         "and its query heads cannot be split apart from it in one weight, so the attention stays "
                         "whole")


def _one_head_beside_many(widths: list[int], head_dim: int) -> bool:
    """A fused [q | k | v] whose key / value parts are one head each beside several query heads."""
    heads = [w // head_dim for w in widths]
    return min(heads) == 1 and max(heads) > 1


def _share_single_kv_heads(attention: FoundAttention, owners: dict[str, list[str]], heads: int) -> None:
    """A separate key / value projection of one head beside several query heads (multi-query attention:
    Gemma 2B's, Gemma 3 1B's) cannot be divided, and need not be: it stays whole, every rank computes
    the one head for its share of the query heads, and the gradient of its output, partial on each rank
    (from its query heads only), is summed over the tensor group (``shared_kv``)."""
    q_heads = sum(attention.heads.get(n, 0) // max(len(owners[n]), 1) for n in attention.inputs.get("q", ()))
    if max(heads, q_heads) < 2:
        return
    for name, slots in owners.items():
        if "q" not in slots and attention.heads.get(name) == len(slots) and name not in attention.parts_within_heads:
            attention.shared_kv.append(name)
            del attention.heads[name]
            attention.parts.pop(name, None)
            for slot in slots:
                attention.inputs[slot] = [n for n in attention.inputs[slot] if n != name]


def _per_head_parts(flow: Dataflow, name: str, heads: int, width: int, head_dim: int) -> bool:
    """A projection feeding several operands whose output is viewed as [.., heads, per-head features]
    where a head's features are not whole operand heads: parts of unequal sizes inside each head
    (multi-head latent attention's kv_b_proj, [key without rotary | value] per head)."""
    if heads < 2 or width % heads or (width // heads) % head_dim == 0:
        return False
    seen, _ = flow.forward_closure([call.outputs[0] for call in flow.calls_of(name)], _passes)
    return any(flow.shapes.get(node, ())[-2:] == (heads, width // heads) for node in seen)


def _part_widths(flow: Dataflow, name: str, operands: list[int], head_dim: int, width: int) -> Optional[list[int]]:
    """The widths of a projection's parts, one per attention operand it makes: each part as it was cut
    from the projection's output (the first narrower tensor on the way to its operand, before any
    expansion of grouped keys and values), where those add up to its width (Falcon's multi-query
    [q | k | v] with one key / value head, or its key / value groups), else equal parts of whole heads;
    None when neither holds."""
    if len(operands) > 1:
        output = flow.calls_of(name)[0].outputs[0]
        counted = [_cut_width(flow, output, node, width) for node in operands]
        if sum(counted) == width and all(w % head_dim == 0 for w in counted):
            return counted
    if width % (len(operands) * head_dim):
        return None
    return [width // len(operands)] * len(operands)


def _cut_width(flow: Dataflow, output: int, operand: int, width: int) -> int:
    """Elements per token of the first tensor narrower than ``output`` (``width`` per token) on the
    way from ``output`` to ``operand``, walking forward breadth first through column-local ops."""
    tokens = _numel(flow, output) // width
    ancestors = {operand} | {n for op in _ops_back(flow, operand) for n in op.inputs}
    frontier, seen = [output], {output}
    while frontier:
        following = []
        for node in frontier:
            for index in flow.consumers.get(node, ()):
                op = flow.ops[index]
                if not _passes(op):
                    continue
                for out in op.outputs:
                    if out in ancestors and out not in seen:
                        if _numel(flow, out) < _numel(flow, output):
                            return _numel(flow, out) // tokens
                        seen.add(out)
                        following.append(out)
        frontier = following
    return 0


def _ops_back(flow: Dataflow, node: int) -> list[Op]:
    """The column-local ops ``node`` was made by, back to the first op that is not one."""
    ops, stack, seen = [], [node], {node}
    while stack:
        index = flow.producer.get(stack.pop())
        if index is None or not _passes(flow.ops[index]):
            continue
        ops.append(flow.ops[index])
        for parent in flow.ops[index].inputs:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return ops


def _numel(flow: Dataflow, node: int) -> int:
    return math.prod(flow.shapes.get(node, ()))


def _parts_within_heads(flow: Dataflow, name: str, head_dim: int, part_heads: list[int]) -> bool:
    """Whether a fused projection's output is laid out head by head (GPT-NeoX's and BLOOM's
    query_key_value: viewed as [.., heads, parts x head size] or [.., heads, parts, head size] before
    its parts are taken) or key / value group by group (Falcon-40B's: [.., groups, queries per group
    + 2, head size]), rather than part by part ([q | k | v], GPT-2's c_attn). A contiguous column split
    of such a layout already gives each rank whole heads (groups) of every part."""
    groups = math.gcd(*part_heads)
    per_group = sum(part_heads) // groups
    for call in flow.calls_of(name):
        seen, _ = flow.forward_closure(call.outputs, _passes)
        for node in seen:
            shape = flow.shapes.get(node, ())
            # [.., groups, per group, head size] reads the same both ways when the two counts are equal
            # (timm's [.., 3 parts, 3 heads, head size]): then the part-by-part default stands
            if groups > 1 and (shape[-2:] == (groups, per_group * head_dim)
                               or (shape[-3:] == (groups, per_group, head_dim) and groups != per_group)):
                return True
    return False


def _width(flow: Dataflow, name: str) -> int:
    call = flow.calls_of(name)[0]
    return flow.shapes[call.outputs[0]][-1]


def _score_bias(flow: Dataflow, core: Op, score_ops: list[Op], slots: dict[str, int],
                attention: FoundAttention) -> list[str]:
    """Embeddings added to the scores with one column per head (T5's relative position bias): an
    input of the attention call beside q, k and v, or an operand added on the way from scores to
    probabilities."""
    q_name = attention.inputs["q"][0]
    heads = attention.heads[q_name] // len(attention.parts.get(q_name, [1]))
    if score_ops:
        seen, _ = flow.forward_closure(score_ops[0].outputs, _scores_pass)
        made = [flow.ops[flow.producer[n]] for n in seen if n in flow.producer]
        side = {p for op in made for p in op.inputs if p not in seen}
    else:
        side = set(core.inputs) - set(slots.values())
    found = [source.module for node in side for source in flow.backward_sources(node, _passes)
             if source.kind == "embedding" and flow.shapes[source.outputs[0]][-1] == heads]
    return list(dict.fromkeys(found))


def _merge_calls(attentions: list[FoundAttention]) -> list[FoundAttention]:
    """One entry per set of projections (a module called several times is found once per call)."""
    merged: dict[tuple, FoundAttention] = {}
    for attention in attentions:
        key = tuple(sorted((s, tuple(n)) for s, n in attention.inputs.items()))
        if key in merged:
            merged[key].head_bias = list(dict.fromkeys(merged[key].head_bias + attention.head_bias))
            merged[key].outputs = list(dict.fromkeys(merged[key].outputs + attention.outputs))
        else:
            merged[key] = attention
    return list(merged.values())

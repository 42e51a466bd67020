"""Facts about a user's module tree that several layers need (methods, the search, tests)."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from atorch.errors import MethodConfigError

# a module attribute {parameter attribute: order} for parameters a method keeps in an element order of
# its own (tensor_parallel's fused q|k|v); checkpoints, loading and meta initialisation convert through it
SAVED_ORDERS_ATTR = "atorch_saved_orders"
# a module attribute {state_dict suffix: (parameter paths, ...)} for a saved tensor a module's
# state_dict hook packs from several live parameters, concatenated along dimension 0 in that order
# (tensor_parallel's split nn.MultiheadAttention saves its q, k, v projections as in_proj_weight)
PACKED_STATE_ATTR = "atorch_packed_state"
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def repeated_blocks(model: nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    """Module classes that occur several times with parameters, outermost (largest) first: the
    transformer layers in a transformer. A class each of whose instances is a stack of blocks (it holds
    a list or sequence of two or more instances of one other repeating class: T5's encoder and decoder
    stacks, CLIP's two encoders) comes after the blocks: the layer is the unit to checkpoint, shard and
    count, not the stack. Returns (class name -> count, class name -> bytes of one)."""
    counts: Counter = Counter()
    sizes: dict[str, int] = {}
    instances: dict[str, list[nn.Module]] = {}
    for module in model.modules():
        if module is model or isinstance(module, _CONTAINERS):
            continue
        size = sum(p.numel() * p.element_size() for p in module.parameters())
        children = list(module.children())
        if size == 0 or not children:  # leaves (Linear, LayerNorm) are not blocks
            continue
        name = type(module).__name__
        counts[name] += 1
        sizes[name] = size
        instances.setdefault(name, []).append(module)
    repeated = {n: c for n, c in counts.items() if c > 1}
    stacks = {n for n in repeated if all(_stacks_blocks(m, n, repeated) for m in instances[n])}
    order = sorted(repeated, key=lambda n: (n in stacks, -sizes[n]))
    return {n: repeated[n] for n in order}, {n: sizes[n] for n in order}


def block_stack(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers, in order, as (name, module): the instances of the largest repeated class
    (``repeated_blocks``), or, where those sit in one list or sequence together with layers of other
    classes, every layer of that list (Jamba's Mamba and attention layers alternate in ``model.layers``;
    the attention layers alone would leave the Mamba layers between them, changing the hidden state a
    pipeline stage boundary carries; Zamba's hybrid layers hold a Mamba layer of their own). A list holding
    anything but layers (modules with parameters and sub-modules of their own: a final norm, a bare Linear)
    is not taken as the stack."""
    found, _ = repeated_blocks(model)
    if not found:
        return []
    block_type = next(iter(found))
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ == block_type]
    parents = Counter(name.rpartition(".")[0] for name, _ in blocks)
    parent_name = parents.most_common(1)[0][0]
    parent = model.get_submodule(parent_name) if parent_name else model
    if not isinstance(parent, (nn.ModuleList, nn.Sequential)) or len(parent) == parents[parent_name]:
        return blocks
    prefix = f"{parent_name}." if parent_name else ""
    layers = [(prefix + name, child) for name, child in parent.named_children()]
    # every instance elsewhere must sit inside one of the list's layers (Zamba's hybrid layer holds a Mamba layer)
    inside = all(any(name.startswith(layer + ".") for layer, _ in layers) for name, _ in blocks
                 if name.rpartition(".")[0] != parent_name)
    if not inside or not all(_is_layer(child) for _, child in layers):
        return blocks
    return layers


# the module target that names the model's layers, found from its structure (checkpoint, fsdp)
AUTO_TARGETS = "auto"


def layer_types(model: nn.Module) -> tuple[type, ...]:
    """The classes of the model's layers (``block_stack``), in order of first appearance: one for a
    stack of like layers, several for a stack that alternates kinds (Jamba); () without a repeated
    block. Read from the module tree alone, whatever the classes are called."""
    return tuple(dict.fromkeys(type(module) for _, module in block_stack(model)))


def alike_layer_names(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of the model's largest run of two or more alike layers in one list or sequence
    (consecutive children of one type, with the same parameter names and shapes, each with parameters
    and sub-modules of its own): the layers of a model built from unnamed containers (``nn.Sequential(
    embedding, *[nn.Sequential(norm, linear, ...) for _ in range(n)], head)``), which ``repeated_blocks``
    does not count (a bare container is not a class of the user's). A ModuleList is a list of layers even
    when it holds one (a one-layer model: nothing repeats, the list still says what its layer is). ()
    where there is none."""
    best: tuple[int, tuple[str, ...]] = (0, ())
    for name, parent in model.named_modules():
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            continue
        prefix = f"{name}." if name else ""
        shortest = 1 if isinstance(parent, nn.ModuleList) else 2
        for run in _alike_runs(list(parent.named_children())):
            size = sum(p.numel() for _, child in run for p in child.parameters())
            if len(run) >= shortest and size > best[0]:
                best = (size, tuple(prefix + child_name for child_name, _ in run))
    return best[1]


def _alike_runs(children: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """Consecutive children of one signature (type, parameter names and shapes), layers only."""
    runs: list[list[tuple[str, nn.Module]]] = []
    last = None
    for name, child in children:
        signature = (type(child), tuple((n, tuple(p.shape)) for n, p in child.named_parameters()))
        if not _has_parameters_and_children(child):
            last = None
            continue
        if signature != last:
            runs.append([])
            last = signature
        runs[-1].append((name, child))
    return runs


def _parameters_in(model: nn.Module, targets: tuple) -> int:
    """Parameters held by the modules ``targets`` (classes or qualified names) name, outermost only."""
    names = {t for t in targets if isinstance(t, str)}
    types = tuple(t for t in targets if isinstance(t, type))
    total, taken = 0, []
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in taken):
            continue
        if name in names or (types and isinstance(module, types)):
            taken.append(name)
            total += sum(p.numel() for p in module.parameters())
    return total


def _has_parameters_and_children(module: nn.Module) -> bool:
    return any(True for _ in module.children()) and any(True for _ in module.parameters())


def auto_layers(model: nn.Module) -> tuple:
    """What ``"auto"`` names: the model's layer classes (``layer_types``), or, where its layers are unnamed
    containers, their qualified names (``alike_layer_names``); () where it has no repeated layer."""
    found: tuple = layer_types(model)
    names = alike_layer_names(model)
    # unnamed layers that hold a repeated class of their own (an attention module) are the larger unit
    if names and _parameters_in(model, names) > _parameters_in(model, found):
        return names
    return found


def resolve_auto_targets(model: nn.Module, targets: tuple, method: str) -> tuple:
    """``targets`` with ``"auto"`` replaced by the model's layers (``auto_layers``): what a user who writes
    ``("checkpoint", "auto")`` means, on a model whose layers have any name. A model without repeated
    layers is a ``MethodConfigError`` that lists its module types, so the user can name them."""
    if AUTO_TARGETS not in targets:
        return targets
    found = auto_layers(model)
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise MethodConfigError(method, f"{AUTO_TARGETS!r} found no repeated layers in {type(model).__name__} (no "
                                        f"class with parameters and sub-modules occurs twice, no list holds two alike "
                                        f"layers); name the modules instead, from the module types in the model: "
                                        f"{present}")
    rest = tuple(t for t in targets if t != AUTO_TARGETS)
    return found + tuple(t for t in rest if t not in found)


def _is_layer(module: nn.Module) -> bool:
    """A module with parameters and sub-modules of its own (not a leaf, not a bare container)."""
    return (not isinstance(module, _CONTAINERS) and any(True for _ in module.children())
            and any(True for _ in module.parameters()))


def _stacks_blocks(module: nn.Module, name: str, repeated: dict[str, int]) -> bool:
    """Whether ``module`` (of class ``name``) holds, as a direct child, a list or sequence of two or more
    instances of one other repeating class that are layers: each made of sub-blocks (attention, MLP)
    of its own, not of bare leaves. An MoE layer's list of experts (each its projections alone) does not
    make the layer a stack."""
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            kinds = {type(k).__name__ for k in child.children()}
            if (len(child) >= 2 and len(kinds) == 1 and next(iter(kinds)) in repeated and name not in kinds
                    and all(_has_sub_blocks(k) for k in child.children())):
                return True
    return False


def _has_sub_blocks(module: nn.Module) -> bool:
    """Whether ``module`` holds, directly or through lists, a module with parameters and children of its own."""
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            if _has_sub_blocks(child):
                return True
        elif any(True for _ in child.children()) and any(True for _ in child.parameters()):
            return True
    return False


def without_forward(module: nn.Module) -> bool:
    """Whether ``module`` has no forward of its own (a ModuleList, a ModuleDict, a plain holder of layers):
    it is never called, so a patch or hook on its forward never runs."""
    return type(module).forward is nn.Module.forward


def parts_with_forward(module: nn.Module) -> list[nn.Module]:
    """``module`` where it has a forward of its own (with parameters or not: a parameter-free attention core
    is what selective recomputation names), else its parts that have one, in order (a ModuleList of
    layers: the layers)."""
    if not without_forward(module):
        return [module]
    return [part for child in module.children() for part in parts_with_forward(child)]


def stacked_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of an ``nn.Sequential`` that is a stack of two or more alike layers (timm's ``blocks``),
    [] for any other module (an MLP written as a Sequential of leaves is one unit)."""
    if not isinstance(module, nn.Sequential) or len(module) < 2:
        return []
    runs = _alike_runs(list(module.named_children()))
    return [child for _, child in runs[0]] if len(runs) == 1 and len(runs[0]) == len(module) else []


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP, a DeepSpeed engine or torch.compile's wrapper."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU copy of the weights under the user's own parameter names (collective for
    sharded and pipeline-parallel models: every rank must call it)."""
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    out = {}
    for name, tensor in unwrap_model(model).state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")  # checkpoint, torch.compile
        out[name] = tensor.detach().float().cpu().clone()
    return out

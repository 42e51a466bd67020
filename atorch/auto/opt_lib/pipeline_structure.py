"""Where pipeline stages may cut a model, and what each stage holds.

A model is pipelined as *layers before the blocks → repeated blocks → layers after the blocks*. The
layers around the blocks are *units*: the largest submodules that hold parameters and contain no
block (``vit.embeddings``, ``lm_head``, BERT's ``cls`` head, an MLP's input ``nn.Linear``). Which
side of the blocks a unit is on is read from the execution order of one forward of the real model
on a sample batch (``trace_structure``), not from its type: an ``nn.Linear`` input layer runs before
the blocks like an embedding does. Without a sample (the search), registration order stands in
(``structure_from_order``).

The trace also refuses what one hidden state crossing each cut cannot carry, each with the reason:
layers with parameters running *between* blocks (encoder-decoder models, two-tower models such as
CLIP), a block running more than once, blocks not running in registration order, code outside the
blocks changing the hidden state between two blocks, and BatchNorm (micro-batches change its
statistics).

Weight sharing (tied input / output embeddings) is allowed: ``held_parameters`` says which stages
hold a copy of each weight, and the runtime sums the copies' gradients. A *module* registered both
inside a block and outside is refused (replacing it on one stage would break the other use).
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn

from atorch.errors import InputError, MethodConfigError
from atorch.utils.batch import map_tensors, tensors, to_meta

METHOD = "pipeline_parallel"


@dataclass
class BlockStructure:
    """The blocks (in execution order) and the units on each side of them."""

    blocks: list[tuple[str, nn.Module]]
    before: list[str] = field(default_factory=list)   # units that run before the first block
    after: list[str] = field(default_factory=list)    # units that run after the last block, or never
    block_output_len: Optional[int] = None            # a block returns a tuple of this length (None: a tensor)
    traced: bool = False


# --- units -----------------------------------------------------------------------------------------
def find_units(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """The largest submodules with parameters that contain no block, in registration order."""
    block_ids = {id(b) for _, b in blocks}
    units: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if id(child) in block_ids:
                continue
            if any(id(m) in block_ids for m in child.modules()):
                visit(child, path + ".")
            elif any(True for _ in child.parameters()):
                units.append(path)

    visit(model, "")
    return units


def structure_from_order(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> BlockStructure:
    """Units registered before the first block run before it: the structure when no sample batch is
    at hand (the search's estimates, a model given without a dataset)."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    first = order[blocks[0][0]]
    units = find_units(model, blocks)
    return BlockStructure(blocks, [u for u in units if order[u] < first], [u for u in units if order[u] > first])


def check_supported(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
    """Refuse, before any run, what stages cannot reproduce: BatchNorm, encoder-decoder models and a
    module with parameters registered both inside a block and outside."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise MethodConfigError(METHOD, f"{name} is a {type(module).__name__}: it normalises over each forward's "
                                    "batch, and a pipeline runs every batch as micro-batches, so training would differ "
                                    "from the full batch (and running statistics would be updated per micro-batch); "
                                    "use data parallelism, or GroupNorm / LayerNorm")
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise MethodConfigError(METHOD, f"{type(model).__name__} is an encoder-decoder model, which is not "
                                "pipelined: the decoder's blocks also read the encoder's output (cross-attention) "
                                "and the decoder's embedding runs between the two stacks, so a cut would have to "
                                "carry more than the one hidden state a stage boundary carries; use tensor or data "
                                "parallelism")
    inside = {id(m) for _, b in blocks for m in b.modules() if any(True for _ in m.parameters(recurse=False))}
    block_ids = {id(b) for _, b in blocks}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in inside and not _under_block(model, name, block_ids):
            raise MethodConfigError(METHOD, f"{name} is also a part of a repeated block: a module shared between a "
                                    "block and the rest of the model cannot be cut into stages; give it its own copy")


def _under_block(model: nn.Module, path: str, block_ids: set[int]) -> bool:
    parts = path.split(".")
    return any(id(model.get_submodule(".".join(parts[:i]))) in block_ids for i in range(1, len(parts) + 1))


# --- the trace -------------------------------------------------------------------------------------
class _Tracer:
    """Forward hooks recording the order units and blocks run in, and each block's hidden state in
    and out (to check that the blocks form one chain).

    The hidden state each block hands on (and the one the first block takes) is replaced by a detached
    copy that requires grad (``handed_on``): the autograd graph of the model's output then reaches one
    of those copies, other than the last block's, only where the output reads a value the blocks
    compute besides the hidden state they hand on (``side_channels``)."""

    def __init__(self, model: nn.Module, blocks: list, units: list[str]):
        self.events: list[tuple[str, Any]] = []
        self.inputs: dict[int, Optional[torch.Tensor]] = {}
        self.outputs: dict[int, Any] = {}
        self.handed_on: dict[int, torch.Tensor] = {}  # -1: the first block's input; k: block k's output
        self.handles = []
        for index, (_, block) in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._block_in(index), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._block_out(index)))
        for name in units:
            self.handles.append(model.get_submodule(name).register_forward_pre_hook(self._unit(name)))

    def _block_in(self, index: int) -> Callable:
        def hook(module, args, kwargs):
            self.events.append(("block", index))
            replaced = None
            if index == 0 and -1 not in self.handed_on:
                replaced = _with_hidden(args, kwargs, self._detached(-1, hidden_argument(args, kwargs)))
                args, kwargs = replaced or (args, kwargs)
            self.inputs.setdefault(index, hidden_argument(args, kwargs))
            return replaced
        return hook

    def _block_out(self, index: int) -> Callable:
        def hook(module, args, output):
            if index not in self.outputs:
                first = tensors(output)[:1]
                leading = output[0] if isinstance(output, tuple) else output
                handed = self._detached(index, first[0]) if first and leading is first[0] else None
                if handed is not None:
                    output = handed if isinstance(output, torch.Tensor) else (handed,) + tuple(output[1:])
                self.outputs[index] = output
                return output
            return None
        return hook

    def _detached(self, index: int, hidden: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if hidden is None or not torch.is_grad_enabled() or not hidden.is_floating_point():
            return None
        self.handed_on[index] = hidden.detach().requires_grad_()
        return self.handed_on[index].clone()  # not the leaf itself: a block may add to its input in place

    def _unit(self, name: str) -> Callable:
        return lambda module, args: self.events.append(("unit", name))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _with_hidden(args: tuple, kwargs: dict, hidden: Optional[torch.Tensor]) -> Optional[tuple[tuple, dict]]:
    """The call's arguments with ``hidden`` in the hidden state's place (``hidden_argument``)."""
    if hidden is None:
        return None
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def hidden_argument(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The hidden state a block is called with: its first positional argument, or ``hidden_states``."""
    value = args[0] if args else kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def trace_structure(model: nn.Module, blocks: list[tuple[str, nn.Module]],
                    run: Callable[[nn.Module], Any]) -> BlockStructure:
    """Run ``run(model)`` once (no grad, eval mode, RNG state restored) and place every unit by
    when it ran; MethodConfigError for what a stage boundary cannot carry."""
    units = find_units(model, blocks)
    tracer = _Tracer(model, blocks, units)
    training = model.training
    try:
        # with autograd recording, each block's graph cut at the hidden state it hands on (_Tracer): what
        # the output's graph still reaches shows what else of the blocks it reads
        with torch.enable_grad(), torch.random.fork_rng(devices=_cuda_devices(model)):
            model.eval()
            output = run(model)
    finally:
        model.train(training)
        tracer.remove()
    calls = [index for kind, index in tracer.events if kind == "block"]
    _check_block_chain(blocks, calls, tracer)
    _check_side_channels(output, blocks, tracer)
    del output
    first = tracer.events.index(("block", 0))
    last = max(i for i, event in enumerate(tracer.events) if event == ("block", len(blocks) - 1))
    seen = {name: [i for i, event in enumerate(tracer.events) if event == ("unit", name)] for name in units}
    between = [n for n, at in seen.items() if any(first < i < last for i in at)]
    if between:
        raise MethodConfigError(METHOD, f"layers with parameters run between the repeated blocks "
                                f"({', '.join(between)}): the model is not one stack of blocks (e.g. two towers "
                                "such as CLIP's text and vision encoders), and a stage boundary carries one hidden "
                                "state; use tensor or data parallelism")
    before = [n for n, at in seen.items() if at and min(at) < first]
    after = [n for n, at in seen.items() if not at or max(at) > last]  # a unit run on both sides is on both lists
    output = tracer.outputs.get(0)
    length = len(output) if isinstance(output, (tuple, list)) else None
    return BlockStructure(blocks, before, after, length, traced=True)


def _check_block_chain(blocks: list, calls: list[int], tracer: _Tracer) -> None:
    names = [n for n, _ in blocks]
    if not calls:
        raise MethodConfigError(METHOD, f"the repeated blocks ({type(blocks[0][1]).__name__}) did not run in a forward "
                                "of the sample batch")
    if calls != list(range(len(blocks))):
        raise MethodConfigError(METHOD, "the repeated blocks must each run once, in registration order, as one "
                                f"chain to be cut into stages; they ran as {[names[i] for i in calls]} (a model of "
                                "two towers, such as CLIP's text and vision encoders, is not one chain); use tensor "
                                "or data parallelism")
    for index in range(1, len(blocks)):
        previous = tensors(tracer.outputs.get(index - 1))
        if tracer.inputs.get(index) is None or not previous or tracer.inputs[index] is not previous[0]:
            raise MethodConfigError(METHOD, f"{names[index]} does not take the hidden state {names[index - 1]} "
                                    "returned (code between the blocks changes it, or the block takes it under "
                                    "another name than the first argument or 'hidden_states'): a stage boundary "
                                    "carries exactly that tensor")


def _check_side_channels(output: Any, blocks: list, tracer: _Tracer) -> None:
    """Refuse a model whose output reads values its blocks compute besides the hidden state each hands
    to the next (a Mixture-of-Experts model's router logits for its load-balancing loss, collected
    hidden states or attention weights, a skip from an early block to the head): a stage boundary
    carries that hidden state only, so on a pipeline the last stage would see its own blocks' values
    alone and the earlier stages' would get no gradient from them, a silently different training."""
    last = len(blocks) - 1
    leaves = {id(t): k for k, t in tracer.handed_on.items() if k != last}
    if not leaves:
        return
    read: dict[int, list[str]] = {}
    for path, value in _tensor_leaves(output):
        for k in _leaves_reached(value, leaves):
            read.setdefault(k, []).append(path)
    if read:
        paths = sorted({p for ps in read.values() for p in ps})
        paths = paths if len(paths) <= 4 else paths[:4] + [f"{len(paths) - 4} more"]
        names = ["the first block's input" if k < 0 else blocks[k][0] for k in sorted(read)]
        raise MethodConfigError(METHOD, f"the model's output ({', '.join(paths)}) reads values computed inside the "
                                f"repeated blocks other than the hidden state each hands to the next (from "
                                f"{', '.join(names)}), e.g. the router logits of a load-balancing loss "
                                "(output_router_logits), collected hidden states (output_hidden_states) or attention "
                                "weights: a stage boundary carries the hidden state only, so the last stage would "
                                "see its own blocks' values alone and the others' would get no gradient; turn that "
                                "output off, compute such a loss inside the blocks, or use tensor, expert or data "
                                "parallelism")


# transformers' switches that make a model return what its layers compute besides the hidden state they
# hand on (each layer's hidden state, attention weights, router logits): set in a call, the trace never saw them
COLLECTING_SWITCHES = ("output_hidden_states", "output_attentions", "output_router_logits")


def refuse_collecting_switches(method: str, batch: Any, kwargs: dict) -> None:
    """InputError for a call that turns on a switch of ``COLLECTING_SWITCHES``: on stages the output would hold
    the last stage's layers' values beside stand-ins for the others', silently (``_check_side_channels``
    refuses a model whose config turns one on, when the strategy is applied)."""
    given = {**(batch if isinstance(batch, dict) else {}), **kwargs}
    on = [key for key in COLLECTING_SWITCHES if given.get(key) is True]
    if on:
        raise InputError(f"{method}: the call sets {', '.join(f'{key}=True' for key in on)}: a stage boundary carries "
                         "the hidden state only, so the output would hold the last stage's layers' values beside "
                         "stand-ins for the other stages' (silently wrong); call without it, or read them from a "
                         "model that is not pipelined")


def _tensor_leaves(output: Any) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for each tensor in the output that carries an autograd graph."""
    if hasattr(output, "to_tuple") and hasattr(output, "keys"):  # a transformers ModelOutput
        output = {key: output[key] for key in output.keys()}
    flat, _ = pytree.tree_flatten_with_path(output)
    return [(f"output{pytree.keystr(path)}", leaf) for path, leaf in flat
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]


def _leaves_reached(tensor: torch.Tensor, leaves: dict[int, int]) -> set[int]:
    """Which of ``leaves`` (tensor id -> block index) the tensor's autograd graph reaches."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in leaves:
            found.add(leaves[id(variable)])
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _cuda_devices(model: nn.Module) -> list:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


# --- what a stage holds ----------------------------------------------------------------------------
def canonical_names(model: nn.Module) -> dict[int, str]:
    """Parameter id -> the user's name for it (the first, for a weight registered under several)."""
    return {id(p): name for name, p in model.named_parameters()}


def held_parameters(model: nn.Module, structure: BlockStructure, owned: range, first: bool,
                    last: bool) -> dict[str, nn.Parameter]:
    """The weights a stage keeps, by canonical name: its blocks, the units before the blocks on the
    first stage and those after on the last, and parameters registered directly on the modules
    around the blocks (on every stage; their gradient comes from where they are used)."""
    modules = [structure.blocks[i][1] for i in owned]
    modules += [model.get_submodule(u) for u in structure.before if first]
    modules += [model.get_submodule(u) for u in structure.after if last]
    held = {id(p): p for m in modules for p in m.parameters()}
    grouped = {id(m) for _, b in structure.blocks for m in b.modules()}
    grouped |= {id(m) for u in structure.before + structure.after for m in model.get_submodule(u).modules()}
    for module in model.modules():
        if id(module) not in grouped:
            held.update((id(p), p) for p in module.parameters(recurse=False))
    names = canonical_names(model)
    return {names[key]: p for key, p in held.items()}


def shared_between_stages(model: nn.Module, structure: BlockStructure,
                          bounds: list[tuple[int, int]]) -> dict[str, list[int]]:
    """Canonical name -> the stages holding a copy, for weights held by more than one stage."""
    holders: dict[str, list[int]] = {}
    for stage, (start, stop) in enumerate(bounds):
        for name in held_parameters(model, structure, range(start, stop), stage == 0, stage == len(bounds) - 1):
            holders.setdefault(name, []).append(stage)
    return {name: stages for name, stages in holders.items() if len(stages) > 1}


# --- stand-ins for what another stage holds --------------------------------------------------------
def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device, made without copying its weights."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                            for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo)


class Placeholder(nn.Module):
    """Stands in for a module another stage holds: no parameters, but attribute reads (a block's
    ``attention_type``, an embedding's ``weight.dtype``) are answered by a meta-device copy."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.__dict__["_meta"] = meta_copy(module)
        self.__dict__["_device"] = next((p.device for p in module.parameters()), torch.device("cpu"))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_meta"], name)

    def atorch_stands_for(self) -> nn.Module:
        """The meta-device copy of the module this one stands in for: its structure, without values (what a
        library that reads the whole model's layers is shown: ``atorch.checkpoint.save_pretrained``)."""
        return self.__dict__["_meta"]


class PassThrough(Placeholder):
    """A block another stage owns: returns the hidden state it was given, shaped like the block's
    own output (a tensor, or a tuple whose first item is the hidden state)."""

    def __init__(self, module: nn.Module, output_len: Optional[int]):
        super().__init__(module)
        self.__dict__["_output_len"] = output_len

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = hidden_argument(args, kwargs)
        length = self.__dict__["_output_len"]
        return hidden if length is None else (hidden,) + (None,) * (length - 1)


class StandIn(Placeholder):
    """A unit another stage holds: returns zeros shaped as the unit's output (computed on its meta
    copy). Before the blocks its output is replaced by the received activation; after them it is
    never reached, as the stage ends at its last block."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.__dict__["_meta"](*to_meta(args), **to_meta(kwargs))
        device = self.__dict__["_device"]
        if device.type == "meta":  # a model built on meta: its inputs' device is the one it trains on
            device = next((t.device for t in tensors((args, kwargs)) if t.device.type != "meta"), device)
        return map_tensors(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), output)


def replace_everywhere(model: nn.Module, module: nn.Module, new: nn.Module) -> None:
    """Put ``new`` at every path ``module`` is registered under."""
    paths = [name for name, m in model.named_modules(remove_duplicate=False) if m is module and name]
    for path in paths:
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)


def positional_names(model: nn.Module, count: int) -> list[str]:
    """The names of the first ``count`` positional parameters of the model's forward: what a batch of
    ``count`` positional inputs sets (empty where the signature cannot be read)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in positional][:count]


def no_cache_kwargs(model: nn.Module, given: Iterable[str]) -> dict:
    """``use_cache=False`` when the model's forward takes it and the batch does not set it: a KV cache
    (HF ``DynamicCache``) is not a tensor a stage could pass on, and training does not use it."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in parameters and "use_cache" not in set(given) else {}

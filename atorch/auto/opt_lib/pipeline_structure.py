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
from torch import nn

from atorch.errors import MethodConfigError
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
    and out (to check that the blocks form one chain)."""

    def __init__(self, model: nn.Module, blocks: list, units: list[str]):
        self.events: list[tuple[str, Any]] = []
        self.inputs: dict[int, Optional[torch.Tensor]] = {}
        self.outputs: dict[int, Any] = {}
        self.handles = []
        for index, (_, block) in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._block_in(index), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._block_out(index)))
        for name in units:
            self.handles.append(model.get_submodule(name).register_forward_pre_hook(self._unit(name)))

    def _block_in(self, index: int) -> Callable:
        def hook(module, args, kwargs):
            self.events.append(("block", index))
            self.inputs.setdefault(index, hidden_argument(args, kwargs))
        return hook

    def _block_out(self, index: int) -> Callable:
        def hook(module, args, output):
            self.outputs.setdefault(index, output)
        return hook

    def _unit(self, name: str) -> Callable:
        return lambda module, args: self.events.append(("unit", name))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


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
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model)):
            model.eval()
            run(model)
    finally:
        model.train(training)
        tracer.remove()
    calls = [index for kind, index in tracer.events if kind == "block"]
    _check_block_chain(blocks, calls, tracer)
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

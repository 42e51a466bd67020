"""sequence_parallel: with tensor_parallel, shard the residual stream on the sequence dimension.

Between the split attention and MLP projections the residual stream (norm inputs and outputs,
residual sums) is kept as a sequence shard, so those activations take 1/tensor of the memory; the
all-reduce of plain tensor parallelism becomes an all-gather plus a reduce-scatter of the same
volume. Applied by tensor_parallel's wrapper (``atorch.auto.opt_lib.tensor_parallel``, which calls
``plan_sequence_parallel`` and ``apply_sequence_parallel``). Needs ``tensor_parallel`` in the strategy.

Where the shards live, per region (the repeated blocks under one parent, in whatever container:
GPT-2's ``h``, Llama's ``layers``, a torchtitan model's ``layers`` ModuleDict, a model holding its
blocks as plain attributes, T5's encoder and decoder ``block`` lists, CLIP's text and vision ``layers``):

- the first block of a region shards its hidden states (its first positional argument or the
  ``hidden_states`` keyword) and the last block gathers them (its output, or the first item of an
  output tuple), so the model around the blocks is unchanged. Every other input of a block
  (attention masks, position embeddings (cos, sin), T5's position bias, caches, encoder states)
  is passed on untouched: it stays full on every rank;
- each module holding the column-split projections of one attention or MLP (Llama's ``self_attn``,
  BERT's ``attention.self`` and ``intermediate``, T5's ``SelfAttention`` and ``DenseReluDense``)
  gathers its hidden-states input into a replicated DTensor, so it runs on the whole sequence
  (masks and position embeddings fit) and the backward reduce-scatters its gradient. Where the
  projections are direct children of the block (a plain residual block: norm, fc1, act, fc2), the
  column-split projection gathers its own input;
- row-split projections reduce-scatter their output to a sequence shard;
- LayerNorm / RMSNorm modules, and Linears left whole, on the residual stream run on the shard with
  replicated weights (their gradients are summed over the ranks by DTensor): they act per token;
- any other module on the residual stream holding parameters with nothing split inside (an MoE layer
  whose experts tensor_parallel leaves whole, Mixtral's, and, with a shared expert beside them that
  tensor_parallel then leaves whole too, DeepSeek's and Llama 4's; an attention it leaves whole,
  BLOOM's; a convolution) runs whole: it gathers the sequence, computes as in one process and its
  output is cut back to this rank's tokens (per sample when it returns them flattened into rows);
- a split group whose projections see only some tokens (the experts of a Mixture-of-Experts, fed the
  tokens their router picked) is gathered where its input is still the whole stream (the MoE layer,
  so its router runs whole too); its row-wise projections then all-reduce, and the layer's output is
  cut back to this rank's tokens. Where the recorded forward is available, gather points come from
  the input shapes it saw.

Sequence lengths that do not divide by the tensor size are sharded unevenly (ViT's 5 tokens: 3 + 2).

Refused (MethodConfigError, with the reason): a model without repeated blocks; a split projection
outside those blocks (its output would leave the sharded region); hidden states with a single
dimension (no tokens).
The token dimension is the one before the features: the sequence of [batch, sequence, hidden], the
rows of [rows, features] (a plain residual MLP called as ``model(x)`` shards its rows).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from atorch.auto.opt_lib.base import Optimization
from atorch.errors import MethodConfigError
from atorch.utils.batch import tensors
from atorch.utils.config import MethodConfig
from atorch.utils.dataflow import Dataflow
from atorch.utils.modules import repeated_blocks

logger = logging.getLogger(__name__)
NORM_SUFFIXES = ("LayerNorm", "RMSNorm")
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class SequenceParallelConfig(MethodConfig):
    """No options: sequence sharding follows the tensor dimension of parallel_mode."""


class SequenceParallelOptimization(Optimization):
    name = "sequence_parallel"
    distributed_only = True
    config_class = SequenceParallelConfig
    record_writes = ("sequence_parallel",)  # tensor_parallel reads it
    mesh_dims = ("tensor",)
    requires_one_of = ("tensor_parallel", "mixed_parallel")

    def normalize(self, config: Any) -> SequenceParallelConfig:
        """Also accepts True (on)."""
        return super().normalize(None if config is True else config)

    def transform(self, ctx, config: SequenceParallelConfig) -> None:
        ctx.sequence_parallel = True


# --- the plan ------------------------------------------------------------------------------------------
@dataclass
class SequenceRegion:
    """Consecutive blocks of one container; ``length`` is the full sequence length of the forward
    running now (set by the first block, read to give uneven shards their global shape)."""

    blocks: list[str]
    length: int = 0
    dim: int = 1  # the token dimension: -2 of the hidden states, set at the first forward
    ndim: int = 3  # the hidden states' dimensions


@dataclass
class SequencePlan:
    regions: list[SequenceRegion] = field(default_factory=list)
    gathers: dict[str, SequenceRegion] = field(default_factory=dict)   # module -> region: input gathered
    norms: dict[str, SequenceRegion] = field(default_factory=dict)     # per-token module -> region: on the shard
    reshard: dict[str, SequenceRegion] = field(default_factory=dict)   # gather point whose output is cut back
    replicated_rows: set = field(default_factory=set)                  # row-wise projections that all-reduce
    plain_gathers: set = field(default_factory=set)                    # gather points holding whole parameters
    whole: set = field(default_factory=set)                            # modules with nothing split, run whole


def plan_sequence_parallel(model: nn.Module, split: dict[str, str], flow: Optional[Dataflow] = None) -> SequencePlan:
    """Find the regions, the gather points and the norms for the ``split`` projections (module name
    -> "colwise" / "rowwise"), refusing what cannot run on a sequence shard. Changes nothing, so a
    refusal leaves the model as it was. ``flow`` (a recorded forward) places gather points where the
    whole stream still enters (Mixture-of-Experts layers) and orders blocks as they ran."""
    plan = SequencePlan(regions=block_regions(model, flow))
    if not plan.regions:
        raise MethodConfigError("sequence_parallel", f"{type(model).__name__} has no repeated blocks (transformer "
                                "layers): they delimit the sequence-sharded region")
    region_of = {block: region for region in plan.regions for block in region.blocks}
    for name, style in split.items():
        block = next((b for b in region_of if name.startswith(b + ".")), None)
        if block is None:
            raise MethodConfigError("sequence_parallel", f"{name} is split by tensor_parallel but lies outside the "
                                    f"repeated blocks ({_summary(region_of)}): its output would leave the sharded "
                                    f"region")
        if style == "colwise":
            point = _gather_point(name, block, flow)
            plan.gathers[point] = region_of[block]
            if (flow is not None and point != name
                    and flow.module_inputs.get(point) != flow.module_inputs.get(name.rpartition(".")[0])):
                plan.reshard[point] = region_of[block]
    for name, style in split.items():
        if style == "rowwise" and any(name.startswith(p + ".") for p in plan.reshard):
            plan.replicated_rows.add(name)
    for point in plan.gathers:
        if _holds_whole_parameters(model.get_submodule(point), point, split):
            plan.plain_gathers.add(point)
    for block, region in region_of.items():
        _classify(model.get_submodule(block), block, region, split, plan)
    return plan


def _holds_whole_parameters(module: nn.Module, name: str, split: dict[str, str]) -> bool:
    """Whether a gather point holds parameters outside the split projections."""
    for child, sub in module.named_modules():
        full = f"{name}.{child}" if child else name
        if any(full == s or full.startswith(s + ".") for s in split):
            continue
        if any(True for _ in sub.parameters(recurse=False)):
            return True
    return False


def _gather_point(name: str, block: str, flow: Optional[Dataflow]) -> str:
    """Where a column-split projection's input is gathered: its parent (the attention or MLP), or the
    projection itself when it sits directly in the block; with a recorded forward, the nearest
    enclosing module whose input has the block's shape (the whole stream)."""
    parent = name.rsplit(".", 1)[0]
    if parent == block:
        return name
    if flow is None or block not in flow.module_inputs:
        return parent
    stream = flow.module_inputs[block]
    point = parent
    while point != block and flow.module_inputs.get(point) != stream:
        point = point.rsplit(".", 1)[0]
        while point != block and point not in flow.module_inputs:  # containers are never called
            point = point.rsplit(".", 1)[0]
    return point if point != block else parent


def block_regions(model: nn.Module, flow: Optional[Dataflow] = None) -> list[SequenceRegion]:
    """The outermost repeated blocks, one region per parent (ModuleList, Sequential, ModuleDict; plain
    attributes when no container holds any, as repeated stacks such as T5's encoder and decoder are
    attributes too; T5's and CLIP's two stacks are separate regions with their own lengths), ordered
    as they ran when a forward was recorded, else as registered."""
    classes = set(repeated_blocks(model)[0])
    held = [(name, module, isinstance(module, CONTAINERS)) for name, module in model.named_modules()]
    in_containers = any(boxed and any(type(c).__name__ in classes for c in m.children()) for _, m, boxed in held)
    listed = {f"{name}.{child_name}" if name else child_name
              for name, module, boxed in held if boxed or not in_containers
              for child_name, child in module.named_children() if type(child).__name__ in classes}
    outer = [n for n in listed if not any(n.startswith(o + ".") for o in listed)]
    order = [n for n in flow.module_order if n in outer] if flow is not None else []
    order += [name for name, _ in model.named_modules() if name in outer and name not in order]
    regions: dict[str, SequenceRegion] = {}
    for name in order:
        regions.setdefault(name.rpartition(".")[0], SequenceRegion([])).blocks.append(name)
    return list(regions.values())


def _classify(module: nn.Module, name: str, region: SequenceRegion, split: dict[str, str], plan: SequencePlan) -> None:
    """Walk a block's residual stream (not into gather points): norms and Linears run on the shard,
    split projections are handled by their styles, containers and modules holding a split projection
    are walked into, and any other module holding parameters with nothing split inside (an MoE layer
    whose experts stay whole, an attention tensor_parallel left whole, a convolution) runs whole: it
    gathers the whole sequence, computes as in one process (its parameters' gradients alike on every
    rank) and its output is cut back to this rank's tokens, since it may mix tokens across the shard
    boundary. Modules without parameters (dropout, activations) run on the shard as they are."""
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}"
        if full in plan.gathers or full in split:
            continue
        if _per_token(child):
            plan.norms[full] = region
        elif isinstance(child, CONTAINERS) or _holds_split(full, split, plan):
            _classify(child, full, region, split, plan)
        elif any(True for _ in child.parameters()):
            plan.gathers[full] = plan.reshard[full] = region
            plan.plain_gathers.add(full)
            plan.whole.add(full)
            logger.info("sequence_parallel: %s (%s) holds parameters and nothing split; it runs on the whole "
                        "sequence", full, type(child).__name__)


def _per_token(module: nn.Module) -> bool:
    return type(module).__name__.endswith(NORM_SUFFIXES) or isinstance(module, nn.Linear)


def _holds_split(name: str, split: dict[str, str], plan: SequencePlan) -> bool:
    """Whether a split projection or a gather point lies at or below ``name``."""
    return any(n == name or n.startswith(name + ".") for n in [*split, *plan.gathers])


def _summary(region_of: dict) -> str:
    names = list(region_of)
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


# --- applying it ---------------------------------------------------------------------------------------
def apply_sequence_parallel(model: nn.Module, plan: SequencePlan, device_mesh) -> None:
    """Register the shard / gather hooks and replicate the norms (after parallelize_module, so each
    gather runs before the projection style's own input handling)."""
    handed = _HandedShards(device_mesh)
    for region in plan.regions:
        first, last = (model.get_submodule(n) for n in (region.blocks[0], region.blocks[-1]))
        first.register_forward_pre_hook(partial(_map_hidden, partial(_shard, device_mesh, region), region.blocks[0]),
                                        with_kwargs=True, prepend=True)
        last.register_forward_hook(partial(_gather_output, device_mesh, region, region.blocks[-1]))
        first.register_forward_pre_hook(partial(handed.record_input, region), with_kwargs=True)  # after the shard
        for name in region.blocks[:-1]:
            model.get_submodule(name).register_forward_hook(partial(handed.record, region))
    model.register_forward_pre_hook(handed.begin)
    model.register_forward_hook(handed.gather_in_output, always_call=True)
    for name, region in plan.gathers.items():
        gather = _gather_plain if name in plan.plain_gathers else _gather
        model.get_submodule(name).register_forward_pre_hook(
            partial(_map_hidden, partial(gather, device_mesh, region), name, alike=name in plan.whole),
            with_kwargs=True, prepend=True)
    for name, region in plan.reshard.items():
        model.get_submodule(name).register_forward_hook(partial(_reshard_output, device_mesh, region, name))
    for name, region in plan.norms.items():
        distribute_module(model.get_submodule(name), device_mesh, replicate_params, partial(_norm_input, region),
                          _norm_output)


class _HandedShards:
    """The sequence shards the blocks hand each other during one forward, by identity, so that where the
    model also returns one of them (each layer's hidden state: transformers' ``output_hidden_states``) the
    caller gets the whole sequence, as in one process, not this rank's tokens."""

    def __init__(self, device_mesh) -> None:
        self.device_mesh = device_mesh
        self.shards: list[tuple[torch.Tensor, SequenceRegion]] = []
        self.active = False  # inside the model's forward (not a checkpoint's recompute in backward)

    def begin(self, module: nn.Module, args: tuple) -> None:
        self.shards, self.active = [], True

    def record(self, region: SequenceRegion, module: nn.Module, args: tuple, output: Any) -> None:
        hidden = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else None
        if self.active and isinstance(hidden, torch.Tensor):
            self.shards.append((hidden, region))

    def record_input(self, region: SequenceRegion, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.record(region, module, args, args[0] if args else kwargs.get("hidden_states"))

    def gather_in_output(self, module: nn.Module, args: tuple, output: Any) -> Any:
        shards, self.shards, self.active = self.shards, [], False
        if not shards:
            return None

        def region_of(value: torch.Tensor) -> Optional[SequenceRegion]:
            return next((region for shard, region in shards if shard is value), None)

        def handed(value: torch.Tensor) -> bool:
            return region_of(value) is not None

        def whole(value: torch.Tensor) -> torch.Tensor:
            region = region_of(value)
            return value if region is None else _gather(self.device_mesh, region, value, "an output").to_local()

        if not any(handed(leaf) for leaf in tensors(output)):
            return None  # the output as it is (no shard in it)
        return pytree.tree_map_only(torch.Tensor, whole, output)


def _map_hidden(fn: Callable, where: str, module: nn.Module, args: tuple, kwargs: dict,
                alike: bool = False) -> tuple[tuple, dict]:
    """Apply ``fn`` to the hidden states only (first positional argument, or the ``hidden_states``
    keyword HF attention modules are called with); every other input passes untouched. With ``alike``
    (a module run whole), also to every other input of the hidden states' shape: more of the sharded
    stream (BLOOM's attention takes the residual and adds it itself)."""
    if args and isinstance(args[0], torch.Tensor):
        hidden = args[0]
    elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
        hidden = kwargs["hidden_states"]
    else:
        raise MethodConfigError("sequence_parallel", f"{where} ({type(module).__name__}) was called without hidden "
                                f"states (a tensor as first argument or hidden_states=); keywords given: "
                                f"{sorted(kwargs)}")
    mapped = fn(hidden, where)

    def swap(value: Any) -> Any:  # self-attention called as (x, x, x): every copy of x
        if value is hidden:
            return mapped
        if alike and isinstance(value, torch.Tensor) and value.shape == hidden.shape:
            return fn(value, where)
        return value

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


def _shard(device_mesh, region: SequenceRegion, hidden: torch.Tensor, where: str) -> torch.Tensor:
    """Replicated hidden states -> this rank's chunk of tokens; the backward all-gathers. The token
    dimension is the one before the features: the sequence of [batch, sequence, hidden], the rows of
    [rows, features] (a plain MLP's tokens are its rows)."""
    if hidden.dim() < 2:
        raise MethodConfigError("sequence_parallel", f"{where} receives a {list(hidden.shape)} tensor: there is no "
                                "token dimension to shard (sequence_parallel shards the dimension before the "
                                "features); use tensor_parallel alone")
    region.dim, region.length, region.ndim = hidden.dim() - 2, hidden.shape[-2], hidden.dim()
    replicated = DTensor.from_local(hidden, device_mesh, [Replicate()], run_check=False)
    return replicated.redistribute(device_mesh, [Shard(region.dim)]).to_local()


def _sharded(device_mesh, region: SequenceRegion, local: torch.Tensor) -> DTensor:
    """A local chunk of tokens as a DTensor with the true global shape (chunks may be uneven). A block
    that flattened its stream to rows (OPT: [batch x tokens, hidden] around its MLP) hands [rows,
    features]: its rows are this rank's tokens of every sample, even chunks only."""
    if local.dim() != region.ndim:
        if region.length % device_mesh.size():
            raise MethodConfigError("sequence_parallel", f"the block reshapes its {region.ndim}-dimensional hidden "
                                    f"states to {local.dim()} dimensions, which needs a sequence length dividing by "
                                    f"{device_mesh.size()} (got {region.length})")
        return DTensor.from_local(local, device_mesh, [Shard(local.dim() - 2)], run_check=False)
    shape = list(local.shape)
    shape[region.dim] = region.length
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, device_mesh, [Shard(region.dim)], run_check=False, shape=shape, stride=stride)


def _gather(device_mesh, region: SequenceRegion, local: torch.Tensor, where: str) -> DTensor:
    """The whole sequence as a replicated DTensor: the split projections consume it directly, so
    their partial input gradients are reduce-scattered back to the shard."""
    return _sharded(device_mesh, region, local).redistribute(device_mesh, [Replicate()])


def _gather_plain(device_mesh, region: SequenceRegion, local: torch.Tensor, where: str) -> torch.Tensor:
    """The whole sequence as a plain tensor, for a layer that also holds whole (unsplit) parameters
    (a norm before the projections, an MoE router): they compute on it as in one process. The split
    projections' partial input gradients are all-reduced where they enter (their input style), so the
    backward here only cuts this rank's tokens out."""
    return _gather(device_mesh, region, local, where).to_local()


def _map_hidden_output(fn: Callable[[torch.Tensor], torch.Tensor], where: str, output: Any) -> Any:
    """Apply ``fn`` to a module's hidden-states output: the output itself or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]), *output[1:])
    raise MethodConfigError("sequence_parallel", f"{where} returned {type(output).__name__}; expected its hidden "
                            "states as a tensor or as the first item of a tuple")


def _gather_output(device_mesh, region: SequenceRegion, where: str, module: nn.Module, args: tuple, output: Any) -> Any:
    """The last block hands the whole sequence (a plain tensor) to the rest of the model."""
    return _map_hidden_output(lambda local: _gather(device_mesh, region, local, where).to_local(), where, output)


def _reshard_output(device_mesh, region: SequenceRegion, where: str, module: nn.Module, args: tuple,
                    output: Any) -> Any:
    """A gathered layer whose row-wise projections all-reduced: its (whole, equal on every rank)
    output is cut back to this rank's tokens; the backward all-gathers. An output whose tokens are
    flattened into rows ([batch x tokens, hidden], as Llama 4's MoE layer returns) is cut per sample."""
    gathered = args[0] if args and isinstance(args[0], torch.Tensor) else None
    tokens = tuple(gathered.shape[:region.dim + 1]) if gathered is not None and gathered.dim() == region.ndim else ()

    def cut(full: torch.Tensor) -> torch.Tensor:
        flattened = bool(tokens) and full.dim() == region.ndim - 1 and full.shape[0] == math.prod(tokens)
        if flattened:
            full = full.view(*tokens, *full.shape[1:])
        replicated = DTensor.from_local(full, device_mesh, [Replicate()], run_check=False)
        local = replicated.redistribute(device_mesh, [Shard(region.dim)]).to_local()
        return local.reshape(-1, *local.shape[region.dim + 1:]) if flattened else local

    return _map_hidden_output(cut, where, output)


def _norm_input(region: SequenceRegion, module: nn.Module, inputs: tuple, device_mesh) -> tuple:
    return (_sharded(device_mesh, region, inputs[0]), *inputs[1:])


def _norm_output(module: nn.Module, output: DTensor, device_mesh) -> torch.Tensor:
    return output.to_local()


def replicate_params(name: str, module: nn.Module, device_mesh) -> None:
    """``distribute_module``'s partition function for a module that computes on sharded inputs with whole
    weights: its own parameters become replicated DTensors, whose partial gradients DTensor sums."""
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()]),
                                                      requires_grad=param.requires_grad))

"""The dataflow of one eager forward: which op consumed which tensor, recorded under a
TorchFunctionMode while the user's model runs a sample batch.

Why eager recording instead of torch.export / FX: it sees the model exactly as training runs it
(data-dependent control flow, HF caches, MoE routing on real tokens), needs no tracing-friendly code
and cannot fail on a model that trains. What it gives the plan finders is structure independent of
names: a Linear is known by the parameter it multiplies with, attention by
``scaled_dot_product_attention`` or by a matmul between two activations, and every tensor by the op
that made it. Composite functions appear as one op (``layer_norm``, ``softmax``): modes do not see
the calls made inside a handled function.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

# ops under which a feature (column) of the output depends only on the same feature of the inputs
# (elementwise maths, shape changes, casts, dropout, gathers on rows): a column split passes through
TRANSPARENT = frozenset({
    "view", "reshape", "view_as", "reshape_as", "transpose", "permute", "contiguous", "split", "chunk", "unbind",
    "__getitem__", "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "repeat", "repeat_interleave",
    "movedim", "swapaxes", "narrow", "select", "index_select", "clone", "float", "half", "bfloat16", "to", "type",
    "broadcast_to",
    "type_as", "dropout", "gelu", "silu", "relu", "tanh", "sigmoid", "mish", "leaky_relu", "elu", "selu", "softplus",
    "relu6", "hardswish", "hardtanh", "glu", "mul", "__mul__", "__rmul__", "mul_", "__imul__", "add", "__add__",
    "__radd__", "add_", "__iadd__", "sub", "__sub__", "__rsub__", "sub_", "div", "__truediv__", "div_", "neg",
    "__neg__", "cat", "concat", "stack", "masked_fill", "masked_fill_", "where", "clamp", "pow", "__pow__", "square",
    "exp", "sin", "cos", "abs", "sqrt", "rsqrt", "erf", "contiguous", "__and__", "detach", "view_as_complex",
    "view_as_real", "copy_",
    # comparisons, more elementwise maths, and a minimum / maximum of two tensors (xIELU's, PReLU)
    "gt", "lt", "ge", "le", "eq", "ne", "__gt__", "__lt__", "__ge__", "__le__", "__eq__", "__ne__", "expm1", "log1p",
    "log", "prelu", "minimum", "maximum", "fmin", "fmax",
})
# reductions when given a dimension or one tensor, elementwise when given two tensors
TWO_TENSOR_ELEMENTWISE = frozenset({"min", "max"})
# ops that read only their tensor input's shape, dtype and device, never its values: no data flows through
FACTORIES = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like", "ones_like",
                       "full_like"})
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax"})
MATMUL = frozenset({"matmul", "__matmul__", "__rmatmul__", "bmm", "einsum", "baddbmm"})
# batched matmuls that add their product to a first tensor (``bias.baddbmm(q, k)``: BLOOM's ALiBi scores,
# Megatron-style ``torch.baddbmm(buffer, q, k, beta=0)``); their operands are read as (batch1, batch2, input)
ADD_MATMUL = frozenset({"baddbmm"})
LINEAR = frozenset({"linear", "addmm", "mm", "matmul", "__matmul__"})
ATTENTION = frozenset({"scaled_dot_product_attention"})
EMBEDDING = frozenset({"embedding"})
# ops that broadcast a tensor's size-1 dimensions to a larger size (one head to every head)
BROADCASTS = frozenset({"expand", "expand_as", "broadcast_to"})
# a parameter read through one of these (``self.weight.T``, ``weight.t()``) is still that parameter to
# the op that consumes it: FalconLinear computes ``input @ self.weight.T``
WEIGHT_VIEWS = frozenset({"__get__", "t", "transpose", "permute", "mT"})


@dataclass
class Op:
    """One recorded call. ``inputs`` / ``outputs`` are tensor node ids (activations only: parameters
    are kept apart in ``params``); ``operands`` are the node ids of the positional tensor arguments in
    order (None for a parameter or a non-tensor), which attention and matmul need."""

    index: int
    name: str
    kind: str                                  # linear / embedding / attention / matmul / other
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    operands: list[Optional[int]] = field(default_factory=list)
    module: str = ""                           # linear / embedding: the module owning the weight
    args: tuple = ()                           # the non-tensor arguments (split sizes, shapes)


@dataclass
class Dataflow:
    """The recorded graph: ops in call order, which op made each tensor node and which consumed it,
    each node's shape, and the first input shape each module was called with."""

    ops: list[Op] = field(default_factory=list)
    producer: dict[int, int] = field(default_factory=dict)
    consumers: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    shapes: dict[int, tuple] = field(default_factory=dict)
    module_inputs: dict[str, tuple] = field(default_factory=dict)
    module_input_nodes: dict[str, int] = field(default_factory=dict)  # the first call's first input tensor
    module_outputs: dict[str, tuple] = field(default_factory=dict)
    module_order: list[str] = field(default_factory=list)

    def calls_of(self, module: str) -> list[Op]:
        return [op for op in self.ops if op.module == module and op.kind == "linear"]

    def forward_closure(self, nodes: Iterable[int],
                        passes: Callable[[Op], bool]) -> tuple[set[int], list[tuple[Op, int]]]:
        """Nodes reachable from ``nodes`` through ops ``passes`` accepts, and the (op, node) pairs where
        the walk stopped: the sinks, each with the node it reached them by."""
        seen, stack, sinks = set(nodes), list(nodes), []
        while stack:
            node = stack.pop()
            for index in self.consumers.get(node, ()):
                op = self.ops[index]
                if passes(op):
                    for out in op.outputs:
                        if out not in seen:
                            seen.add(out)
                            stack.append(out)
                else:
                    sinks.append((op, node))
        return seen, sinks

    def backward_sources(self, node: int, passes: Callable[[Op], bool]) -> list[Op]:
        """The ops that made ``node``, walking back through ops ``passes`` accepts; a node made by
        nothing recorded (a model input, a factory tensor) contributes no source."""
        seen, stack, sources = {node}, [node], []
        while stack:
            current = stack.pop()
            index = self.producer.get(current)
            if index is None:
                continue
            op = self.ops[index]
            if not passes(op):
                if op not in sources:
                    sources.append(op)
                continue
            for parent in op.inputs:
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        return sources


def is_transparent(op: Op) -> bool:
    if op.kind != "other":
        return False
    if op.name in TWO_TENSOR_ELEMENTWISE:  # torch.min(x, eps): elementwise; x.max(-1): a reduction
        return len(op.operands) == 2 and not op.args
    return op.name in TRANSPARENT


class _Recorder(TorchFunctionMode):
    def __init__(self, flow: Dataflow, owners: dict[int, tuple[str, str]]):
        super().__init__()
        self.flow, self.owners = flow, owners
        self.nodes: dict[int, int] = {}  # id of a live tensor -> its node
        self.count = 0
        self.forgetters: list[weakref.finalize] = []

    def __exit__(self, *exc: Any) -> Any:
        # a tensor still alive (a buffer) must not keep a weak reference: torch.utils.swap_tensors, which
        # gives a meta model its storage, refuses a tensor that has one
        for forget in self.forgetters:
            forget.detach()
        self.forgetters.clear()
        return super().__exit__(*exc)

    def node(self, tensor: torch.Tensor, create: bool) -> Optional[int]:
        """The node of ``tensor``. A tensor's node is forgotten when the tensor dies, before Python can give
        its id to another one: keeping every output alive to keep ids unique would hold the whole forward's
        activations (and, on a meta model, every sample weight a view was taken of) until the end."""
        key = id(tensor)
        if key not in self.nodes:
            if not create:
                return None
            self.nodes[key] = self.count
            self.count += 1
            self.forgetters.append(weakref.finalize(tensor, self.nodes.pop, key, None))
            self.flow.shapes[self.nodes[key]] = tuple(tensor.shape)
        return self.nodes[key]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in WEIGHT_VIEWS and self._tag_weight_view(args, out):
            return out
        if name in ("size", "dim", "numel", "__len__", "__format__", "__repr__", "item", "tolist", "data_ptr",
                    "__get__", "__set__", "shape", "is_floating_point", "requires_grad_", "__bool__"):
            return out
        self._record(name, args, kwargs, out)
        return out

    def _tag_weight_view(self, args: tuple, out: Any) -> bool:
        """A view of a parameter (``weight.T``) is owned by that parameter while it lives, so the op
        consuming it is a Linear of that module. True when ``out`` was tagged (nothing is recorded)."""
        if not (args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor)):
            return False
        owner = self.owners.get(tensor_key(args[0]))
        if owner is None or out is args[0]:
            return False
        key = id(out)
        self.owners[key] = owner
        self.forgetters.append(weakref.finalize(out, self.owners.pop, key, None))
        return True

    def _record(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        op = Op(len(self.flow.ops), name, "other")
        leaves = pytree.tree_leaves((args, kwargs))
        params = [t for t in leaves if isinstance(t, torch.Tensor) and tensor_key(t) in self.owners]
        positional = _add_matmul_operands(args, kwargs) if name in ADD_MATMUL else args
        op.kind, op.module = self._kind(name, params, positional)
        op.operands = [self.node(a, True) if isinstance(a, torch.Tensor) and tensor_key(a) not in self.owners else None
                       for a in positional]
        op.args = tuple(a for a in args if not isinstance(a, torch.Tensor))
        op.inputs = [] if name in FACTORIES else [self.node(t, True) for t in leaves
                                                  if isinstance(t, torch.Tensor) and tensor_key(t) not in self.owners]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        op.outputs = []
        for tensor in outs:
            in_place = id(tensor) in self.nodes and self.nodes[id(tensor)] in op.inputs
            if in_place:  # a new version
                del self.nodes[id(tensor)]
            node = self.node(tensor, True)
            op.outputs.append(node)
            self.flow.producer[node] = op.index
            if in_place:
                self._new_base_version(tensor, op)
        for node in dict.fromkeys(op.inputs):
            self.flow.consumers[node].append(op.index)
        self.flow.ops.append(op)

    def _new_base_version(self, view: torch.Tensor, op: Op) -> None:
        """An in-place op on a view writes into its base too (``key[..., :d].copy_(k)``, HF's
        multi-head latent attention): the base gets a new version made by ``op`` from its old one."""
        base = view._base
        if base is None or id(base) not in self.nodes:
            return
        old = self.nodes.pop(id(base))
        op.inputs.append(old)
        node = self.node(base, True)
        op.outputs.append(node)
        self.flow.producer[node] = op.index

    def _kind(self, name: str, params: list[torch.Tensor], args: tuple) -> tuple[str, str]:
        weights = [self.owners[tensor_key(p)] for p in params if self.owners[tensor_key(p)][1] == "weight"]
        if name in LINEAR and weights:
            return "linear", weights[0][0]
        if name in EMBEDDING and weights:
            return "embedding", weights[0][0]
        if name in ATTENTION:
            return "attention", ""
        if name in MATMUL and not params and sum(isinstance(a, torch.Tensor) for a in args) >= 2:
            return "matmul", ""
        return "other", ""


def add_matmul_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``baddbmm``'s tensors by name ("input", "batch1", "batch2"), given by position or by keyword."""
    names = ("input", "batch1", "batch2")
    return {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}


def _add_matmul_operands(args: tuple, kwargs: dict) -> tuple:
    """``baddbmm``'s (batch1, batch2, input): the two factors first, as a plain matmul's operands are, then
    the tensor the product is added to (a score bias)."""
    given = add_matmul_arguments(args, kwargs)
    return tuple(given.get(n) for n in ("batch1", "batch2", "input"))


def tensor_key(tensor: torch.Tensor) -> int:
    """A parameter's identity: its own id, or, for the sample values a meta-device parameter holds
    during a sample forward (``atorch.utils.meta_init.sample_values``), the meta parameter's id."""
    return getattr(tensor, "_atorch_sample_of", None) or id(tensor)


def _first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    for value in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def record_dataflow(model: nn.Module, run: Callable[[nn.Module], Any]) -> Dataflow:
    """Run ``run(model)`` once (no grad, eval mode, RNG state kept) and record its dataflow."""
    flow = Dataflow()
    owners = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), (module_name, param_name))
    hooks = []
    recorder = _Recorder(flow, owners)
    for module_name, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(_input_hook(flow, module_name, recorder), with_kwargs=True))
        hooks.append(module.register_forward_hook(_output_hook(flow, module_name)))
    training = model.training
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), recorder:
            model.eval()
            run(model)
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    return flow


def _input_hook(flow: Dataflow, name: str, recorder: "_Recorder") -> Callable:
    def hook(module, args, kwargs):
        tensor = _first_tensor(args, kwargs)
        if name not in flow.module_inputs:
            flow.module_order.append(name)
            flow.module_inputs[name] = tuple(tensor.shape) if tensor is not None else ()
            node = recorder.node(tensor, False) if tensor is not None else None
            if node is not None:
                flow.module_input_nodes[name] = node
    return hook


def _output_hook(flow: Dataflow, name: str) -> Callable:
    def hook(module, args, output):
        tensor = next((t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)), None)
        flow.module_outputs.setdefault(name, tuple(tensor.shape) if tensor is not None else ())
    return hook

"""Mixture-of-Experts expert banks under tensor_parallel: each tensor rank holds 1/t of the experts.

An expert bank keeps its experts' weights as parameters stacked on a leading expert dimension (3-D
and more) and is called as ``bank(hidden_states, expert_index, expert_weights)``: transformers' experts
interface, which every MoE model of transformers 5 uses (Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...), whose
fused ``gate_up_proj`` / ``down_proj`` are no Linear the dataflow could split. On the tensor ranks the
tokens and the router's choices are the same, and the bank's output is a sum over experts, so the bank
splits by expert: rank r keeps experts [r E/t, (r+1) E/t) (each parameter ``Shard(0)`` over the tensor
group, so checkpoints, exports and pretrained loading see the whole bank), runs the bank's own forward
on them with the choices of other ranks' experts mapped to the bank's "no expert" slot (the interface's
sentinel, ``num_experts``, which its eager kernel skips and its batched and grouped kernels mask under
their expert-parallel switch, set for the call), and the partial
outputs are summed over the group in forward; the partial gradients of the inputs are summed in
backward. A bank is recognised by that interface and its shapes (an integer ``num_experts`` of at least
2, every own parameter's leading dimension equal to it, three inputs), never by its name; the plan's
check (the sample forward and backward against the unsplit model) confirms it. Under sequence
parallelism the banks stay whole: each rank's tokens differ there.

torchtitan's banks (``GroupedExperts``) take the routed tokens already grouped by expert with each
expert's count, ``bank(x, num_tokens_per_expert)`` (two inputs): rank r runs the bank on its experts'
rows of ``x`` with their counts, the other rows of its output are zeros, and the outputs are summed over
the group as above. A call whose second input is not one integer count per expert is refused with the
reason (``ExpertBankCallError``), which the plan's check reports.

Llama 4's banks (``Llama4TextExperts``) take one input, every expert's rows one after another (each
token repeated once per expert, scaled by its routing score: ``bank(x)`` with ``x`` of E equal groups of
rows): rank r runs the bank on its experts' groups of rows, the rest of its output is zeros, summed over
the group as above. A call whose rows do not make E equal groups is refused (``ExpertBankCallError``).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode

from atorch.errors import ExpertBankCallError

EXPERTS_ATTR = "_atorch_expert_split"  # (total experts, this rank's first, its count, tensor mesh)
# transformers' switch for its batched and grouped kernels to mask the "no expert" rows (its expert
# parallelism); its eager kernel skips them always
EXPERT_PARALLEL_FLAG = "_is_expert_parallel"


def find_expert_banks(model: nn.Module, tp: int) -> tuple[list[str], dict[str, str]]:
    """The expert banks of ``model`` that split over ``tp`` ranks, and why the others do not."""
    banks: list[str] = []
    why: dict[str, str] = {}
    for name, module in model.named_modules():
        if not is_expert_bank(module):
            continue
        if module.num_experts % tp:
            why[name] = f"its {module.num_experts} experts do not divide by the tensor size {tp}"
            continue
        banks.append(name)
    return banks, why


def is_expert_bank(module: nn.Module) -> bool:
    return bank_interface(module) is not None


def bank_interface(module: nn.Module) -> Optional[str]:
    """"routed" (transformers: tokens, expert index, routing weights), "grouped" (torchtitan: tokens
    grouped by expert, per-expert counts), "rows" (Llama 4: every expert's rows, expert by expert) or
    None (not an expert bank)."""
    experts = getattr(module, "num_experts", None)
    params = [p for _, p in module.named_parameters(recurse=False)]
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 2 or not params:
        return None
    # stacked weights (3-D), and their biases (2-D, gpt-oss's): every one led by the expert dimension
    if not (all(p.dim() >= 2 and p.shape[0] == experts for p in params) and any(p.dim() >= 3 for p in params)):
        return None
    try:
        inputs = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in inputs)
    return {1: "rows", 2: "grouped"}.get(positional, "routed" if positional >= 3 else None)


def split_expert_bank(bank: nn.Module, tp_mesh: Any) -> None:
    """Keep this rank's experts (``Shard(0)`` on the tensor mesh) and run the bank on them."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    local = bank.num_experts // tp
    for name, param in list(bank.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            bank.register_parameter(name, nn.Parameter(distribute_tensor(param.data, tp_mesh, [Shard(0)]),
                                                       requires_grad=param.requires_grad))
    setattr(bank, EXPERTS_ATTR, (bank.num_experts, rank * local, local, tp_mesh))
    split = {"grouped": _grouped_split_class, "rows": _rows_split_class}.get(bank_interface(bank), _split_class)
    bank.__class__ = split(type(bank))


@functools.cache
def _split_class(base: type) -> type:
    class SplitExpertBank(base):
        """``base`` holding only this rank's experts (``tp_experts``)."""

        def forward(self, hidden_states: torch.Tensor, expert_index: torch.Tensor, expert_weights: torch.Tensor,
                    *args: Any, **kwargs: Any) -> Any:
            total, first, local, tp_mesh = getattr(self, EXPERTS_ATTR)
            hidden_states = gradient_summed(hidden_states, tp_mesh)
            expert_weights = gradient_summed(expert_weights, tp_mesh)
            index = expert_index - first
            index = torch.where((index >= 0) & (index < local), index, torch.full_like(index, local))
            with _local_experts(self, local), _SentinelIsNoClass(local):
                partial = super().forward(hidden_states, index, expert_weights, *args, **kwargs)
            return _summed_over_group(partial, tp_mesh)

    SplitExpertBank.__name__ = SplitExpertBank.__qualname__ = f"Split{base.__name__}"
    return SplitExpertBank


class _SentinelIsNoClass(TorchFunctionMode):
    """A bank that one-hot encodes its choices over its own expert count (gpt-oss's eager kernel,
    ``one_hot(index, num_classes=num_experts)``; Mixtral's counts one more class for the sentinel) meets
    the "no expert" sentinel, ``local``, as no class: an all-zero row, so it runs no expert for it."""

    def __init__(self, local: int):
        super().__init__()
        self.local = local

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.one_hot:
            classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
            if classes == self.local:
                return func(args[0], num_classes=self.local + 1)[..., :self.local]
        return func(*args, **kwargs)


@functools.cache
def _grouped_split_class(base: type) -> type:
    class SplitGroupedExperts(base):
        """``base`` holding only this rank's experts (``tp_experts``), called with tokens grouped by expert."""

        def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            total, first, local, tp_mesh = getattr(self, EXPERTS_ATTR)
            counts = _checked_counts(num_tokens_per_expert, total, x.shape[0], type(self).__name__)
            before, mine = counts[:first].sum(), counts[first:first + local].sum()
            start, stop = int(before), int(before + mine)
            x = gradient_summed(x, tp_mesh)
            with _local_experts(self, local):
                own = super().forward(x[start:stop], num_tokens_per_expert[first:first + local], *args, **kwargs)
            rows = own.shape[1:]
            partial = torch.cat([own.new_zeros(start, *rows), own[:stop - start],
                                 own.new_zeros(x.shape[0] - stop, *rows)], dim=0)
            return _summed_over_group(partial, tp_mesh)

    SplitGroupedExperts.__name__ = SplitGroupedExperts.__qualname__ = f"Split{base.__name__}"
    return SplitGroupedExperts


@functools.cache
def _rows_split_class(base: type) -> type:
    class SplitExpertRows(base):
        """``base`` holding only this rank's experts (``tp_experts``), called with every expert's rows."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            total, first, local, tp_mesh = getattr(self, EXPERTS_ATTR)
            if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] % total:
                what = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ExpertBankCallError(
                    f"tensor_parallel split {type(self).__name__} by expert as a bank called with every expert's "
                    f"rows one expert after another ({total} equal groups of rows), but it was given {what}; keep "
                    f"this module whole (leave tensor_parallel out) or call it with {total} equal groups of rows")
            per = x.shape[0] // total
            start, stop = first * per, (first + local) * per
            x = gradient_summed(x, tp_mesh)
            with _local_experts(self, local):
                own = super().forward(x[start:stop], *args, **kwargs)
            per_out = own.shape[0] // local
            rows = own.shape[1:]
            partial = torch.cat([own.new_zeros(first * per_out, *rows), own,
                                 own.new_zeros((total - first - local) * per_out, *rows)], dim=0)
            return _summed_over_group(partial, tp_mesh)

    SplitExpertRows.__name__ = SplitExpertRows.__qualname__ = f"Split{base.__name__}"
    return SplitExpertRows


def _checked_counts(counts: Any, experts: int, rows: int, bank: str) -> torch.Tensor:
    """The per-expert token counts, on the CPU; refused unless they are one integer per expert that
    the grouped rows hold: a tensor (torchtitan's ``num_tokens_per_expert``) or a list of Python ints
    (JetMoE's ``expert_size``, from ``.tolist()``, which its bank hands to ``split``)."""
    if isinstance(counts, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        counts = torch.tensor(counts, dtype=torch.int64)
    valid = (isinstance(counts, torch.Tensor) and counts.dim() == 1 and counts.numel() == experts
             and not counts.is_floating_point() and not counts.is_complex())
    if not valid:
        what = f"a {counts.dtype} tensor of shape {tuple(counts.shape)}" if isinstance(counts, torch.Tensor) else \
            type(counts).__name__
        raise ExpertBankCallError(
            f"tensor_parallel split {bank} by expert as a grouped bank (tokens grouped by expert, then one "
            f"integer count per expert), but its second input is {what}, not {experts} integer counts; "
            f"keep this module whole (leave tensor_parallel out) or call it as bank(x, num_tokens_per_expert)")
    counts = counts.detach().to("cpu", torch.int64)
    if int(counts.sum()) > rows:
        raise ExpertBankCallError(f"{bank}: its counts add up to {int(counts.sum())} tokens but it was given {rows}")
    return counts


def _summed_over_group(partial: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """Each rank's partial output (from its experts) summed over the tensor group."""
    summed = DTensor.from_local(partial, tp_mesh, [Partial()], run_check=False)
    return summed.redistribute(tp_mesh, [Replicate()]).to_local()


def gradient_summed(tensor: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """``tensor`` unchanged in forward; in backward its gradient, partial on each rank (from its experts),
    summed over the tensor group."""
    if not (tensor.requires_grad and tensor.is_floating_point()):
        return tensor
    replicated = DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False)
    return replicated.to_local(grad_placements=[Partial()])


@contextlib.contextmanager
def _local_experts(bank: nn.Module, local: int) -> Iterator[None]:
    """The bank's parameters as this rank's plain shards (their gradients flow back into the sharded
    parameters), and ``num_experts`` as this rank's count, for one forward."""
    params = bank._parameters
    registered = dict(params)  # in order: the optimizer and checkpoints read the parameters in it
    names = [n for n, p in registered.items() if isinstance(p, DTensor)]
    experts, expert_parallel = bank.num_experts, bank.__dict__.get(EXPERT_PARALLEL_FLAG)
    try:
        for name in names:
            del params[name]
            bank.__dict__[name] = registered[name].to_local()
        bank.num_experts = local
        if expert_parallel is not None:
            bank.__dict__[EXPERT_PARALLEL_FLAG] = True
        yield
    finally:
        for name in names:
            bank.__dict__.pop(name, None)
        params.clear()
        params.update(registered)
        bank.num_experts = experts
        if expert_parallel is not None:
            bank.__dict__[EXPERT_PARALLEL_FLAG] = expert_parallel

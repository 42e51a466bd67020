"""Models built on the meta device: find how each part is initialised, then give every process real
storage for its own part only and initialise it with the model's own initialisation.

A model built under ``torch.device("meta")`` (or accelerate's ``init_empty_weights``) has shapes but
no values, so atorch can split and shard it before any memory is spent. Afterwards each process
allocates only its local shards (``to_empty``), and the values come from the model's own code:

- a per-module initialiser: a Hugging Face model's ``_init_weights(module)`` (from the nearest
  ``PreTrainedModel`` above the module, as HF's ``initialize_weights`` dispatches it), else the
  module's ``reset_parameters()`` / ``_reset_parameters()`` (torch's layers, nn.MultiheadAttention).
  Each module's own tensors are initialised full-size, one module at a time, from one seed every
  process agrees on, and each process keeps its slice: sharded and replicated parts agree across
  processes, and no process holds more than one module's tensors beyond its own part.
- a whole-model initialiser, ``init_weights()`` on the root (torchtitan's convention), runs on the
  sharded model itself. Random ops on sharded tensors draw per shard (on CPU, where DTensor has no
  RNG tracker of its own, from a seed derived from the shard's offset), so shards are independent
  and replicated tensors agree.

Every tensor is filled with NaN before its initialiser runs; one the initialiser left untouched is
refused with the module and tensor named, never trained on as garbage. Non-persistent buffers (a
RoPE ``inv_freq``) are not in any checkpoint, so they must be recomputed here too: HF's
``_init_weights`` and torchtitan's ``init_weights`` do.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import _random as dtensor_random
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from atorch.errors import MetaModelError
from atorch.utils.modules import SAVED_ORDERS_ATTR

logger = logging.getLogger(__name__)

WHOLE_MODEL_INIT = "init_weights"  # torchtitan's root initialiser (no required argument)
MODULE_INITS = ("reset_parameters", "_reset_parameters")


def is_meta(tensor: Optional[torch.Tensor]) -> bool:
    if tensor is None:
        return False
    if isinstance(tensor, DTensor):
        return tensor.to_local().is_meta
    return tensor.is_meta


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` lives on the meta device."""
    return any(is_meta(t) for t in _all_tensors(model))


def _all_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _own_meta_tensors(module: nn.Module) -> list[str]:
    names = [n for n, p in module._parameters.items() if is_meta(p)]
    return names + [n for n, b in module._buffers.items() if is_meta(b)]


# --- finding each module's initialiser ------------------------------------------------------------
@dataclass
class InitPlan:
    """How a meta model is initialised: whole-model initialisers (torchtitan's ``init_weights``) for
    the subtrees under them, per-module initialisers for every other module with meta tensors."""

    whole_model: list[tuple[str, nn.Module, Callable[[], Any]]] = field(default_factory=list)
    per_module: list[tuple[str, nn.Module, Callable[[], Any], str]] = field(default_factory=list)

    def describe(self) -> str:
        kinds = sorted({how for *_, how in self.per_module})
        parts = [f"init_weights() of {len(self.whole_model)} model(s)"] if self.whole_model else []
        if self.per_module:
            parts.append(f"{len(self.per_module)} module(s) by {', '.join(kinds)}")
        return " and ".join(parts) or "nothing to initialise"


def plan_initialisation(model: nn.Module) -> InitPlan:
    """Find the initialiser of every module holding meta tensors, before anything is allocated.

    A module with a torchtitan-style ``init_weights()`` initialises everything under it (the topmost
    such module: the user's model, or each pipeline stage's copy of it). MetaModelError names the
    first other module with meta parameters or buffers that has no initialiser."""
    plan = InitPlan(whole_model=_whole_model_roots(model))
    covered = {id(m) for _, root, _ in plan.whole_model for m in root.modules()}
    for name, module, owner in _modules_post_order(model):
        if id(module) in covered or not _own_meta_tensors(module):
            continue
        found = _module_initialiser(module, owner)
        if found is None:
            raise MetaModelError(
                f"module {name or '<root>'!r} ({type(module).__name__}) was built on the meta device with tensors "
                f"{_own_meta_tensors(module)} but atorch finds no initialiser for it: it has no reset_parameters() "
                "(nor _reset_parameters()), no Hugging Face PreTrainedModel above it provides _init_weights, and the "
                "model has no init_weights(); give the module reset_parameters(), or build this part on a real "
                "device", module=name)
        plan.per_module.append((name, module, found[0], found[1]))
    return plan


def meta_copy(model: nn.Module) -> Optional[nn.Module]:
    """A deep copy of ``model`` with its parameters on the meta device (buffers are copied as they are),
    or None when some module of it has no initialiser (``plan_initialisation`` refuses it).

    A dry run only needs a candidate's shapes and a step's cost, not the user's values, so the search
    applies each candidate to such a copy: the candidate materialises only its own shards, and a dry run
    costs the candidate's memory rather than a whole copy of the model beside the user's own. Tied
    parameters stay tied (one meta parameter per shared original)."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device="meta"),
                                           requires_grad=parameter.requires_grad)
    copied = copy.deepcopy(model, memo)
    try:
        plan = plan_initialisation(copied)
    except MetaModelError:
        return None
    return copied if _custom_initialisers_set_their_tensors(plan) else None


def _custom_initialisers_set_their_tensors(plan: InitPlan) -> bool:
    """Whether the initialiser of each module not from ``torch.nn`` sets every tensor the module owns,
    tried full size on CPU, one module's own tensors at a time (a norm's weight, a class token; the
    user's RNG state is left as it was). Hugging Face's ``_init_weights`` skips some (CLIP's
    ``logit_scale``): a meta copy of such a model could never be materialised, and every dry run on it
    would fail, so the caller copies the real model instead. ``torch.nn``'s own layers' initialisers set
    all their tensors and are not tried."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for _, module, init, _ in plan.per_module:
            if not type(module).__module__.startswith("torch.") and not _sets_every_own_tensor(module, init):
                return False
    return True


def _sets_every_own_tensor(module: nn.Module, init: Callable[[], Any]) -> bool:
    """Run ``init`` with the module's own meta tensors swapped for NaN-filled CPU ones; whether none is
    left NaN (False too when ``init`` raises). The meta tensors are put back whatever happens."""
    own = [(attr, slot) for slot in ("_parameters", "_buffers")
           for attr, t in getattr(module, slot).items() if is_meta(t)]
    live = {attr: getattr(module, slot)[attr] for attr, slot in own}
    trial = {attr: _nan_tensor(tuple(t.shape), t.dtype, torch.device("cpu")) for attr, t in live.items()}
    try:
        filled = _init_in_place_of(module, own, live, trial, init)
    except Exception:  # noqa: BLE001 - an initialiser that cannot run here: the caller copies the real model
        return False
    return not any((t.is_floating_point() or t.is_complex()) and torch.isnan(t).any() for t in filled.values())


def _init_in_place_of(module: nn.Module, own: list[tuple[str, str]], live: dict[str, torch.Tensor],
                      stand_ins: dict[str, torch.Tensor], init: Callable[[], Any]) -> dict[str, torch.Tensor]:
    """Run ``init`` with the module's own tensors (``own``: (attr, slot) pairs) swapped for ``stand_ins``;
    returns what it left in their places (it may replace a buffer: torchtitan's freqs_cis). The ``live``
    tensors are put back whatever happens."""
    for attr, slot in own:
        getattr(module, slot)[attr] = (nn.Parameter(stand_ins[attr], requires_grad=live[attr].requires_grad)
                                       if slot == "_parameters" else stand_ins[attr])
    try:
        init()
        return {attr: getattr(module, slot)[attr] for attr, slot in own}
    finally:
        for attr, slot in own:
            getattr(module, slot)[attr] = live[attr]


def _whole_model_roots(model: nn.Module) -> list[tuple[str, nn.Module, Callable[[], Any]]]:
    """The topmost modules whose ``init_weights`` is torchtitan-style: callable with no argument, and
    not HF's (HF's ``init_weights`` re-runs ``_init_weights`` over the whole model at once)."""
    roots = []

    def visit(prefix: str, module: nn.Module) -> None:
        method = getattr(module, WHOLE_MODEL_INIT, None)
        if (_hf_owner_init(module) is None and callable(method) and _callable_without_arguments(method)
                and any(is_meta(t) for t in _all_tensors(module))):
            roots.append((prefix, module, method))
            return
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    return roots


def _callable_without_arguments(method: Callable) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _hf_owner_init(module: nn.Module) -> Optional[Callable[[nn.Module], Any]]:
    """A Hugging Face PreTrainedModel's per-module initialiser, when ``module`` is one."""
    init = getattr(module, "_init_weights", None)
    if callable(init) and hasattr(module, "config") and hasattr(module, "post_init"):
        return init
    return None


def _modules_post_order(model: nn.Module) -> Iterator[tuple[str, nn.Module, Optional[Callable]]]:
    """``(name, module, HF owner's _init_weights or None)``, children before their parent (the order
    HF's ``initialize_weights`` uses), each module once."""
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module, owner: Optional[Callable]) -> Iterator:
        if id(module) in seen:
            return
        seen.add(id(module))
        owner = _hf_owner_init(module) or owner
        for child_name, child in module.named_children():
            yield from visit(f"{prefix}.{child_name}" if prefix else child_name, child, owner)
        yield prefix, module, owner

    yield from visit("", model, None)


def _module_initialiser(module: nn.Module, owner: Optional[Callable]) -> Optional[tuple[Callable, str]]:
    if owner is not None:
        return (lambda: owner(module)), "_init_weights"
    for attr in MODULE_INITS:
        method = getattr(module, attr, None)
        if callable(method):
            return method, f"{attr}()"
    return None


# --- materialising ------------------------------------------------------------------------------
@dataclass
class MaterializeRecord:
    """What materialisation did on this process (tests and logs read it)."""

    how: str
    tensors: int = 0
    local_bytes: int = 0  # the storage this process allocated for its own part
    largest_temporary_bytes: int = 0  # the most held at once beyond it (one module's tensors, full size)


def materialize(model: nn.Module, device: torch.device, plan: Optional[InitPlan] = None,
                seed: Optional[int] = None) -> MaterializeRecord:
    """Allocate this process's part of every meta tensor of ``model`` on ``device`` and initialise it
    with the model's own initialisation (collective when the default process group exists: the seed
    is agreed). The caller's RNG state is left as it was."""
    plan = plan or plan_initialisation(model)
    seed = agreed_seed() if seed is None else seed
    _allocate_meta_tensors(model, device)
    record = MaterializeRecord(how=plan.describe())
    with torch.random.fork_rng(devices=_rng_devices(device)), torch.no_grad():
        for name, root, init in plan.whole_model:
            torch.manual_seed(_module_seed(seed, name))
            _run_whole_model(root, init, seed, record)
        done: set[int] = set()  # a tied weight takes its first module's values, whatever the split
        for name, module, init, _ in plan.per_module:
            torch.manual_seed(_module_seed(seed, name))
            _init_module_full_size(name, module, init, device, record, done)
    record.tensors = _check_filled(model, plan)
    for module in model.modules():
        module.__dict__.pop(PENDING_ATTR, None)
    logger.info("materialised a meta-device model: %d tensor(s), %.1f MiB on this process, by %s", record.tensors,
                record.local_bytes / 2**20, record.how)
    return record


PENDING_ATTR = "_atorch_meta_pending"  # module attribute: its tensors that were on meta, until initialised


def _allocate_meta_tensors(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` for the meta tensors only: real ones (accelerate's ``init_empty_weights`` leaves
    buffers real) keep their values. Sharded tensors get storage for the local shard only. Each
    module remembers which of its tensors were on meta: only those are initialised."""
    for module in model.modules():
        pending = _own_meta_tensors(module)
        if pending:
            module.__dict__[PENDING_ATTR] = set(pending)

    allocated: set[int] = set()
    for module in model.modules():
        for slot in ("_parameters", "_buffers"):
            for tensor in getattr(module, slot).values():
                if tensor is not None and id(tensor) not in allocated and is_meta(tensor):
                    allocated.add(id(tensor))
                    _give_storage(tensor, device)


def _give_storage(tensor: torch.Tensor, device: torch.device) -> None:
    """Real (uninitialised) storage for a meta tensor, in place: the object stays the same, so a
    weight tied between modules stays one tensor, and whoever holds it (FSDP's sharded parameter, a
    hook) sees the new storage."""
    if isinstance(tensor, DTensor):
        local = torch.empty_like(tensor.to_local(), device=device)
        new = DTensor.from_local(local, tensor.device_mesh, tensor.placements, shape=tensor.shape,
                                 stride=tensor.stride(), run_check=False)
    else:
        new = torch.empty_like(tensor, device=device)
    if isinstance(tensor, nn.Parameter):
        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, new)


def _pending(module: nn.Module) -> set[str]:
    return module.__dict__.get(PENDING_ATTR, set())


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


INNER_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")  # activation checkpointing, torch.compile
STAGE_PREFIX = re.compile(r"^stage_modules\.\d+\.model$")  # a pipeline stage's copy of the user's model


def user_module_name(name: str) -> str:
    """A module's name in the user's model, without the parts atorch's wrappers add (torch.compile,
    activation checkpointing, DDP in front, a pipeline stage in front)."""
    parts = [part for part in name.split(".") if part and part not in INNER_WRAPPER_PARTS]
    if len(parts) >= 3 and STAGE_PREFIX.match(".".join(parts[:3])):
        parts = parts[3:]
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _module_seed(seed: int, name: str) -> int:
    """Each module draws from its own seed, made of the agreed seed and its name in the user's
    model: its values do not depend on which other modules this process holds (a pipeline stage
    holds some), so every strategy initialises the model identically."""
    return (seed * 1_000_003 + zlib.crc32(user_module_name(name).encode())) % (2**62)


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def agreed_seed() -> int:
    """Process 0's initial seed on every process (does not advance any generator): every process
    then draws the same full-size values, so replicated tensors agree and shards fit together."""
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            seed = seed.cuda()
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _init_module_full_size(name: str, module: nn.Module, init: Callable[[], Any], device: torch.device,
                           record: MaterializeRecord, done: set[int]) -> None:
    """Swap the module's own tensors for full-size NaN-filled ones, run its initialiser, check it set
    them, and keep this process's slice of each (``done``: tensors an earlier module initialised)."""
    own = [(attr, slot) for slot in ("_parameters", "_buffers")
           for attr, t in getattr(module, slot).items() if t is not None]
    live = {attr: getattr(module, slot)[attr] for attr, slot in own}
    fresh = {attr for attr in live if attr in _pending(module) and id(live[attr]) not in done}
    done.update(id(live[attr]) for attr in fresh)
    # the tensors that were real already (a buffer init_empty_weights left) lend the initialiser a copy
    full = {attr: _nan_tensor(tuple(t.shape), t.dtype, device) if attr in fresh else t.detach().clone()
            for attr, t in live.items()}
    record.largest_temporary_bytes = max(record.largest_temporary_bytes,
                                         sum(t.numel() * t.element_size() for t in full.values()))
    full = _init_in_place_of(module, own, live, full, init)
    for attr, slot in own:
        if attr in fresh:
            _check_not_nan(name, attr, full[attr])
            order = saved_order(module, attr)
            value = order.to_live(full[attr]) if order is not None else full[attr]
            _keep_local_part(module, slot, attr, live[attr], value, record)


def saved_order(module: nn.Module, attr: str) -> Any:
    """The order a method keeps ``module.<attr>`` in (tensor_parallel's fused q|k|v), or None. Values
    are drawn in the user's order and reordered, so they are the same whatever the split."""
    return getattr(module, SAVED_ORDERS_ATTR, {}).get(attr)


def _nan_tensor(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    return tensor


def _check_not_nan(module_name: str, attr: str, tensor: torch.Tensor) -> None:
    if (tensor.is_floating_point() or tensor.is_complex()) and torch.isnan(tensor).any():
        where = f"{module_name}.{attr}" if module_name else attr
        raise MetaModelError(
            f"{where!r} was built on the meta device and its module's initialiser left it (partly) unset: atorch "
            "will not train on uninitialised memory; make the module's initialiser (HF _init_weights, "
            "reset_parameters or the root's init_weights) set it, or build this part on a real device",
            module=module_name)


def _keep_local_part(module: nn.Module, slot: str, attr: str, live: torch.Tensor, full: torch.Tensor,
                     record: MaterializeRecord) -> None:
    if is_meta(live):  # allocation did not reach it: copying into it would silently do nothing
        raise MetaModelError(f"{attr!r} of {type(module).__name__} is initialised but was given no storage: it "
                             "is not registered under the model atorch materialises", module=type(module).__name__)
    if isinstance(live, DTensor):
        local = distribute_tensor(full, live.device_mesh, live.placements, src_data_rank=None).to_local()
        live.to_local().copy_(local)
        record.local_bytes += local.numel() * local.element_size()
    elif slot == "_buffers":
        getattr(module, slot)[attr] = full.to(live.dtype) if full.dtype != live.dtype else full
        record.local_bytes += full.numel() * full.element_size()
    else:
        live.data.copy_(full)
        record.local_bytes += full.numel() * full.element_size()


def _pending_tensors(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(module name, attribute, tensor)`` of every tensor that was on meta, each once."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        for attr in sorted(_pending(module)):
            tensor = module._parameters.get(attr)
            tensor = module._buffers.get(attr) if tensor is None else tensor
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                yield name, attr, tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _run_whole_model(model: nn.Module, init: Callable[[], Any], seed: int, record: MaterializeRecord) -> None:
    for _, _, tensor in _pending_tensors(model):
        local = _local(tensor)
        if local.is_floating_point():
            local.fill_(float("nan"))
        record.local_bytes += local.numel() * local.element_size()
    with _shard_seeded_dtensor_rng(seed):
        init()


def _check_filled(model: nn.Module, plan: InitPlan) -> int:
    """No tensor left on meta; after a whole-model initialiser, none left NaN (per-module
    initialisers were checked module by module). Returns how many tensors were materialised."""
    for name, tensor in _named_tensors(model):
        if is_meta(tensor):
            module = name.rpartition(".")[0]
            raise MetaModelError(f"{name!r} is still on the meta device after materialisation", module=module)
    for prefix, root, _ in plan.whole_model:
        for module, attr, _ in _pending_tensors(root):
            current = getattr(root.get_submodule(module), attr)  # the initialiser may have replaced it
            _check_not_nan(f"{prefix}.{module}".strip("."), attr, _local(current))
    return sum(1 for _ in _pending_tensors(model))


@contextlib.contextmanager
def _shard_seeded_dtensor_rng(seed: int) -> Iterator[None]:
    """DTensor has no RNG tracker on CPU, so a random op on a sharded tensor would draw the same
    values on every shard. Meanwhile, each random op on a DTensor draws from a seed made of ``seed``,
    the op's count and the shard's global offset: shards differ, replicas agree."""
    if dtensor_random._rng_tracker is not None:
        yield  # a real tracker (CUDA): DTensor's own offsets already do this
        return

    class ShardSeeded:
        distribute_region_enabled = True

        def __init__(self) -> None:
            self.calls = 0

        @contextlib.contextmanager
        def _distribute_region(self, spec: Any, generator: Any = None) -> Iterator[None]:
            self.calls += 1
            _, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
            shard_seed = hash((seed, self.calls, tuple(int(o) for o in offset))) % (2**62)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(shard_seed)
                yield

    dtensor_random._rng_tracker = ShardSeeded()
    try:
        yield
    finally:
        dtensor_random._rng_tracker = None


# --- a sample forward of a model still on meta ----------------------------------------------------
@contextlib.contextmanager
def sample_values(model: nn.Module) -> Iterator[None]:
    """While ``model`` runs a sample forward (the trace a pipeline split or a tensor plan is found
    from, the check of a tensor plan), each module's meta tensors hold real sample values for the
    length of its own call, then go back to meta: no more than one module's tensors beyond the
    activations are real at a time. The values depend only on the tensor's name, so the split model
    computes what the whole one does. No-op for a model without meta tensors. Forward only."""
    if not has_meta_tensors(model):
        yield
        return
    hooks = []
    meta: dict[int, tuple[str, nn.Module, str, torch.Tensor]] = {}  # by tensor: where it is first registered
    for name, module in model.named_modules(remove_duplicate=False):
        for attr in _own_meta_tensors(module):
            tensor = module._parameters.get(attr)
            tensor = module._buffers.get(attr) if tensor is None else tensor
            meta.setdefault(id(tensor), (name, module, attr, tensor))
    for name, module in model.named_modules():
        if _own_meta_tensors(module):
            swap = _SampleSwap(module, meta)
            # first among the module's pre-hooks: one that reads its tensors (tensor_parallel's per-head
            # parameters, handed to the module as local shards) must meet the sample values
            hooks.append(module.register_forward_pre_hook(swap.fill, prepend=True))
            hooks.append(module.register_forward_hook(swap.empty, always_call=True))
    try:
        with _SampleOperands(meta):
            yield
    finally:
        for hook in hooks:
            hook.remove()


AUTOGRAD_ATTRIBUTES = ("requires_grad", "is_leaf", "grad", "grad_fn", "_version")


def _reads_autograd_state(func: Callable) -> bool:
    """Whether ``func`` is the getter of a tensor attribute that belongs to the tensor object itself."""
    descriptor = getattr(func, "__self__", None)
    return getattr(func, "__name__", "") == "__get__" and getattr(descriptor, "__name__", "") in AUTOGRAD_ATTRIBUTES


class _SampleOperands(TorchFunctionMode):
    """A module may use a child's tensor without calling the child (nn.MultiheadAttention reads its
    ``out_proj.weight``): any torch op given a meta tensor of the model gets its sample value for
    that op alone."""

    def __init__(self, meta: dict[int, tuple[str, nn.Module, str, torch.Tensor]]):
        super().__init__()
        self.meta = meta

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if not _reads_autograd_state(func):  # requires_grad, grad, ...: the meta parameter's own
            args, kwargs = pytree.tree_map(self._sample, (args, kwargs or {}))
        return func(*args, **(kwargs or {}))

    def _sample(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or id(value) not in self.meta:
            return value
        name, module, attr, tensor = self.meta[id(value)]
        if not is_meta(tensor):
            return value
        sample = _sample_value(f"{name}.{attr}", tensor, saved_order(module, attr))
        _keep_identity(tensor, sample)
        return sample


class _SampleSwap:
    """Puts sample values into one module's meta tensors for its call, and takes them out after."""

    def __init__(self, module: nn.Module, meta: dict[int, tuple[str, nn.Module, str, torch.Tensor]]):
        self.module, self.meta = module, meta
        self.saved: list[tuple[str, str, torch.Tensor]] = []

    def fill(self, module: nn.Module, args: Any) -> None:
        if self.saved:  # re-entered (a module called inside itself): already filled
            return
        for slot in ("_parameters", "_buffers"):
            for attr, tensor in list(getattr(module, slot).items()):
                if not is_meta(tensor):
                    continue
                first, owner, owner_attr, _ = self.meta[id(tensor)]  # a tied weight: one name, one value
                value = _sample_value(f"{first}.{owner_attr}", tensor, saved_order(owner, owner_attr))
                if slot == "_parameters":
                    value = nn.Parameter(value, requires_grad=tensor.requires_grad)
                self.saved.append((slot, attr, tensor))
                getattr(module, slot)[attr] = value
                _keep_identity(tensor, value)

    def empty(self, module: nn.Module, args: Any, output: Any) -> None:
        for slot, attr, tensor in self.saved:
            getattr(module, slot)[attr] = tensor
        self.saved = []


def _keep_identity(meta: torch.Tensor, real: torch.Tensor) -> None:
    """Code that finds a parameter by identity (the dataflow recorder) still finds it."""
    owner_key = getattr(meta, "_atorch_sample_of", None)
    real._atorch_sample_of = owner_key if owner_key is not None else id(meta)


def _sample_value(name: str, like: torch.Tensor, order: Any = None) -> torch.Tensor:
    """Deterministic small values for ``name``, drawn in the user's element order (a DTensor gets its
    local part of the same values, a parameter kept in an order of its own gets them reordered). Drawn
    outside every torch function mode: a mode recording the forward (the dataflow recorder keeps every op
    output it sees) would otherwise keep each full-size draw alive, the whole model's worth by the end."""
    with _outside_function_modes():
        return _draw_sample_value(name, like, order)


@contextlib.contextmanager
def _outside_function_modes() -> Iterator[None]:
    """Run without the active ``TorchFunctionMode``s (they are put back afterwards, in order)."""
    popped = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def _draw_sample_value(name: str, like: torch.Tensor, order: Any = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(user_module_name(name).encode()))
    shape = tuple(like.shape)
    # sized as a trained layer's (a matrix ~ 1 / sqrt(its width), a vector ~ 1): values too small would
    # make attention uniform and hide a wrong split of the heads from the tensor plan's check
    full = torch.randn(shape, generator=generator) / math.sqrt(shape[-1]) if len(shape) >= 2 else \
        1 + 0.5 * torch.randn(shape, generator=generator)
    if not like.is_floating_point():
        full = torch.zeros(tuple(like.shape))
    full = full.to(like.dtype)
    if order is not None:
        full = order.to_live(full)
    if isinstance(like, DTensor):
        # a copy: the shard of a tensor split on its first dimension is a view that keeps all of ``full``
        local = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local().clone()
        return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                                  run_check=False)
    return full

"""fsdp: ZeRO-3 on FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded.

The seed's configuration is FSDP1's keyword set plus atorch's own keys. Under FSDP2 they map as
follows (the README repeats this table):

- ``atorch_wrap_cls``: module types / class names / qualified-name globs, each match gets its own
  ``fully_shard`` (its parameters are gathered just for its forward and backward); the root is
  always sharded last. A match holding a parameter tied to a module outside it (T5's stacks and their
  shared embedding) is sharded by its parts instead, the tied parameter with the root
  (``units_keeping_ties``): FSDP2 cannot split a tie between units. A match the model never calls (an
  ``nn.Sequential`` it iterates, a holder of layers without a forward) is sharded by its parts
  (``units_called``): a unit must be called.
- ``atorch_size_based_min_num_params``: instead of classes, shard every submodule whose not yet
  sharded parameters reach this count (children first).
- ``atorch_ignored_cls``: their parameters are not sharded; they stay replicated and their
  gradients are averaged over the data-parallel group by a hook, so they still train correctly.
- ``wrap_trainable_outmost``: submodules that hold trainable parameters are not sharded on their
  own, so every trainable parameter lands in the outermost (root) group (LoRA-style fine-tuning).
- ``sync_module_states``: parameters and buffers are broadcast from the first data-parallel rank
  before sharding.
- ``forward_prefetch``: each wrapped block prefetches the next block's all-gather in forward.
- ``limit_all_gathers``, ``use_orig_params``, ``backward_prefetch``: accepted; FSDP2 always keeps
  the original parameters (parameter groups work), frees all-gather memory eagerly and prefetches
  in backward, so these are no-ops.
- ``cpu_offload``: parameters, gradients and optimizer state live on CPU (``CPUOffloadPolicy``);
  the optimizer step runs there. On a CPU-only machine everything is already there.
- ``sharding_strategy``: "FULL_SHARD" (default) or "SHARD_GRAD_OP" (zero2 semantics).
- ``reshard_after_forward``: FSDP2's own switch (True for ZeRO-3, False for ZeRO-2).

With ``amp_native`` the parameters are all-gathered in the amp dtype (``MixedPrecisionPolicy``,
gradients reduced in fp32) instead of being cast a second time by autocast; with ``half`` the model
is already in low precision and is sharded as it is.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _NormBase

try:  # the custom-collective hooks of FSDP2 (torch >= 2.9); without them the defaults are kept
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin
except ImportError:  # pragma: no cover
    ReduceScatter = DefaultAllocMixin = None  # type: ignore[assignment,misc]

from atorch.auto.opt_lib.activation_checkpoint import matching_modules
from atorch.auto.opt_lib.base import SHARDED_STAGES, SHARDED_STAGES_WHY, Optimization
from atorch.auto.opt_lib.tp_check import Probe, probe_from_context
from atorch.distributed import mesh
from atorch.distributed.agreement import max_over_ranks
from atorch.errors import MethodConfigError
from atorch.utils.config import MethodConfig, ModuleTargets, option, validate_config
from atorch.utils.meta_init import has_meta_tensors
from atorch.utils.modules import auto_layers, resolve_auto_targets, without_forward

logger = logging.getLogger(__name__)

SHARDING_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}  # -> reshard_after_forward
ENUM_KEYS = ("sharding_strategy", "backward_prefetch")  # FSDP1 enums are accepted and kept by name
NO_OP = "accepted for FSDP1 configs; a no-op under FSDP2"


@dataclass(frozen=True)
class FSDPConfig(MethodConfig):
    atorch_wrap_cls: Optional[ModuleTargets] = option(
        None, doc="each matching submodule (class, class name or import path, or name glob) is sharded on its own; "
        "'auto' (and None without a size rule): the model's layers, found from its structure; (): the root alone")
    atorch_size_based_min_num_params: Optional[int] = option(
        None, doc="instead of classes: shard every submodule whose not yet sharded parameters reach this count",
        minimum=1)
    atorch_ignored_cls: Optional[ModuleTargets] = option(
        None, doc="not sharded: replicated, gradients averaged over the data-parallel group")
    wrap_trainable_outmost: bool = option(False, doc="submodules with trainable parameters stay in the root group")
    sync_module_states: bool = option(False, doc="broadcast parameters and buffers from the first data-parallel rank")
    forward_prefetch: bool = option(False, doc="each wrapped block prefetches the next block's all-gather in forward")
    cpu_offload: bool = option(False, doc="parameters, gradients and optimizer state live on CPU")
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP"] = option(
        "FULL_SHARD", doc="ZeRO-3 (FULL_SHARD) or ZeRO-2 semantics (SHARD_GRAD_OP); an FSDP1 enum is taken by name")
    reshard_after_forward: Optional[bool] = option(None, doc="FSDP2's own switch; None: from sharding_strategy")
    limit_all_gathers: Optional[bool] = option(None, doc=NO_OP)
    use_orig_params: Optional[bool] = option(None, doc=NO_OP)
    backward_prefetch: Optional[Literal["BACKWARD_PRE", "BACKWARD_POST"]] = option(None, doc=NO_OP)
    fsdp_wrap_params_outmost: Optional[bool] = option(None, doc=NO_OP)


def normalize_fsdp_config(method: str, config_class: type, config: Any) -> Any:
    """fsdp and zero2: FSDP1 enums by name, the shared validator, then the rule across keys."""
    if isinstance(config, Mapping):
        config = {k: getattr(v, "name", v) if k in ENUM_KEYS else v for k, v in config.items()}
    config = validate_config(method, config_class, {} if config is None else config)
    if config.atorch_wrap_cls is not None and config.atorch_size_based_min_num_params is not None:
        raise MethodConfigError(method, "use either atorch_wrap_cls or atorch_size_based_min_num_params, not both")
    return config


class FSDPOptimization(Optimization):
    name = "fsdp"
    distributed_only = True
    config_class = FSDPConfig
    stages = ("data_parallel", "optimizer")  # its data-parallel wrapper; the optimizer factory
    # the sample row (dataset ... model_input_format): whether a chosen Sequential is called (units_called)
    reads = {"data_parallel": ("model", "amp_dtype", "dataset", "dataloader_args", "user_prepare_input", "input_dtype",
                               "model_input_format", "loss_func"),
             "optimizer": ("optim_func", "optim_args")}
    writes = {"data_parallel": ("model", "sync_toggles", "args")}
    record_writes = ("data_parallel_wrapper", "optimizer_factory")
    excludes = {"sharding": "choose one sharding level", SHARDED_STAGES: SHARDED_STAGES_WHY}

    def normalize(self, config: Any) -> FSDPConfig:
        return normalize_fsdp_config(self.name, self.config_class, config)

    def transform(self, ctx, config: FSDPConfig) -> None:
        reshard = config.reshard_after_forward
        if reshard is None:
            reshard = SHARDING_STRATEGIES[config.sharding_strategy]
        config = with_units_resolved(ctx.model, config, self.name)
        ctx.set_data_parallel_wrapper(self.name, lambda ctx: shard_model(ctx, config, reshard_after_forward=reshard),
                                      shards_meta=True)
        use_foreach_optimizer(ctx)


def with_units_resolved(model: torch.nn.Module, config: FSDPConfig, method: str) -> FSDPConfig:
    """The config with its units named as the wrapper reads them, from the whole model (before a pipeline
    cuts it): ``"auto"`` in ``atorch_wrap_cls`` is the model's layers (``auto_layers``); neither key given,
    the layers too where the model has repeated ones (each gathered alone, as torchtitan and HF
    accelerate's transformer wrap policy shard them: the whole model is never gathered at once), else the
    root alone. ``atorch_wrap_cls=()`` asks for the root alone."""
    if config.atorch_wrap_cls is None and config.atorch_size_based_min_num_params is None:
        return dataclasses.replace(config, atorch_wrap_cls=auto_layers(model) or None)
    if config.atorch_wrap_cls:
        return dataclasses.replace(config, atorch_wrap_cls=resolve_auto_targets(model, config.atorch_wrap_cls, method))
    return config


def shard_model(ctx, config: FSDPConfig, reshard_after_forward: bool) -> None:
    """Apply fully_shard to the chosen submodules and the root over the data-parallel mesh."""
    dp_mesh = mesh.data_parallel_mesh()
    if dp_mesh is None or (dp_mesh.size() == 1 and not config.cpu_offload):
        logger.info("fsdp: data-parallel size is 1, nothing to shard")  # (offloading alone still applies)
        return
    model = ctx.model
    if config.sync_module_states and not has_meta_tensors(model):  # a meta model's values are agreed on
        _broadcast_module_states(model)
    ignored = _ignored_params(model, config) | _norms_with_running_stats(model, ctx.amp_dtype)
    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": _mixed_precision(ctx),
        "offload_policy": _offload_policy(config),
    }
    if ignored:
        kwargs["ignored_params"] = ignored
    blocks = _blocks_to_shard(model, config)
    blocks = units_called(model, blocks, lambda: probe_from_context(ctx))
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    _reduce_scatter_by_all_reduce(blocks + [model], dp_mesh)
    if config.forward_prefetch and len(blocks) > 1:
        for current, following in zip(blocks, blocks[1:]):
            current.set_modules_to_forward_prefetch([following])
    if ignored:
        _average_ignored_gradients(ctx, ignored)
    ctx.add_sync_toggle(functools.partial(_set_gradient_sync, model, reshard_after_forward))
    logger.info("fsdp: sharded %d block(s) + root over %s ranks (reshard_after_forward=%s)",
                len(blocks), dp_mesh.size(), reshard_after_forward)


class AllReduceScatter(*(b for b in (DefaultAllocMixin, ReduceScatter) if b is not None)):  # type: ignore[misc]
    """FSDP2's reduce-scatter done as an in-place all-reduce of its (full-size) input, keeping this
    rank's chunk. gloo's reduce-scatter is slower than its all-reduce of the same buffer (16 MiB on 2
    CPU ranks: 33 ms against 22 ms), so on gloo this is the faster collective; the input buffer is
    FSDP's own, so no memory is added. Every rank sums the same values."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()].view_as(output_tensor))
        return None


def _reduce_scatter_by_all_reduce(modules: list[torch.nn.Module], dp_mesh: Any) -> None:
    """On gloo (CPU ranks), use ``AllReduceScatter`` for every sharded module's gradient reduction."""
    if ReduceScatter is None or dp_mesh.device_type != "cpu" or dp_mesh.size() == 1:
        return
    for module in modules:
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(AllReduceScatter())


def use_foreach_optimizer(ctx) -> None:
    """Record that the optimizer over sharded (DTensor) parameters is built by
    ``_build_foreach_optimizer``, unless another method already builds it."""
    if ctx.optimizer_factory is None:
        ctx.optimizer_factory = _build_foreach_optimizer


def _build_foreach_optimizer(ctx, params: Any) -> torch.optim.Optimizer:
    """The user's optimizer, stepping with foreach over CPU DTensors (``_ForeachSteps``)."""
    params = list(params)
    args = ctx.optim_args_for(params)
    optimizer = ctx.optim_func(params, **args)
    if _takes_foreach(ctx.optim_func) and "foreach" not in args and not args.get("fused"):
        steps = _ForeachSteps()
        optimizer.register_step_pre_hook(steps.before)
        optimizer.register_step_post_hook(steps.after)
    return optimizer


class _ForeachSteps:
    """Step hooks: ``foreach=True`` for the step of each group whose parameters are all CPU DTensors
    and whose state holds no plain tensor, then back to the group's own value. On CPU torch defaults
    to the per-parameter loop, and over DTensors each of its ~12 elementwise ops per parameter pays
    DTensor's dispatch (zero2 on a 4-layer GPT: 52 ms of a 420 ms step); foreach dispatches once per
    op for the whole list, and its CPU kernels compute the same values bit for bit (on GPUs torch
    already picks foreach). Set only during the step, it never reaches a saved ``state_dict``, which
    another strategy's optimizer (plain and DTensor parameters mixed, where foreach fails) may load."""

    def __init__(self) -> None:
        self.changed: list[tuple[dict, Any]] = []

    def before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            if group.get("foreach") is None and _all_cpu_dtensors(optimizer, group["params"]):
                self.changed.append((group, group.get("foreach")))
                group["foreach"] = True

    def after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, value in self.changed:
            group["foreach"] = value
        self.changed.clear()


def _all_cpu_dtensors(optimizer: torch.optim.Optimizer, params: list) -> bool:
    """Every parameter a CPU DTensor, and no plain tensor in their state but scalars (AdamW's step)."""
    if not params or not all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params):
        return False
    return not any(isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0
                   for p in params for v in optimizer.state.get(p, {}).values())


def _takes_foreach(optim_func: Any) -> bool:
    """Only torch's own optimizers: for them ``foreach`` is known to change speed, never results."""
    if not getattr(optim_func, "__module__", "").startswith("torch.optim"):
        return False
    try:
        return "foreach" in inspect.signature(optim_func).parameters
    except (TypeError, ValueError):
        return False


def _set_gradient_sync(model, reshard_after_forward: bool, enabled: bool) -> None:
    """Inside an accumulation window gradients are not reduce-scattered; under zero2 semantics the
    parameters also stay gathered between micro-steps, so a window costs one all-gather."""
    model.set_requires_gradient_sync(enabled, recurse=True)
    if not reshard_after_forward:
        model.set_reshard_after_backward(enabled, recurse=True)


def _blocks_to_shard(model: torch.nn.Module, config: FSDPConfig) -> list[torch.nn.Module]:
    if config.atorch_wrap_cls:  # () asks for the root alone
        blocks = matching_modules(model, config.atorch_wrap_cls)
        if not blocks:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise MethodConfigError("fsdp", f"atorch_wrap_cls {config.atorch_wrap_cls!r} matches no submodule; "
                                            f"module types: {present}")
    elif config.atorch_size_based_min_num_params is not None:
        blocks = _size_based_blocks(model, config.atorch_size_based_min_num_params)
    else:
        blocks = []
    if config.wrap_trainable_outmost:
        blocks = [b for b in blocks if not any(p.requires_grad for p in b.parameters())]
    ignored_types = config.atorch_ignored_cls
    if ignored_types:
        ignored_modules = set(matching_modules(model, ignored_types))
        blocks = [b for b in blocks if b not in ignored_modules]
    return units_keeping_ties(model, blocks)


def units_called(model: torch.nn.Module, blocks: list[torch.nn.Module],
                 make_probe: Callable[[], Optional[Probe]]) -> list[torch.nn.Module]:
    """The blocks, with each one the model never calls replaced by its parts.

    FSDP2 gathers a unit's parameters in that unit's forward: a block the model iterates instead of
    calling would leave them sharded when its parts run, a crash inside the first step. A module without
    a ``forward`` of its own (a plain holder of layers) is never called. An ``nn.Sequential`` may be
    called or iterated (timm's ``checkpoint_seq``, ``for block in self.blocks``): a fact of the model's
    code, read from one forward of a sample row (in training mode, as the loop runs it; no gradients,
    the RNG forked, norms' running statistics restored), run only when a chosen block is a Sequential.
    Other modules are called where they are used."""
    sequentials = [m for b in blocks for m in _outer_sequentials(b)]
    if not sequentials:
        return _called_units(blocks, None)
    probe = make_probe()
    called = _modules_called(model, sequentials, probe) if probe is not None else None
    if max_over_ranks([1.0 if called is None else 0.0])[0]:  # every rank shards the same units
        logger.info("fsdp: the sample row did not run through the model on every rank; each chosen Sequential is "
                    "taken to be called")
        called = None
    return _called_units(blocks, called)


def _called_units(blocks: list[torch.nn.Module], called: Optional[set[int]]) -> list[torch.nn.Module]:
    units: list[torch.nn.Module] = []
    for block in blocks:
        parts = _called_parts(block, called)
        if parts != [block]:
            logger.info("fsdp: %s is not called by the model (it iterates its parts): sharding its %d part(s) "
                        "instead", type(block).__name__, len(parts))
        units.extend(p for p in parts if all(p is not u for u in units))
    return units


def _outer_sequentials(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The Sequentials a block's parts could be taken from: itself, and on down through Sequentials and
    modules without a forward (a Sequential inside a block that is called needs no probe)."""
    if not (isinstance(module, torch.nn.Sequential) or without_forward(module)):
        return []
    own = [module] if isinstance(module, torch.nn.Sequential) else []
    return own + [m for child in module.children() for m in _outer_sequentials(child)]


def _called_parts(module: torch.nn.Module, called: Optional[set[int]]) -> list[torch.nn.Module]:
    """``module`` when it is called (or when that is unknown: no probe), else its called parts."""
    iterated = without_forward(module) or (
        isinstance(module, torch.nn.Sequential) and called is not None and id(module) not in called)
    if not iterated:
        return [module] if any(True for _ in module.parameters()) else []
    return [part for child in module.children() for part in _called_parts(child, called)]


def _modules_called(model: torch.nn.Module, modules: list[torch.nn.Module], probe: Probe) -> Optional[set[int]]:
    """ids of ``modules`` whose forward runs in one training-mode forward of the probe; None when that
    forward fails on one row (a BatchNorm over a batch of one in training mode): the blocks stay as given."""
    called: set[int] = set()
    handles = [m.register_forward_pre_hook(lambda module, args: called.add(id(module))) for m in modules]
    saved = [(buffer, buffer.detach().clone()) for module in model.modules() if isinstance(module, _NormBase)
             for buffer in module.buffers(recurse=False)]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            probe.run(model)
    except Exception as error:  # the model's own failure on one row is not this method's to report
        logger.info("fsdp: the sample row failed (%s: %s)", type(error).__name__, error)
        return None
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
    return called


def units_keeping_ties(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The blocks to shard, with no tied parameter split between units: FSDP2 shards a parameter with the
    one unit that holds it, and refuses a parameter also held by a module outside that unit (T5's encoder
    and decoder stacks each hold the embedding they share with ``shared``; a GPT's embedding is its output
    layer's weight). Such a block is replaced by its parts (its children, through ``ModuleList`` /
    ``ModuleDict``, which are never called, and on down while a part still holds a tied parameter); its
    leaves (the tied embedding itself, a final norm) stay with the root, which holds every user."""
    holders = _parameter_holders(model)
    paths = _module_paths(model)
    units: list[torch.nn.Module] = []
    for block in blocks:
        parts = _parts_without_outside_ties(block, holders, paths)
        if parts != [block]:
            logger.info("fsdp: %s holds a parameter tied to a module outside it; sharding its %d part(s) apart "
                        "instead, the tied parameter with the root", type(block).__name__, len(parts))
        units.extend(p for p in parts if all(p is not u for u in units))
    return units


def _parameter_holders(model: torch.nn.Module) -> dict[int, set[str]]:
    """id(parameter) -> the paths of every module that registers it directly."""
    holders: dict[int, set[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), set()).add(path)
    return holders


def _module_paths(model: torch.nn.Module) -> dict[int, set[str]]:
    paths: dict[int, set[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), set()).add(path)
    return paths


def _parts_without_outside_ties(module: torch.nn.Module, holders: dict[int, set[str]],
                                paths: dict[int, set[str]], chosen: bool = True) -> list[torch.nn.Module]:
    """``module`` (``chosen``: a block the configuration named), or its parts; the leaves of a split block
    (its final norm, the tied embedding) stay with the root, as a block's unnamed remainder does."""
    children = list(module.children())
    if not any(True for _ in module.parameters()) or (not chosen and not children):
        return []
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    if not isinstance(module, containers) and not _tied_outside(module, holders, paths):
        return [module]
    parts: list[torch.nn.Module] = []
    for child in children:
        parts.extend(_parts_without_outside_ties(child, holders, paths, chosen=False))
    return parts


def _tied_outside(module: torch.nn.Module, holders: dict[int, set[str]], paths: dict[int, set[str]]) -> bool:
    """Whether a parameter of ``module`` is also registered by a module outside every place it sits."""
    prefixes = paths.get(id(module), set())

    def inside(path: str) -> bool:
        return any(path == p or path.startswith(p + ".") for p in prefixes)

    return any(not inside(holder) for param in module.parameters() for holder in holders.get(id(param), ()))


def _size_based_blocks(model: torch.nn.Module, min_num_params: int) -> list[torch.nn.Module]:
    """Children first: a module is sharded when its parameters not already sharded below reach the size."""
    chosen: list[torch.nn.Module] = []
    claimed: set[int] = set()

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        free = [p for p in module.parameters() if id(p) not in claimed]
        if sum(p.numel() for p in free) >= min_num_params:
            chosen.append(module)
            claimed.update(id(p) for p in free)

    visit(model)
    return chosen


def _ignored_params(model: torch.nn.Module, config: FSDPConfig) -> set[torch.nn.Parameter]:
    """Parameters left replicated: those of ``atorch_ignored_cls`` modules, and every 0-dim parameter
    (fully_shard cannot shard a scalar such as CLIP's ``logit_scale``; it costs nothing to replicate)."""
    scalars = {p for p in model.parameters() if p.dim() == 0}
    if scalars:
        names = [n for n, p in model.named_parameters() if p.dim() == 0]
        logger.info("fsdp: scalar parameter(s) %s stay replicated (fully_shard shards along a dimension)", names)
    targets = config.atorch_ignored_cls
    if not targets:
        return scalars
    modules = matching_modules(model, targets)
    if not modules:
        raise MethodConfigError("fsdp", f"atorch_ignored_cls {targets!r} matches no submodule")
    return scalars | {p for module in modules for p in module.parameters()}


def _norms_with_running_stats(model: torch.nn.Module, amp_dtype: Optional[torch.dtype]) -> set[torch.nn.Parameter]:
    """Under mixed precision, the parameters of normalisation layers that keep fp32 running statistics
    (BatchNorm and its kind): fully_shard would cast their weight and bias to the compute dtype beside
    fp32 running_mean / running_var, which batch_norm refuses ("expected scalar type Half but found
    Float"); left replicated in fp32 they take the half-precision input as autocast would give it. Their
    parameters are a few per channel."""
    if amp_dtype is None:
        return set()
    norms = [(name, module) for name, module in model.named_modules()
             if isinstance(module, _NormBase) and module.running_mean is not None]
    params = {p for _, module in norms for p in module.parameters(recurse=False)}
    if params:
        logger.info("fsdp: %d normalisation layer(s) with running statistics stay replicated in fp32 under "
                    "mixed precision (e.g. %s)", len(norms), norms[0][0])
    return params


def _mixed_precision(ctx) -> MixedPrecisionPolicy:
    if ctx.amp_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=ctx.amp_dtype, reduce_dtype=torch.float32)


def _offload_policy(config: FSDPConfig) -> OffloadPolicy:
    if not config.cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


@torch.no_grad()
def _broadcast_module_states(model: torch.nn.Module) -> None:
    group = mesh.parallel_group("data_parallel")
    source = dist.get_global_rank(group, 0)
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=source, group=group)


def _average_ignored_gradients(ctx, ignored: set[torch.nn.Parameter]) -> None:
    """Ignored parameters are replicated: average their gradients like DDP would (unless a
    micro-step of gradient accumulation turned communication off)."""
    group = mesh.parallel_group("data_parallel")
    size = dist.get_world_size(group)
    state = {"sync": True}
    ctx.add_sync_toggle(lambda on: state.__setitem__("sync", on))

    def average(param: torch.nn.Parameter) -> None:
        if state["sync"] and param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(size)

    for param in ignored:  # hooks fire in backward order, the same on every rank
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)

"""DeepSpeed ZeRO as a backend of zero1 / zero2 (``{"use_ds_zero": True}``); optional.

DeepSpeed owns both the model (its engine) and the optimizer, so this backend claims the
data-parallel slot (no DDP) and builds the engine where the optimizer is built. What the user's loop
gets back is the engine as the model and an optimizer whose ``backward`` / ``step`` /
``set_gradient_accumulation_boundary`` drive the engine; ``result.args.use_optim_backward`` says so.
Clipping is DeepSpeed's own (inside ``step``, by the global norm of the partitioned gradients); the
loop's ``clip_grad_norm_`` sets its threshold and returns that norm.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from atorch.auto.optimizer import AtorchOptimizer
from atorch.checkpoint.adapters import register_optimizer_adapter
from atorch.distributed import mesh
from atorch.distributed.fault import register_rebuild_callback
from atorch.errors import CheckpointError, LoopError, MethodConfigError, RequirementError

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def deepspeed_unavailable_reason() -> Optional[str]:
    """None when DeepSpeed imports and has an accelerator for this machine; else why not."""
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed  # noqa: F401
        from deepspeed.accelerator import get_accelerator

        get_accelerator().device_name()
    except Exception as error:  # ImportError, or an accelerator that cannot start here
        return (f"DeepSpeed is not usable here ({type(error).__name__}: {error}); "
                "install it with pip install 'atorch[deepspeed]'")
    return None


def without_shared_memory_allreduce() -> None:
    """Keep DeepSpeed from building and starting its CPU shared-memory all-reduce extension
    (``deepspeed_shm_comm``, compiled with its own OpenMP runtime and started for every process of the
    group when DeepSpeed makes its communication backend). Only DeepSpeed's inference all-reduce uses it;
    its training collectives, and so atorch's engines, go through torch.distributed. One native runtime
    less in the training process: a CI run aborted with heap corruption at a thread's shutdown in a
    process where it had started (cause not proven). Call before DeepSpeed makes its backend."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def forget_deepspeed_groups() -> None:
    """After atorch rebuilt the process group (a failed dry run, see ``atorch.distributed.fault``),
    DeepSpeed's cached groups belong to the aborted one: drop them so its next engine makes new ones."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.endswith("_GROUP"):
            setattr(groups, name, {} if isinstance(value, dict) else None)
    forget_deepspeed_grid()


def forget_deepspeed_grid() -> None:
    """DeepSpeed keeps the model-parallel unit (``mpu``) of the last engine given one in a module global
    (``deepspeed.utils.groups.mpu``), which an engine built without one then reads: after a ds_3d_parallel
    engine in the same process, a ZeRO engine took the pipeline's model-parallel size and failed
    (``'NoneType' object has no attribute 'get_model_parallel_rank'``). atorch's ZeRO engines run over the
    data dimension alone; a pipeline engine passes its own grid."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and getattr(groups, "mpu", None) is not None:
        groups.mpu = None


register_rebuild_callback(forget_deepspeed_groups)


def use_deepspeed_zero(ctx, method: str, stage: int) -> None:
    """Record the DeepSpeed engine build for ZeRO ``stage`` on the context."""
    reason = deepspeed_unavailable_reason()
    if reason:
        raise RequirementError(f"{method} with use_ds_zero: {reason}")
    if ctx.optim_func is None:
        raise MethodConfigError(method, "use_ds_zero needs optim_func: DeepSpeed wraps the optimizer")
    ctx.set_data_parallel_wrapper(method, lambda ctx: None)  # the engine is the data-parallel wrapper
    ctx.optimizer_factory = lambda ctx, params: _build_engine(ctx, params, method, stage)
    ctx.args.use_optim_backward = True
    ctx.args.requires_set_gradient_accumulation_boundary = True


def _build_engine(ctx, params: Any, method: str, stage: int) -> "DeepSpeedOptimizer":
    import deepspeed

    without_shared_memory_allreduce()
    dp_size = mesh.data_parallel_size()
    if dist.is_initialized() and dp_size != dist.get_world_size():
        raise MethodConfigError(method, f"use_ds_zero supports pure data parallelism "
                                        f"(data size {dp_size} != world size {dist.get_world_size()})")
    if ctx.amp_dtype == torch.float16:
        raise MethodConfigError(method, "use_ds_zero with amp_native fp16 is not supported "
                                        "(DeepSpeed keeps its own loss scale); use bf16")
    scalars = [name for name, p in ctx.model.named_parameters() if p.dim() == 0]
    if scalars:
        raise MethodConfigError(method, f"use_ds_zero: DeepSpeed ZeRO flattens parameters into byte buffers and cannot "
                                f"take 0-dim ones {scalars} (e.g. CLIP's logit_scale); use atorch's own {method} "
                                "(without use_ds_zero), which keeps scalars replicated")
    bucket = int(min(5e8, max(1e6, sum(p.numel() for p in ctx.model.parameters()))))
    config = {
        "train_micro_batch_size_per_gpu": ctx.per_rank_batch_size,
        "gradient_accumulation_steps": 1,  # the loop marks boundaries itself
        # DeepSpeed's default buckets hold 5e8 elements (2 GB in fp32) whatever the model size
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "zero_allow_untested_optimizer": True,  # any torch optimizer: ZeRO shards its state generically
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
    }
    optimizer = ctx.optim_func(params, **ctx.optim_args)
    forget_deepspeed_grid()
    engine, _, _, _ = deepspeed.initialize(model=ctx.model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    read_the_model_config(engine, ctx.model)
    ctx.model = engine
    logger.info("%s: DeepSpeed ZeRO-%d engine over %d ranks", method, stage, dp_size)
    return DeepSpeedOptimizer(engine, optimizer)


def read_the_model_config(engine: Any, model: nn.Module) -> None:
    """``engine.config`` as the user's model's ``config`` (the same object), where the model has one.

    DeepSpeed's engine reads the model's attributes through, but not those it has itself, and it keeps its
    own config dict as ``config``: an HF script's ``model.config.use_cache = False`` or
    ``model.config.vocab_size`` met that dict ("'dict' object has no attribute"). DeepSpeed reads its settings
    from ``engine._config``; its dict stays as ``engine.ds_config``, and its own ``save_checkpoint``, which
    records the dict, sees it while it saves."""
    model_config = getattr(model, "config", None)
    if model_config is None:
        return
    engine.ds_config = engine.config
    engine.config = model_config
    save_checkpoint = engine.save_checkpoint

    @functools.wraps(save_checkpoint)
    def save_with_the_ds_config(*args: Any, **kwargs: Any) -> Any:
        engine.config = engine.ds_config
        try:
            return save_checkpoint(*args, **kwargs)
        finally:
            engine.config = model_config

    engine.save_checkpoint = save_with_the_ds_config


class DeepSpeedOptimizer(AtorchOptimizer):
    """The seed loop's optimizer calls, mapped onto a DeepSpeed engine."""

    def __init__(self, engine: Any, torch_optimizer: torch.optim.Optimizer):
        super().__init__(torch_optimizer)
        self.engine = engine
        self.reduced_since_step = False  # a backward at a boundary ran: its reduction holds the gradients
        self._watch_backward_passes()

    def _watch_backward_passes(self) -> None:
        """A loop that calls ``loss.backward()`` itself (written for DDP) reaches the engine's reduction
        without ``backward`` here: a hook on the parameter whose gradient comes first (the last one, in
        the usual order) sees each backward pass, and refuses a second boundary one before the rest of
        its gradients are reduced."""
        trainable = [p for p in self.engine.module.parameters() if p.requires_grad]
        if not trainable:
            return
        this = weakref.ref(self)

        def seen(param: torch.Tensor) -> None:
            optimizer = this()
            if optimizer is not None:
                optimizer._refuse_a_second_reduction()
                optimizer.reduced_since_step |= optimizer.is_gradient_accumulation_boundary

        trainable[-1].register_post_accumulate_grad_hook(seen)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._refuse_a_second_reduction()
        self.engine.backward(loss, **kwargs)

    def _refuse_a_second_reduction(self) -> None:
        """ZeRO reduces the gradients into its partitions at a boundary backward and the next one replaces
        them: a loop that accumulates over backward calls without marking the boundaries (a DDP loop)
        trained on its last micro-step's gradients only, silently. Raised before this backward runs."""
        if self.reduced_since_step and self.is_gradient_accumulation_boundary:
            raise LoopError(
                "use_ds_zero: a second backward before optim.step() at a gradient-accumulation boundary: "
                "DeepSpeed's ZeRO reduces the gradients at each boundary backward and the next one replaces "
                "them, so the earlier micro-step's gradients would be lost. Accumulating over several backward "
                "calls needs result.optim.set_gradient_accumulation_boundary(False) before every micro-step but "
                "the last and True before the last (result.args.requires_set_gradient_accumulation_boundary), "
                "or `with result.model.no_sync():` around every micro-step but the last")

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise NotImplementedError("DeepSpeed's step takes no closure")
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        self.is_gradient_accumulation_boundary = True
        self.reduced_since_step = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()
        self.reduced_since_step = False

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.is_gradient_accumulation_boundary = bool(is_boundary)
        self.engine.set_gradient_accumulation_boundary(bool(is_boundary))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
        """DeepSpeed clips inside ``step`` by the global norm of its partitioned gradients: this sets the
        threshold for the coming step and returns that norm, as ``torch.nn.utils.clip_grad_norm_`` returns
        the norm it clips by. DeepSpeed's own ``get_global_grad_norm`` is the previous step's (NaN before
        the first): a loop logging it, or skipping a step whose norm is not finite, read a step late. The
        norm is computed here from the partitions the boundary backward reduced (all data ranks take
        part, as they all clip), the way ``step`` computes it; before any backward since the last step
        there are none, and the previous step's stands (None before the first)."""
        if float(norm_type) != 2.0:
            raise MethodConfigError("use_ds_zero", f"DeepSpeed clips by the 2-norm only, got norm_type={norm_type}")
        self.engine.optimizer.clip_grad = float(max_norm)
        if self.reduced_since_step:
            return self._reduced_gradients_norm()
        norm = self.engine.get_global_grad_norm()
        return None if norm is None or self.engine.global_steps == 0 else torch.as_tensor(norm)

    def _reduced_gradients_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients ZeRO-1/2 reduced into this rank's partitions (DeepSpeed's
        ``scaled_global_norm``, over the loss scale: 1 in fp32 and bf16): infinity where one is not
        finite, as DeepSpeed's step reads it."""
        zero = self.engine.optimizer
        norm = torch.as_tensor(zero.scaled_global_norm(), dtype=torch.float32)
        return norm / float(getattr(zero, "loss_scale", 1.0) or 1.0)

    def part_clip_refusal(self) -> Optional[Exception]:
        """DeepSpeed reduces the gradients into its own partitioned buffers and clips them all inside
        ``step``: the parameters' ``.grad`` stays empty, so a part could only be left unclipped."""
        return MethodConfigError(
            "use_ds_zero", "DeepSpeed ZeRO keeps the gradients in its own buffers and clips them all, by their global "
            "norm, inside step(); clip_grad_norm_ over a part of the parameters cannot clip that part apart from the "
            "rest. Clip the whole model (torch.nn.utils.clip_grad_norm_(model.parameters(), c) or "
            "result.optim.clip_grad_norm_(c)), or use zero1 / zero2 without use_ds_zero")

    def sharded_state_reason(self) -> Optional[str]:
        """DeepSpeed's state_dict is this process's flat partition only, keyed by DeepSpeed's buffers."""
        return ("DeepSpeed ZeRO (use_ds_zero) holds each process's partition of the optimizer state in flat "
                "buffers; a dict of one process's would be partial")

    def state_dict(self) -> dict:
        self._refuse_sharded("state_dict()")
        return {}

    def load_state_dict(self, state: dict) -> None:
        self._refuse_sharded("load_state_dict()")


# --- checkpoints: per-parameter state out of (and into) ZeRO-1/2's flat partitions --------------------
class ZeroPartitions:
    """Per-parameter access to a DeepSpeed ZeRO stage 1/2 optimizer (``DeepSpeedZeroOptimizer``),
    for checkpoints in atorch's layout (the user's parameters, not DeepSpeed's flat buffers).

    Each rank holds one flat fp32 partition per param group (the master weights) and the torch
    optimizer's state of that partition; a parameter's ``_hp_mapping`` says which range of it lies
    in this rank's partition (a parameter can span two ranks). The model's own parameters hold the
    full weights on every rank (atorch's DeepSpeed config keeps them fp32, so they equal the master
    weights)."""

    def __init__(self, zero: Any):
        missing = [a for a in ("bit16_groups", "single_partition_of_fp32_groups", "real_dp_process_group", "optimizer")
                   if not hasattr(zero, a)]
        if missing:
            raise CheckpointError(f"use_ds_zero: the DeepSpeed optimizer {type(zero).__name__} has no {missing}: "
                                  "checkpoints support ZeRO stages 1 and 2 (DeepSpeedZeroOptimizer)", key="use_ds_zero")
        self.zero = zero
        self.groups: list[dict] = zero.optimizer.param_groups  # hyperparameters; params are the flat partitions
        self.group_params: list[list[torch.Tensor]] = [list(g) for g in zero.bit16_groups]

    def held_params(self) -> list[torch.Tensor]:
        """The parameters with a fragment in this rank's partition (whose state it loads)."""
        return [p for _, params, _ in self._partitions() for p in params if getattr(p, "_hp_mapping", None) is not None]

    def owned_state(self) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        """(parameter, state key, full state tensor) for the parameters this rank writes (collective).

        Parameters are dealt round-robin to the ranks of their group; each one's state is summed
        from the ranks' fragments onto its owner (one ``reduce`` per parameter and key), so no rank
        holds more than its share of the full state. Scalars (Adam's ``step``: one per partition,
        equal on every rank) are written under each parameter, as torch optimizers keep them."""
        rank, out, index = dist.get_rank(), [], 0
        for flat, params, group in self._partitions():
            state = self.zero.optimizer.state.get(flat, {})
            size = dist.get_world_size(group)
            for param in params:
                owner = dist.get_global_rank(group, index % size)
                index += 1
                for key in sorted(state):
                    full = self._full(param, state[key], flat, group, owner)
                    if rank == owner:
                        out.append((param, key, full))
        return out

    def load_state(self, loaded: dict[int, dict[str, torch.Tensor]]) -> None:
        """Copy each parameter's loaded full state (``{id(param): {key: tensor}}``) into this rank's
        fragment of the flat partition state, creating that state when no step ran yet; then let
        DeepSpeed re-link its per-parameter views of it."""
        for flat, params, _ in self._partitions():
            state = self.zero.optimizer.state[flat]
            for param in params:
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is None:
                    continue  # no part of it in this rank's partition
                for key, value in loaded.get(id(param), {}).items():
                    if value.dim() and value.shape == param.shape:
                        if key not in state or state[key].shape != flat.shape:
                            state[key] = torch.zeros_like(flat, dtype=value.dtype)
                        self._fragment(state[key], mapping).copy_(self._lp_fragment(value, mapping))
                    else:
                        state[key] = value.detach().clone()
        self.zero._hp_optimizer_states_linked = False
        self.zero._lazy_init_hp_params_optimizer_state()

    def sync_master_weights(self) -> None:
        """After the model's parameters were loaded in place, copy them into the fp32 master
        partition: ZeRO's step updates the master copy and overwrites the parameters from it."""
        with torch.no_grad():
            for _, params, _ in self._partitions():
                for param in params:
                    mapping = getattr(param, "_hp_mapping", None)
                    if mapping is not None:
                        mapping.hp_fragment.copy_(self._lp_fragment(param.detach(), mapping))

    def _partitions(self) -> list[tuple[torch.Tensor, list[torch.Tensor], Any]]:
        return list(zip(self.zero.single_partition_of_fp32_groups, self.group_params, self.zero.real_dp_process_group))

    def _full(self, param: torch.Tensor, value: torch.Tensor, flat: torch.Tensor, group: Any,
              owner: int) -> torch.Tensor:
        if not (value.dim() and value.shape == flat.shape):
            return value.detach().clone()
        buffer = torch.zeros(param.numel(), dtype=value.dtype, device=value.device)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            address = mapping.lp_fragment_address
            buffer.narrow(0, address.start, address.numel).copy_(self._fragment(value, mapping))
        dist.reduce(buffer, dst=owner, group=group)
        return buffer.view(param.shape)

    @staticmethod
    def _fragment(flat_state: torch.Tensor, mapping: Any) -> torch.Tensor:
        address = mapping.hp_fragment_address
        return flat_state.narrow(0, address.start, address.numel)

    @staticmethod
    def _lp_fragment(full: torch.Tensor, mapping: Any) -> torch.Tensor:
        address = mapping.lp_fragment_address
        return full.reshape(-1).narrow(0, address.start, address.numel)


# checkpoints read and write the state in DeepSpeed's flat partitions through ZeroPartitions
register_optimizer_adapter(DeepSpeedOptimizer, partitions=lambda optim: ZeroPartitions(optim.engine.optimizer))

"""Training checkpoints under every strategy: ``save_checkpoint``, ``load_checkpoint``, ``export_model``.

One canonical layout whatever the strategy, so a checkpoint saved under one strategy (or number of
processes) loads under another. A checkpoint is a directory:

- ``.metadata`` and ``*.distcp``: ``torch.distributed.checkpoint`` (DCP) files, tensors only. Every
  rank writes its own shards; DTensors (fsdp, zero2, tensor_parallel) stay DTensors, so DCP
  reshards them on load. Keys: ``model/<name>`` for each parameter and persistent buffer under
  the user's own name (no ``module.`` / ``_orig_mod.`` / ``_checkpoint_wrapped_module.``
  prefixes; pipeline stages contribute their own names; tied weights once), and
  ``optim/<name>/<key>`` for each tensor of a parameter's optimizer state. Under zero1 each rank
  contributes the state of the parameters it owns (ZeroRedundancyOptimizer's partition): nothing
  is consolidated. Under DeepSpeed ZeRO-1/2 (use_ds_zero) each parameter's state is reduced from
  the ranks' flat-partition fragments onto one owner, which writes it (``ZeroPartitions``). A
  parameter tensor_parallel keeps permuted (GPT-2's fused q|k|v) is stored in the user's layout
  (``PermutedLayout``), gathered whole. ds_3d_parallel is refused (CheckpointError).
- ``atorch_checkpoint.json`` (written by process 0, last): the step, ``extra``, the strategy, the
  world size, the model keys, the optimizer's ``param_groups`` (hyperparameters and parameter
  names), the grad scaler, the lr scheduler and the dataloader position. Its presence marks the
  directory complete.
- ``rng/rank-<r>.json``: each process's RNG states (python, numpy, torch CPU and CUDA) and the RNG
  state its dataloader's current epoch started from.

Nothing loaded can import or run code: metadata is JSON, tensors are read with
``torch.load(weights_only=True)``, and DCP's pickled ``.metadata`` is read by an unpickler that
only builds DCP's own metadata classes. A save goes to ``<path>.tmp-<id>`` and is renamed into
place only when complete, so a crash mid-save leaves the previous checkpoint loadable. An
asynchronous save (``async_save=True``) copies the tensors to host memory, then a thread writes and
renames them the same way, its collectives on a gloo group of their own.
"""
from __future__ import annotations

import importlib
import io
import json
import logging
import math
import os
import pickle
import random
import shutil
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from atorch.auto.opt_lib.amp import AmpOptimizer
from atorch.auto.opt_lib.deepspeed_zero import DeepSpeedOptimizer, ZeroPartitions
from atorch.auto.opt_lib.ds_3d_parallel import EngineStepOptimizer
from atorch.auto.opt_lib.tensor_parallel import SAVED_LAYOUTS_ATTR, PermutedLayout
from atorch.auto.optimizer import AtorchOptimizer
from atorch.auto.strategy import Strategy
from atorch.distributed.agreement import all_ranks_true, is_main_rank, is_multi_rank
from atorch.distributed.timeouts import normal_timeout
from atorch.errors import AtorchError, CheckpointError, StrategyError
from atorch.utils.data import ResumableDataLoader, decode_rng, encode_rng
from atorch.utils.modules import full_state_dict, unwrap_model

try:  # optional: export_model's format when installed
    import safetensors.torch as safetensors_torch
except ImportError:  # pragma: no cover
    safetensors_torch = None

if TYPE_CHECKING:  # the result type lives in the entry point's layer
    from atorch.auto.accelerate import AutoAccelerateResult

logger = logging.getLogger("atorch")

FORMAT, VERSION = "atorch-checkpoint", 1
META_FILE = "atorch_checkpoint.json"
RNG_DIR = "rng"
INNER_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.")  # anywhere: torch.compile, checkpoint_wrapper


# --- the model's tensors under canonical names -----------------------------------------------------
def _model_roots(model: nn.Module) -> list[nn.Module]:
    """The user's module(s) inside the wrappers: one per pipeline stage this rank holds, else one."""
    stages = getattr(model, "stage_modules", None)
    if stages is not None:
        return [stage.model for stage in stages]
    engine_module = getattr(model, "module", None)
    return [unwrap_model(engine_module if isinstance(engine_module, nn.Module) else model)]


def canonical_name(name: str) -> str:
    """A state_dict key without the wrappers' parts: ``_orig_mod.`` / ``_checkpoint_wrapped_module.``
    anywhere (blocks can be wrapped), ``module.`` (DDP, DeepSpeed) only in front, since a user's
    own submodule may be called ``module``."""
    for part in INNER_WRAPPER_PARTS:
        name = name.replace(part, "")
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's live parameters and persistent buffers by canonical name (DTensors as they are;
    a weight tied under several names once, under its first). A parameter kept in a permuted
    layout (``saved_layouts``: tensor_parallel's fused q|k|v) is returned live too; save and load
    convert it. CheckpointError for any other parameter whose ``state_dict`` value is not the live
    tensor (an unknown state_dict hook rewrites it): loading it in place would be wrong."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for root in _model_roots(model):
        live = dict(root.named_parameters(remove_duplicate=False))
        live.update(root.named_buffers(remove_duplicate=False))
        permuted = _layouts_of(root)
        for name, value in root.state_dict(keep_vars=True).items():
            key = canonical_name(name)
            if key in out or id(value) in seen:
                continue  # a tied weight, or a replicated buffer of a second pipeline stage
            if name in live and value is not live[name]:
                if name not in permuted:
                    raise CheckpointError(
                        f"save_checkpoint/load_checkpoint: {key!r} is stored in another layout than the live "
                        "parameter (a state_dict hook rewrites it) and atorch does not know that layout; export the "
                        "weights with atorch.export_model", key=key)
                value = live[name]
            seen.add(id(value))
            out[key] = value
    return out


def _layouts_of(root: nn.Module) -> dict[str, PermutedLayout]:
    """``{state_dict name: layout}`` of the parameters a module keeps permuted (``SAVED_LAYOUTS_ATTR``)."""
    out = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for attr, layout in getattr(module, SAVED_LAYOUTS_ATTR, {}).items():
            out[f"{prefix}.{attr}" if prefix else attr] = layout
    return out


def saved_layouts(model: nn.Module) -> dict[str, PermutedLayout]:
    """``{canonical name: layout}`` of the parameters stored in the user's layout, not the live one."""
    return {canonical_name(n): layout for root in _model_roots(model) for n, layout in _layouts_of(root).items()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def in_saved_layout(tensors: dict[str, torch.Tensor], model: dict[str, torch.Tensor],
                    layouts: dict[str, PermutedLayout]) -> dict[str, torch.Tensor]:
    """``tensors`` (``model/<name>`` and ``optim/<name>/<key>``) with each permuted parameter and
    its parameter-shaped state in the user's layout, so any strategy can load them. Such a tensor is
    gathered whole (collective: call it on every rank in the same order) and saved replicated: the
    permutation mixes every rank's columns, so no rank's shard is a block of the saved tensor."""
    if not layouts:
        return tensors
    out = dict(tensors)
    for key in sorted(tensors):
        name = _param_of_key(key)
        if name in layouts and tensors[key].shape == model[name].shape and tensors[key].dim():
            out[key] = layouts[name].to_saved(_full(tensors[key]).detach())
    return out


def _param_of_key(key: str) -> str:
    """The parameter name of ``model/<name>`` or ``optim/<name>/<state key>``."""
    if key.startswith("model/"):
        return key[len("model/"):]
    return key[len("optim/"):].rsplit("/", 1)[0]


def to_live_layout(saved: torch.Tensor, like: torch.Tensor, layout: PermutedLayout) -> torch.Tensor:
    """A full tensor in the user's layout, permuted and cut as ``like`` (this rank's DTensor shard)."""
    live = layout.to_live(saved)
    if not isinstance(like, DTensor):
        return live
    shape, offset = compute_local_shape_and_global_offset(live.shape, like.device_mesh, like.placements)
    local = live[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(like.device)
    return DTensor.from_local(local.contiguous(), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


# --- the optimizer's parts -------------------------------------------------------------------------
class OptimizerView:
    """What a checkpoint needs of ``result.optim`` under any strategy: the full ``param_groups``
    (every parameter of this rank's model, for hyperparameters), the optimizer that holds this rank's
    state (a ZeroRedundancyOptimizer's local optimizer holds only the owned partition), and the grad
    scaler."""

    def __init__(self, optim: Any):
        outer = optim
        self.scaler = None
        self.deepspeed: Optional[ZeroPartitions] = None  # use_ds_zero: the state is in DeepSpeed's flat partitions
        while isinstance(outer, AtorchOptimizer):
            if isinstance(outer, AmpOptimizer) and outer.scaler is not None:
                self.scaler = outer.scaler
            if isinstance(outer, EngineStepOptimizer):
                raise CheckpointError("save_checkpoint/load_checkpoint: ds_3d_parallel is not supported: DeepSpeed's "
                                      "pipeline engine names layers by stage index and keeps its own optimizer state; "
                                      "use pipeline_parallel / mixed_parallel, or DeepSpeed's own "
                                      "engine.save_checkpoint", key="ds_3d_parallel")
            if isinstance(outer, DeepSpeedOptimizer):
                self.deepspeed = ZeroPartitions(outer.engine.optimizer)
            outer = outer.optimizer
        self.torch_optimizer = outer
        self.full_groups: list[dict] = outer.param_groups
        self.group_params: list[list[torch.Tensor]] = [g["params"] for g in outer.param_groups]
        if self.deepspeed is not None:  # DeepSpeed's groups hold its flat partitions: the model's params instead
            self.group_params = self.deepspeed.group_params
            self.local: Optional[torch.optim.Optimizer] = None
        elif isinstance(outer, ZeroRedundancyOptimizer):
            self.local = outer.optim
        elif hasattr(outer, "owner") and hasattr(outer, "inner"):  # zero1 over DTensors (ShardedStateOptimizer)
            self.local = outer.inner
        else:
            self.local = outer


def _param_names(tensors: dict[str, torch.Tensor]) -> dict[int, str]:
    return {id(t): name for name, t in tensors.items() if isinstance(t, nn.Parameter)}


def _name_of(param: torch.Tensor, names: dict[int, str]) -> str:
    name = names.get(id(param))
    if name is None:
        raise CheckpointError(f"an optimizer parameter of shape {tuple(param.shape)} is not a parameter of the model "
                              "(optim_param_func gave parameters outside result.model?)")
    return name


def optimizer_state_tensors(view: OptimizerView, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """``optim/<name>/<key>`` for every tensor of the state this rank's optimizer holds (under
    use_ds_zero: the full state of the parameters this rank owns, gathered from the partitions;
    collective)."""
    out: dict[str, torch.Tensor] = {}
    if view.deepspeed is not None:
        return {f"optim/{_name_of(p, names)}/{key}": value for p, key, value in view.deepspeed.owned_state()}
    if view.local is None:
        return out
    for param, state in view.local.state.items():
        name = _name_of(param, names)
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {name!r}/{key!r} is a {type(value).__name__}, not a tensor: "
                                      "only tensor state can be checkpointed", key=f"{name}/{key}")
            out[f"optim/{name}/{key}"] = value
    return out


def _group_record(group: dict, params: list[torch.Tensor], names: dict[int, str]) -> dict:
    record = {"params": [_name_of(p, names) for p in params]}
    for key, value in group.items():
        if key != "params":
            record[key] = _json_value(value, f"param_groups[{key!r}]")
    return record


def _json_value(value: Any, where: str) -> Any:
    """A JSON-able copy (tuples → lists, scalar tensors → numbers); CheckpointError naming ``where``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _json_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    raise CheckpointError(f"{where} holds a {type(value).__name__} ({value!r}), which a checkpoint cannot store as "
                          "JSON", key=where)


def _from_json_value(saved: Any, current: Any) -> Any:
    """A saved hyperparameter in the type the optimizer holds now (tuple, tensor, float)."""
    if isinstance(current, torch.Tensor):
        return torch.as_tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(saved, str) and saved in ("inf", "-inf", "nan"):
        return float(saved)
    return saved


# --- metadata --------------------------------------------------------------------------------------
def _local_metadata(result: Any, model: dict[str, torch.Tensor], optim: dict[str, torch.Tensor],
                    view: Optional[OptimizerView], names: dict[int, str]) -> dict:
    """This rank's part of the metadata (process 0 merges every rank's)."""
    return {
        "model": {k: _tensor_info(v) for k, v in model.items()},
        "optim": {k: _tensor_info(v) for k, v in optim.items()},
        "param_groups": ([_group_record(g, p, names) for g, p in zip(view.full_groups, view.group_params)]
                         if view is not None else None),
    }


def _tensor_info(tensor: torch.Tensor) -> list:
    return [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]


def _merge(parts: list[dict]) -> dict:
    """Every rank's keys; param_groups joined group by group (pipeline stages hold parts of each)."""
    model, optim, groups = {}, {}, None
    for part in parts:
        model.update(part["model"])
        optim.update(part["optim"])
        if part["param_groups"] is None:
            continue
        if groups is None:
            groups = [dict(g, params=list(g["params"])) for g in part["param_groups"]]
            continue
        for index, group in enumerate(part["param_groups"]):
            if index >= len(groups):
                groups.append(dict(group, params=list(group["params"])))
            else:
                groups[index]["params"] += [n for n in group["params"] if n not in groups[index]["params"]]
    return {"model": model, "optim": optim, "param_groups": groups}


def _gather(value: Any, group: Optional[dist.ProcessGroup] = None) -> list:
    if not is_multi_rank():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def _strategy_json(result: Any) -> Optional[str]:
    strategy = result.args.extras.get("strategy") if getattr(result, "args", None) is not None else None
    if strategy is None:
        return None
    try:
        return strategy.to_json()
    except (StrategyError, TypeError, ValueError) as error:
        logger.warning("save_checkpoint: the strategy is not JSON-serialisable (%s); it is not saved", error)
        return None


def _scheduler_state(scheduler: Any) -> Optional[dict]:
    if scheduler is None:
        return None
    return _json_value(scheduler.state_dict(), "lr_scheduler.state_dict()")


def _rng_state(dataloader: Any) -> dict:
    state = {"python": _json_value(random.getstate(), "random.getstate()"),
             "torch": encode_rng(torch.get_rng_state()),
             "cuda": [encode_rng(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
             "numpy": None, "dataloader": None}
    numpy = sys.modules.get("numpy")  # atorch does not depend on numpy: its RNG is saved when the job uses it
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if isinstance(dataloader, ResumableDataLoader) and dataloader.rng_at_iter is not None:
        state["dataloader"] = encode_rng(dataloader.rng_at_iter)
    return state


def _numpy_if_installed() -> Any:
    """numpy, for a checkpoint that saved its RNG (the resumed job may import it only later)."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def _set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(decode_rng(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([decode_rng(s) for s in state["cuda"]])
    numpy = _numpy_if_installed() if state.get("numpy") is not None else None
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))


# --- save --------------------------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike, result: "AutoAccelerateResult", step: Optional[int] = None,
                    extra: Optional[dict] = None, *, lr_scheduler: Any = None,
                    async_save: bool = False) -> Optional["PendingSave"]:
    """Save the training state of ``result`` to the directory ``path`` (collective: every process calls it).

    Saved: the model, the optimizer state, the grad scaler (amp fp16), ``result.lr_scheduler`` or the
    ``lr_scheduler`` given here, the strategy, ``step``, ``extra`` (a JSON-serialisable dict), every
    process's RNG states and the dataloader position. Each process writes its own shards. Written to
    ``<path>.tmp-<id>`` and renamed to ``path`` when complete: an earlier checkpoint at ``path`` stays
    loadable until then. Raises CheckpointError (on every process) when something cannot be saved.

    ``async_save=True`` returns as soon as the tensors are copied to host memory, with a
    ``PendingSave``: a background thread writes the files and renames them into place as a
    synchronous save does, so training goes on meanwhile. The next ``save_checkpoint`` /
    ``load_checkpoint``, ``wait_for_checkpoint()`` and the end of the process wait for it, and raise
    its CheckpointError.
    """
    wait_for_checkpoint()
    target = _check_path(path, "save_checkpoint")
    extra = _check_extra(extra)
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise CheckpointError(f"save_checkpoint: step must be an int or None, got {step!r}", key="step")
    scheduler = _scheduler(result, lr_scheduler, "save_checkpoint")

    def prepare() -> tuple:
        model = model_tensors(result.model)
        view = OptimizerView(result.optim) if result.optim is not None else None
        return model, _param_names(model), view

    model, names, view = _on_every_rank(prepare)
    optim = _on_every_rank(lambda: optimizer_state_tensors(view, names) if view is not None else {})
    local = _on_every_rank(lambda: _local_metadata(result, model, optim, view, names))
    tensors = {f"model/{k}": v for k, v in model.items()}
    tensors.update(optim)
    tensors = in_saved_layout(tensors, model, saved_layouts(result.model))  # collective where a layout applies
    merged = _merge(_gather(local))

    def describe() -> tuple[dict, dict]:
        meta = {
            "format": FORMAT, "version": VERSION, "step": step, "extra": extra, "strategy": _strategy_json(result),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1, "saved_at": time.time(),
            "optimizer_class": type(view.torch_optimizer).__name__ if view is not None else None,
            "scaler": _json_value(view.scaler.state_dict(), "grad scaler") if view and view.scaler is not None else None,
            "lr_scheduler": _scheduler_state(scheduler),
            "dataloader": _dataloader_position(result.dataloader), **merged,
        }
        return meta, _rng_state(result.dataloader)

    meta, rng = _on_every_rank(describe)  # local work: a failure here must not leave the others waiting below
    tmp = _agreed_tmp_dir(target)
    if async_save:
        staged = _on_every_rank(lambda: {k: _host_copy(v) for k, v in tensors.items()})  # training changes the live ones
        return _write_in_background(tmp, staged, meta, rng, target)
    _write(tmp, tensors, meta, rng, target)
    return None


def _check_path(path: Any, caller: str) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(f"{caller}: path must be a directory path (str or os.PathLike), got {path!r}", key="path")
    return os.path.abspath(os.fspath(path))


def _check_extra(extra: Any) -> Any:
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise CheckpointError(f"save_checkpoint: extra must be a dict of JSON-serialisable values, got "
                              f"{type(extra).__name__}", key="extra")
    try:
        return json.loads(json.dumps(extra, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"save_checkpoint: extra is not JSON-serialisable ({error}); keep numbers, strings, "
                              "lists and dicts there (pass a scheduler as lr_scheduler=)", key="extra") from error


def _scheduler(result: Any, given: Any, caller: str) -> Any:
    scheduler = given if given is not None else getattr(result, "lr_scheduler", None)
    if scheduler is not None and not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
        raise CheckpointError(f"{caller}: lr_scheduler must have state_dict() and load_state_dict(), got "
                              f"{type(scheduler).__name__}", key="lr_scheduler")
    return scheduler


def _dataloader_position(dataloader: Any) -> Optional[dict]:
    if not isinstance(dataloader, ResumableDataLoader):
        return None
    position = dataloader.position()
    position.pop("rng_at_iter")  # per process: in the rng files
    return position


def _agreed_tmp_dir(target: str) -> str:
    """``<path>.tmp-<id>`` with one id for every process (process 0's, broadcast)."""
    token = [uuid.uuid4().hex[:12]]
    if is_multi_rank():
        dist.broadcast_object_list(token, src=0)
    return f"{target}.tmp-{token[0]}"


def _write(tmp: str, tensors: dict, meta: dict, rng: dict, target: str,
           group: Optional[dist.ProcessGroup] = None) -> None:
    """DCP shards from every process, then the rng files, then (process 0) the metadata and the
    rename. Every phase ends with an agreement, so a failure on one process raises on all. Every
    collective runs on ``group`` (the default group when None)."""
    _agree(_attempt(lambda: os.makedirs(os.path.join(tmp, RNG_DIR), exist_ok=True)), "save_checkpoint: creating", tmp,
           group=group)
    try:
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True), process_group=group)
    except (Exception, CheckpointException) as error:  # DCP raises the same CheckpointException on every rank
        raise CheckpointError(f"save_checkpoint: writing the shards to {tmp!r} failed: {error}") from error
    rank = dist.get_rank() if dist.is_initialized() else 0
    _agree(_attempt(lambda: _write_json(os.path.join(tmp, RNG_DIR, f"rank-{rank}.json"), rng)), "writing rng to", tmp,
           group=group)
    error = None
    if is_main_rank():
        error = _attempt(lambda: (_write_json(os.path.join(tmp, META_FILE), meta), _replace_dir(tmp, target)))
    _agree(error, "save_checkpoint: writing the metadata and renaming into place", target, only_main=True, group=group)


# --- asynchronous saves -------------------------------------------------------------------------------
_background: dict[str, Any] = {"pending": None, "group": None, "world": None}


class PendingSave:
    """An asynchronous save that a background thread is writing. ``wait()`` returns once it is
    renamed into place on every process, and raises its CheckpointError when it failed."""

    def __init__(self, target: str, work: Callable[[], None]):
        self.target, self._work = target, work
        self.error: Optional[CheckpointError] = None
        self.thread = threading.Thread(target=self._run, name="atorch-checkpoint-writer")  # not a daemon: exit waits

    def _run(self) -> None:
        try:
            self._work()
        except CheckpointError as error:
            self.error = error
        except BaseException as error:  # the same typed error for anything else (DCP's is a BaseException)
            self.error = CheckpointError(f"save_checkpoint (asynchronous) to {self.target!r} failed: "
                                         f"{type(error).__name__}: {error}")
        if self.error is not None:
            logger.error("%s", self.error)

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> None:
        self.thread.join()
        if _background["pending"] is self:
            _background["pending"] = None
        if self.error is not None:
            raise self.error


def wait_for_checkpoint() -> None:
    """Block until the asynchronous save in flight (if any) is renamed into place; raise its
    CheckpointError. ``save_checkpoint`` and ``load_checkpoint`` call it first; call it yourself
    before destroying the process group."""
    pending = _background["pending"]
    if pending is not None:
        pending.wait()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory; a DTensor stays a DTensor (a copy of this rank's shard) so DCP saves
    its shard as it would the live one."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
                                  stride=tensor.stride())
    return tensor.detach().to("cpu", copy=True)


def _write_in_background(tmp: str, staged: dict, meta: dict, rng: dict, target: str) -> PendingSave:
    """Start ``_write`` on a thread, its collectives on a gloo group of their own: on the default
    group they would interleave with training's (gloo and nccl match collectives by order)."""
    group = _writer_group()
    pending = PendingSave(target, lambda: _write(tmp, staged, meta, rng, target, group))
    _background["pending"] = pending
    pending.thread.start()
    return pending


def _writer_group() -> Optional[dist.ProcessGroup]:
    """Every process in a gloo group for the background writer, made once per default group
    (collective, so the save calls it on every process in the same order), with the default
    group's timeout (a new group's would be 30 minutes)."""
    if not is_multi_rank():
        return None
    world = dist.group.WORLD
    if _background["world"] is not world:
        group = dist.new_group(backend="gloo", timeout=normal_timeout())
        _background["group"], _background["world"] = group, world
    return _background["group"]


def _on_every_rank(action: Any) -> Any:
    """Run ``action`` here; when it raises on any process, every process raises (the first failing
    process's CheckpointError), so none is left waiting in the next collective."""
    try:
        value, error = action(), None
    except Exception as failure:  # anything, so that no process is left waiting
        value, error = None, failure
    if is_multi_rank() and not all_ranks_true(error is None):
        messages = _gather(None if error is None else (str(error), getattr(error, "key", None)))
        rank, (message, key) = next((r, m) for r, m in enumerate(messages) if m is not None)
        if error is None:
            raise CheckpointError(f"{message} (on rank {rank})", key=key)
    if isinstance(error, AtorchError):
        raise error
    if error is not None:  # the same typed error the other processes raise
        raise CheckpointError(f"{type(error).__name__}: {error}") from error
    return value


def _attempt(action: Any) -> Optional[str]:
    try:
        action()
    except (OSError, CheckpointError, TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _agree(error: Optional[str], what: str, where: str, only_main: bool = False,
           group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise CheckpointError on every process when ``error`` is set on any (rank 0's text when
    ``only_main``)."""
    if is_multi_rank():
        if only_main:
            message = [error]
            dist.broadcast_object_list(message, src=0, group=group)
            error = message[0]
        elif not all_ranks_true(error is None, group):
            errors = _gather(error, group)
            error = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    if error is not None:
        raise CheckpointError(f"{what} {where!r} failed: {error}")


def _write_json(path: str, value: Any) -> None:
    data = json.dumps(value, indent=1, allow_nan=False).encode()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _replace_dir(tmp: str, target: str) -> None:
    """Put the complete ``tmp`` at ``target``; an old checkpoint there is moved aside first and
    removed last, by a thread (``load_checkpoint`` falls back to it if a crash falls between the two
    renames)."""
    old = None
    if os.path.lexists(target):
        if not os.path.isdir(target) or os.path.islink(target):
            raise CheckpointError(f"save_checkpoint: {target!r} exists and is not a checkpoint directory", key="path")
        if os.listdir(target) and not os.path.exists(os.path.join(target, META_FILE)):
            raise CheckpointError(f"save_checkpoint: {target!r} is a non-empty directory that is not an atorch "
                                  "checkpoint; refusing to replace it", key="path")
        old = f"{target}.old-{os.path.basename(tmp).rsplit('-', 1)[-1]}"
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(os.path.dirname(target))
    if old is not None:
        threading.Thread(target=_remove_replaced, args=(old,), name="atorch-checkpoint-cleanup").start()


def _remove_replaced(old: str) -> None:
    """Delete a replaced checkpoint (off the save's path: unlinking its shards takes as long as a
    tenth of the save): its metadata file first, so a removal cut short never passes for a complete
    checkpoint. Not a daemon thread: the process's exit waits for it."""
    try:
        os.remove(os.path.join(old, META_FILE))
    except OSError:
        pass
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- load --------------------------------------------------------------------------------------------
class _SafeMetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: build only DCP's own metadata classes, torch sizes, dtypes
    and paths from it; anything else (a crafted file importing code) is refused."""

    ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                       "torch.distributed.checkpoint.planner")

    def find_class(self, module: str, name: str) -> Any:
        if module in self.ALLOWED_MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")):
            return super().find_class(module, name)
        raise CheckpointError(f"the checkpoint's DCP .metadata refers to {module}.{name}, which a checkpoint never "
                              "holds: refusing to load it", key=f"{module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by ``_SafeMetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = os.path.join(os.fspath(self.path), ".metadata")
        with open(path, "rb") as handle:
            metadata = _SafeMetadataUnpickler(handle).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if metadata.planner_data is None:
            metadata.planner_data = {}
        return metadata


def load_checkpoint(path: str | os.PathLike, result: "AutoAccelerateResult", *, lr_scheduler: Any = None,
                    strict: bool = True) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` into ``result`` (collective), under any
    strategy and number of processes. Returns ``{"step", "extra", "strategy", "world_size"}``.

    The model's weights and the optimizer state are loaded in place (resharded as needed); the
    optimizer's hyperparameters, the grad scaler, the lr scheduler (``result.lr_scheduler`` or
    ``lr_scheduler``), the RNG states and the dataloader position are restored. Call it before
    iterating ``result.dataloader``: the next epoch iterator continues where the saved one stopped.
    ``strict=False`` leaves model keys missing from the checkpoint as they are (optimizer state of
    such parameters too). CheckpointError names the first key that does not fit.
    """
    wait_for_checkpoint()
    target = _check_path(path, "load_checkpoint")
    source, meta = _on_every_rank(lambda: (lambda found: (found, _read_meta(found)))(_resolve_checkpoint(target)))
    scheduler = _scheduler(result, lr_scheduler, "load_checkpoint")

    def prepare() -> tuple:
        model = model_tensors(result.model)
        _check_model_keys(model, meta, strict, source)
        names = _param_names(model)
        view = OptimizerView(result.optim) if result.optim is not None else None
        return model, names, view, _optimizer_destinations(view, names, meta) if view is not None else {}

    model, names, view, optim_targets = _on_every_rank(prepare)
    _check_unexpected_keys(model, meta, strict, source)
    layouts = saved_layouts(result.model)
    destinations = {f"model/{k}": v for k, v in model.items() if k in meta["model"]}
    destinations.update({key: tensor for key, (tensor, _, _) in optim_targets.items()})
    relayout = _saved_layout_destinations(destinations, model, layouts)
    destinations.update(relayout)
    try:
        with torch.no_grad():
            dcp.load(destinations, storage_reader=SafeFileSystemReader(source))
    except AtorchError:
        raise
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"load_checkpoint: reading the tensors of {source!r} failed: {error}") from error
    optim_targets = _into_live_layout(relayout, model, layouts, optim_targets)
    if view is not None and view.deepspeed is not None:
        view.deepspeed.sync_master_weights()
    # the rest is local: agreed, so that no process trains on while another has failed
    _on_every_rank(lambda: _restore_local_state(result, source, meta, view, names, optim_targets, scheduler))
    strategy = Strategy.from_json(meta["strategy"]) if meta.get("strategy") else None
    return {"step": meta.get("step"), "extra": meta.get("extra"), "strategy": strategy,
            "world_size": meta.get("world_size")}


def _restore_local_state(result: Any, source: str, meta: dict, view: Optional[OptimizerView],
                         names: dict[int, str], optim_targets: dict, scheduler: Any) -> None:
    """Optimizer state and hyperparameters, grad scaler, lr scheduler, RNG states and the dataloader
    position: what each process restores on its own once the tensors are read."""
    if view is not None:
        _load_optimizer(view, names, meta, optim_targets)
        if view.scaler is not None and meta.get("scaler"):
            view.scaler.load_state_dict(meta["scaler"])
    if scheduler is not None and meta.get("lr_scheduler") is not None:
        scheduler.load_state_dict(meta["lr_scheduler"])
    rng = _read_rng(source, meta)
    if rng is not None:
        _set_rng_state(rng)
    if isinstance(result.dataloader, ResumableDataLoader) and meta.get("dataloader"):
        position = dict(meta["dataloader"])
        position["rng_at_iter"] = decode_rng(rng["dataloader"]) if rng and rng.get("dataloader") else None
        result.dataloader.resume_from(position)


def _resolve_checkpoint(target: str) -> str:
    """``target``, or the previous checkpoint moved aside by a save that crashed between its renames."""
    if os.path.isdir(target):
        return target
    parent, base = os.path.split(target)
    aside = sorted((os.path.join(parent, n) for n in os.listdir(parent or ".") if n.startswith(base + ".old-")
                    and os.path.exists(os.path.join(parent, n, META_FILE))), key=os.path.getmtime)
    if aside:
        logger.warning("load_checkpoint: %s is missing; loading %s (a save was interrupted while renaming)", target,
                       aside[-1])
        return aside[-1]
    raise CheckpointError(f"load_checkpoint: no checkpoint at {target!r}", key="path")


def _read_meta(source: str) -> dict:
    path = os.path.join(source, META_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"load_checkpoint: {source!r} has no {META_FILE}: it is not an atorch checkpoint, or "
                              "its save did not complete", key=META_FILE)
    try:
        with open(path, "rb") as handle:
            meta = json.loads(handle.read())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"load_checkpoint: cannot read {path!r}: {error}", key=META_FILE) from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"load_checkpoint: {path!r} has format {meta.get('format')!r} version "
                              f"{meta.get('version')!r}; this atorch reads {FORMAT!r} version {VERSION}", key="format")
    return meta


def _check_model_keys(model: dict, meta: dict, strict: bool, source: str) -> None:
    missing = sorted(set(model) - set(meta["model"]))
    if missing and strict:
        raise CheckpointError(f"load_checkpoint: the model's {missing[:5]}{'...' if len(missing) > 5 else ''} "
                              f"({len(missing)} key(s)) are not in {source!r}; pass strict=False to leave them as they "
                              "are", key=missing[0])
    for key, tensor in model.items():
        if key in meta["model"] and list(tensor.shape) != meta["model"][key][0]:
            raise CheckpointError(f"load_checkpoint: {key!r} has shape {list(tensor.shape)} in the model but "
                                  f"{meta['model'][key][0]} in {source!r}", key=key)


def _check_unexpected_keys(model: dict, meta: dict, strict: bool, source: str) -> None:
    """Keys of the checkpoint that no process's model holds (pipeline stages each hold a part)."""
    present = set().union(*_gather(sorted(model)))
    unexpected = sorted(set(meta["model"]) - present)
    if unexpected and strict:
        raise CheckpointError(f"load_checkpoint: {source!r} holds {unexpected[:5]} ({len(unexpected)} key(s)) that the "
                              "model does not have; pass strict=False to ignore them", key=unexpected[0])


def _saved_layout_destinations(destinations: dict, model: dict, layouts: dict) -> dict:
    """Plain full tensors for DCP to read the permuted parameters (and their parameter-shaped
    state) into, in the user's layout; ``_into_live_layout`` converts them afterwards."""
    out = {}
    for key, tensor in destinations.items():
        name = _param_of_key(key)
        if name in layouts and tensor.shape == model[name].shape and tensor.dim():
            out[key] = torch.zeros(tensor.shape, dtype=tensor.dtype)
    return out


def _into_live_layout(loaded: dict, model: dict, layouts: dict, optim_targets: dict) -> dict:
    """Copy the permuted parameters read in the user's layout into the live ones (in place) and
    return ``optim_targets`` with their state in the live layout, laid out like the parameter."""
    targets = dict(optim_targets)
    for key in loaded:
        name = _param_of_key(key)
        live = to_live_layout(loaded[key], model[name], layouts[name])
        if key.startswith("model/"):
            with torch.no_grad():
                local = model[name].to_local() if isinstance(model[name], DTensor) else model[name]
                local.copy_(live.to_local() if isinstance(live, DTensor) else live)
        else:
            _, param, state_key = targets[key]
            targets[key] = (live, param, state_key)
    return targets


def _optimizer_destinations(view: OptimizerView, names: dict[int, str], meta: dict) -> dict:
    """``optim/<name>/<key>`` → (a tensor DCP fills, the parameter, the state key) for the state of
    every parameter this rank's optimizer holds (under zero1: the owned partition; under
    use_ds_zero: the parameters with a fragment in this rank's partition, read whole)."""
    out = {}
    if view.deepspeed is not None:
        params = view.deepspeed.held_params()
    elif view.local is not None:
        params = [p for group in view.local.param_groups for p in group["params"]]
    else:
        return out
    saved_keys: dict[str, list[str]] = {}  # parameter name -> its state keys, read once (not per parameter)
    for key in meta["optim"]:
        name, _, state_key = key[len("optim/"):].rpartition("/")
        saved_keys.setdefault(name, []).append(state_key)
    live = view.local.state if view.deepspeed is None and view.local is not None else {}
    for param in params:
        name = _name_of(param, names)
        for state_key in saved_keys.get(name, ()):
            key = f"optim/{name}/{state_key}"
            shape, dtype = meta["optim"][key]
            current = live.get(param, {}).get(state_key)
            out[key] = (_destination(param, shape, getattr(torch, dtype), current), param, state_key)
    return out


def _destination(param: torch.Tensor, shape: list, dtype: torch.dtype,
                 current: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Where DCP reads one state tensor: the optimizer's own state tensor when it has one of that shape,
    dtype and layout (read in place: no new memory to allocate and fault in; a trained run's load costs
    what a bare DCP load does); else shaped like the parameter → laid out like it (a DTensor for a
    DTensor parameter); anything else (Adam's step) → a plain CPU tensor, as torch keeps it. Left
    uninitialised: DCP writes every element of a key it loads, and fails on a key it lacks."""
    if _fits(current, param, shape, dtype):
        return current
    if list(param.shape) == shape and shape:
        return torch.empty_like(param, dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def _fits(current: Optional[torch.Tensor], param: torch.Tensor, shape: list, dtype: torch.dtype) -> bool:
    """Whether the state tensor ``current`` can receive the saved one in place."""
    if not isinstance(current, torch.Tensor) or list(current.shape) != shape or current.dtype != dtype:
        return False
    if not (isinstance(param, DTensor) and list(param.shape) == shape and shape):  # Adam's step: a plain tensor
        return not isinstance(current, DTensor)
    return (isinstance(current, DTensor) and current.placements == param.placements
            and current.device_mesh == param.device_mesh)


def _load_optimizer(view: OptimizerView, names: dict[int, str], meta: dict, targets: dict) -> None:
    """Hyperparameters into the full groups; the state into the optimizer that holds it, through
    its own load_state_dict (which casts and places each value as that optimizer does)."""
    saved_groups = meta.get("param_groups") or []
    group_of = {n: g for g in saved_groups for n in g["params"]}
    for group, params in zip(view.full_groups, view.group_params):
        _set_hyperparameters(group, params, names, group_of)
    if view.deepspeed is not None:
        loaded: dict[int, dict] = {}
        for tensor, param, key in targets.values():
            loaded.setdefault(id(param), {})[key] = tensor
        view.deepspeed.load_state(loaded)
        return
    if view.local is None:
        return
    state: dict[int, dict] = {}
    groups, index = [], 0
    by_param: dict[int, dict] = {}
    for _, (tensor, param, key) in targets.items():
        by_param.setdefault(id(param), {})[key] = tensor
    for group in view.local.param_groups:
        _set_hyperparameters(group, group["params"], names, group_of)
        indices = []
        for param in group["params"]:
            if id(param) in by_param:
                state[index] = by_param[id(param)]
            indices.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
    view.local.load_state_dict({"state": state, "param_groups": groups})


def _set_hyperparameters(group: dict, params: list[torch.Tensor], names: dict[int, str], group_of: dict) -> None:
    """The saved hyperparameters of the group that held ``params[0]`` into ``group``."""
    if not params:
        return
    saved = group_of.get(_name_of(params[0], names))
    if saved is None:
        return
    for key, value in saved.items():
        if key != "params":
            group[key] = _from_json_value(value, group.get(key))


def _read_rng(source: str, meta: dict) -> Optional[dict]:
    """This process's RNG file; at another world size, that of rank (this rank mod the saved size)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved_world = int(meta.get("world_size") or 1)
    path = os.path.join(source, RNG_DIR, f"rank-{rank % saved_world}.json")
    if not os.path.exists(path):
        logger.warning("load_checkpoint: %s is missing; RNG states are not restored", path)
        return None
    with open(path, "rb") as handle:
        return json.loads(handle.read())


# --- export ------------------------------------------------------------------------------------------
def export_model(result: "AutoAccelerateResult", path: str | os.PathLike) -> str:
    """Write the trained weights unsharded, under the user's parameter names, for one process to load
    into the unwrapped model (collective: every process calls it; process 0 writes).

    A Hugging Face model (``save_pretrained``) is written in its own layout (config + safetensors);
    any other model as ``<path>/model.safetensors`` when safetensors is installed, else
    ``<path>/model.pt`` (``torch.save`` of a dict of tensors, loadable with ``weights_only=True``).
    Tied weights appear under every name, as ``state_dict()`` has them. Returns the file or
    directory written.
    """
    target = _check_path(path, "export_model")
    weights = full_state_dict(result.model)  # gathers shards and pipeline stages on every process
    user_model = _model_roots(result.model)[0]
    written, error = None, None
    if is_main_rank():
        try:
            written = _write_export(target, weights, user_model)
        except (OSError, TypeError, ValueError, AtorchError) as failure:
            error = f"{type(failure).__name__}: {failure}"
    _agree(error, "export_model: writing", target, only_main=True)
    return written or target


def _write_export(target: str, weights: dict[str, torch.Tensor], user_model: nn.Module) -> str:
    os.makedirs(target, exist_ok=True)
    if hasattr(user_model, "save_pretrained") and hasattr(user_model, "config"):
        user_model.save_pretrained(target, state_dict=weights)
        return target
    if safetensors_torch is not None:
        file = os.path.join(target, "model.safetensors")
        safetensors_torch.save_file({k: v.contiguous() for k, v in weights.items()}, file)  # full_state_dict's copies share no memory
        return file
    file = os.path.join(target, "model.pt")
    torch.save(weights, file)
    return file


def load_exported(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict ``export_model`` wrote (safetensors or weights-only torch file)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("model.safetensors", "model.pt"):
            if os.path.exists(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
    if path.endswith(".safetensors"):
        if safetensors_torch is None:
            raise CheckpointError(f"{path!r} is a safetensors file: install safetensors to read it", key=path)
        return safetensors_torch.load_file(path)
    with open(path, "rb") as handle:
        return torch.load(io.BytesIO(handle.read()), weights_only=True)


"""The model as the user's script hands it over, before any strategy: scripts written for plain PyTorch
often wrap the model before anything else sees it (nanoGPT compiles it, then wraps it in DDP; a
torchrun script wraps it in DDP first). atorch's strategy decides the data parallelism and the
compilation itself, so such a wrapper is taken off (with a warning that says what to name instead),
and a model that is already sharded, whose parameters no longer hold the whole weights, is refused:
no method can be applied over a sharding it did not make."""
from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from atorch.errors import InputError


def unwrap_given_model(model: nn.Module) -> nn.Module:
    """The module inside the wrappers a script may have put around it (DDP, nn.DataParallel,
    torch.compile, in any order), each named in one warning; the model itself when it has none.
    Raises InputError for a model FSDP or a tensor plan already sharded."""
    taken_off = []
    while True:
        inner, note = _inside(model)
        if inner is None:
            break
        taken_off.append(note)
        model = inner
    if taken_off:
        wrappers = " of ".join(taken_off)
        warnings.warn(
            f"auto_accelerate: the model is {wrappers} of a {type(model).__name__}; the strategy is applied to the "
            f"{type(model).__name__} inside: " + "; ".join(_what_instead(taken_off)), UserWarning,
            stacklevel=user_frame_level())
    refuse_sharded_model(model)
    return model


def user_frame_level() -> int:
    """The ``stacklevel`` of the first frame outside atorch and torch (the script's call to auto_accelerate,
    or its ``model(**batch)`` through ``nn.Module.__call__``), so a warning names the user's line, however
    many calls lie between."""
    packages = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__)]
    frame, level = sys._getframe(1), 1
    while frame is not None and any(os.path.abspath(frame.f_code.co_filename).startswith(p + os.sep)
                                    for p in packages):
        frame, level = frame.f_back, level + 1
    return level


def _inside(model: nn.Module) -> tuple[nn.Module | None, str]:
    """The module one wrapper holds, and the wrapper's name; (None, "") for a model that is not one."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and isinstance(
            getattr(model, "_orig_mod", None), nn.Module):
        return model._orig_mod, "torch.compile's wrapper"
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module, "DistributedDataParallel"
    if isinstance(model, nn.DataParallel):
        return model.module, "nn.DataParallel"
    return None, ""


def _what_instead(taken_off: list[str]) -> list[str]:
    """Why each wrapper is not kept, and what gives the same in a strategy."""
    notes = []
    if any("compile" in name for name in taken_off):
        notes.append("the compilation is not kept (a method that restructures the model would invalidate it): "
                     "name 'native_dynamo' in load_strategy to compile after the strategy (each repeated block by "
                     "default), or leave it to the automatic search")
    if any("DataParallel" in name for name in taken_off):
        notes.append("data parallelism is the strategy's (parallel_mode, with zero1 / zero2 / fsdp or plain DDP), "
                     "and the given wrapper's gradient hooks no longer run since its forward is not called")
    return notes


def refuse_sharded_model(model: nn.Module) -> None:
    """A model FSDP (fully_shard or FullyShardedDataParallel) or parallelize_module already sharded holds
    on each rank a part of each weight: atorch's methods read whole weights (a tensor plan splits them,
    a dry run measures them), so applying any of them would train a wrong model or fail inside it."""
    for name, module in model.named_modules():
        wrapper = _sharding_wrapper(module)
        if wrapper:
            raise InputError(
                f"the model is already sharded: {name or 'the model'} ({type(module).__name__}) is {wrapper}. Give "
                "auto_accelerate the plain module (built as for one device, on the meta device if it is too "
                "large) and name the sharding in the strategy ('fsdp', 'zero1', 'zero2', 'tensor_parallel'): "
                "atorch applies it itself")
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise InputError(
                f"the model is already sharded: parameter {name} is a DTensor (placements {param.placements}), "
                "split by parallelize_module or fully_shard before auto_accelerate. Give auto_accelerate the "
                "plain module and name 'tensor_parallel' or 'fsdp' in the strategy: atorch applies it itself")


def _sharding_wrapper(module: nn.Module) -> str:
    if isinstance(module, FullyShardedDataParallel):
        return "FullyShardedDataParallel"
    if isinstance(module, FSDPModule):
        return "fully_shard's (FSDP2)"
    return ""


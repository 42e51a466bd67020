"""Everything a checkpoint holds besides the tensors: the metadata file and each process's RNG file.

``atorch_checkpoint.json`` (written by process 0, last): the step, ``extra``, the strategy, the world
size, the model's and the optimizer's keys with their shapes, the optimizer's ``param_groups``
(hyperparameters and parameter names), the grad scaler, the lr scheduler and the dataloader
position. ``rng/rank-<r>.json``: each process's RNG states (python, numpy, torch CPU and CUDA) and
the RNG state its dataloader's current epoch started from. Both are JSON: reading them runs no code.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import random
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from atorch.checkpoint.agreement import gather
from atorch.checkpoint.files import FORMAT, META_FILE, RNG_DIR, VERSION, json_value, read_json
from atorch.checkpoint.optimizer_state import OptimizerView, group_records
from atorch.checkpoint.tensors import describe
from atorch.errors import CheckpointError, StrategyError
from atorch.utils.data import ResumableDataLoader, decode_rng, encode_rng

logger = logging.getLogger("atorch")


# --- the arguments of a save -------------------------------------------------------------------------
def check_extra(extra: Any) -> Any:
    """``extra`` as JSON would give it back; CheckpointError when it is not JSON-serialisable."""
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


def check_step(step: Any) -> None:
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise CheckpointError(f"save_checkpoint: step must be an int or None, got {step!r}", key="step")


def scheduler_of(result: Any, given: Any, caller: str) -> Any:
    """The lr scheduler to save or load: ``given``, else ``result.lr_scheduler``."""
    scheduler = given if given is not None else getattr(result, "lr_scheduler", None)
    if scheduler is not None and not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
        raise CheckpointError(f"{caller}: lr_scheduler must have state_dict() and load_state_dict(), got "
                              f"{type(scheduler).__name__}", key="lr_scheduler")
    return scheduler


# --- the metadata ------------------------------------------------------------------------------------
def local_metadata(model: dict[str, torch.Tensor], optim: dict[str, torch.Tensor], view: Optional[OptimizerView],
                   names: dict[int, str]) -> dict:
    """This rank's part of the metadata (process 0 merges every rank's)."""
    return {
        "model": {k: describe(v) for k, v in model.items()},
        "optim": {k: describe(v) for k, v in optim.items()},
        "param_groups": group_records(view, names) if view is not None else None,
    }


def merge(parts: list[dict]) -> dict:
    """Every rank's keys; param_groups joined group by group (pipeline stages hold parts of each)."""
    model, optim, groups = {}, {}, None
    for part in parts:
        model.update(part["model"])
        optim.update(part["optim"])
        if part["param_groups"] is not None:
            groups = _merge_groups(groups, part["param_groups"])
    return {"model": model, "optim": optim, "param_groups": groups}


def _merge_groups(groups: Optional[list[dict]], part: list[dict]) -> list[dict]:
    if groups is None:
        return [dict(g, params=list(g["params"])) for g in part]
    for index, group in enumerate(part):
        if index >= len(groups):
            groups.append(dict(group, params=list(group["params"])))
        else:
            groups[index]["params"] += [n for n in group["params"] if n not in groups[index]["params"]]
    return groups


def metadata(result: Any, step: Optional[int], extra: Any, view: Optional[OptimizerView], scheduler: Any,
             merged: dict) -> dict:
    """The whole ``atorch_checkpoint.json``."""
    return {
        "format": FORMAT, "version": VERSION, "step": step, "extra": extra, "strategy": _strategy_json(result),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1, "saved_at": time.time(),
        "optimizer_class": type(view.torch_optimizer).__name__ if view is not None else None,
        "scaler": json_value(view.scaler.state_dict(), "grad scaler") if view and view.scaler is not None else None,
        "lr_scheduler": _scheduler_state(scheduler),
        "dataloader": _dataloader_position(result.dataloader), **merged,
    }


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
    return json_value(scheduler.state_dict(), "lr_scheduler.state_dict()")


def _dataloader_position(dataloader: Any) -> Optional[dict]:
    if not isinstance(dataloader, ResumableDataLoader):
        return None
    position = dataloader.position()
    position.pop("rng_at_iter")  # per process: in the rng files
    return position


def read_meta(source: str) -> dict:
    path = os.path.join(source, META_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"load_checkpoint: {source!r} has no {META_FILE}: it is not an atorch checkpoint, or "
                              "its save did not complete", key=META_FILE)
    try:
        meta = read_json(path)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"load_checkpoint: cannot read {path!r}: {error}", key=META_FILE) from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"load_checkpoint: {path!r} has format {meta.get('format')!r} version "
                              f"{meta.get('version')!r}; this atorch reads {FORMAT!r} version {VERSION}", key="format")
    return meta


def check_model_keys(model: dict, meta: dict, strict: bool, source: str) -> None:
    missing = sorted(set(model) - set(meta["model"]))
    if missing and strict:
        raise CheckpointError(f"load_checkpoint: the model's {missing[:5]}{'...' if len(missing) > 5 else ''} "
                              f"({len(missing)} key(s)) are not in {source!r}; pass strict=False to leave them as they "
                              "are", key=missing[0])
    for key, tensor in model.items():
        if key in meta["model"] and list(tensor.shape) != meta["model"][key][0]:
            raise CheckpointError(f"load_checkpoint: {key!r} has shape {list(tensor.shape)} in the model but "
                                  f"{meta['model'][key][0]} in {source!r}", key=key)


def check_unexpected_keys(model: dict, meta: dict, strict: bool, source: str) -> None:
    """Keys of the checkpoint that no process's model holds (pipeline stages each hold a part)."""
    present = set().union(*gather(sorted(model)))
    unexpected = sorted(set(meta["model"]) - present)
    if unexpected and strict:
        raise CheckpointError(f"load_checkpoint: {source!r} holds {unexpected[:5]} ({len(unexpected)} key(s)) that the "
                              "model does not have; pass strict=False to ignore them", key=unexpected[0])


# --- RNG states --------------------------------------------------------------------------------------
def rng_state(dataloader: Any) -> dict:
    """This process's RNG states, and the one its dataloader's current epoch started from."""
    state = {"python": json_value(random.getstate(), "random.getstate()"),
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


def set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(decode_rng(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([decode_rng(s) for s in state["cuda"]])
    numpy = _numpy_if_installed() if state.get("numpy") is not None else None
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def read_rng(source: str, meta: dict) -> Optional[dict]:
    """This process's RNG file; at another world size, that of rank (this rank mod the saved size)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved_world = int(meta.get("world_size") or 1)
    path = os.path.join(source, RNG_DIR, f"rank-{rank % saved_world}.json")
    if not os.path.exists(path):
        logger.warning("load_checkpoint: %s is missing; RNG states are not restored", path)
        return None
    return read_json(path)


def restore_dataloader(dataloader: Any, meta: dict, rng: Optional[dict]) -> None:
    """The saved dataloader position (and its epoch's RNG state) into a ResumableDataLoader."""
    if isinstance(dataloader, ResumableDataLoader) and meta.get("dataloader"):
        position = dict(meta["dataloader"])
        position["rng_at_iter"] = decode_rng(rng["dataloader"]) if rng and rng.get("dataloader") else None
        dataloader.resume_from(position)

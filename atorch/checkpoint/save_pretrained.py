"""A Hugging Face model's ``save_pretrained`` on what auto_accelerate returned, over several processes.

The end of most Hugging Face training scripts, ``model.save_pretrained(out, is_main_process=rank == 0)``
called on every process, did not survive the strategies: over fsdp, zero2 and tensor_parallel the
parameters are DTensor shards and transformers' own method hung in its writer (the processes never
agree on a collective); a pipeline stage and DDP have no such method (AttributeError). So over several
processes the returned model gets an instance attribute ``save_pretrained`` that writes through
``export_module``: the unsharded weights under the user's names, in ``save_pretrained``'s layout with
``config.json`` (collective, as Hugging Face asks for distributed saves; process 0 writes). One process
keeps transformers' own method, and so does the user's module inside DDP (``result.model.module``), whose
weights are whole on every process. A ``save_pretrained`` of another library (PEFT's ``PeftModel``, which
saves the adapters and their config) is called on process 0 with the trainable parameters gathered whole.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import os
import weakref
from typing import Any, Callable, Iterator, Optional, Union

import torch.distributed as dist
from torch import nn

from atorch.checkpoint.agreement import agree
from atorch.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, export_module, gather_trainable
from atorch.checkpoint.tensors import model_roots
from atorch.distributed.agreement import is_main_rank, is_multi_rank, next_store_key, world_size
from atorch.errors import CheckpointError

# keyword arguments of transformers' save_pretrained that the export honours by what it always does
_DEFAULT_LIKE = {"push_to_hub": False, "safe_serialization": True, "token": None, "variant": None}
# how long the first process to call waits for the others before saying that the call is collective: a
# script that saves from process 0 alone (``if rank == 0: model.save_pretrained(out)``) gets an error, not
# a wait of the collective timeout
ARRIVAL_TIMEOUT = datetime.timedelta(seconds=300)


def route_save_pretrained(model: nn.Module) -> None:
    """Over several processes, ``save_pretrained`` on ``model`` (what auto_accelerate returns) and on
    the user's module(s) inside it writes through ``export_module``; nothing changes in one process or
    for a model without the method."""
    if not is_multi_rank():
        return
    original = getattr(type(model_roots(model)[0]), "save_pretrained", None)
    if callable(original):  # an instance attribute, found before the class's method
        model.__dict__["save_pretrained"] = _RoutedSavePretrained(weakref.ref(model), original)


class _RoutedSavePretrained:
    """``save_pretrained`` of one accelerated model (held weakly). A pickled copy of the model (``torch.save``
    of the whole module) gets ``_RoutedElsewhere`` in its place: the export needs this run's processes."""

    def __init__(self, model_ref: weakref.ref, original: Callable):
        self.model_ref, self.original = model_ref, original
        functools.update_wrapper(self, _save_pretrained)

    def __call__(self, save_directory: Union[str, os.PathLike], *args: Any, **kwargs: Any) -> None:
        _save_pretrained(self.model_ref, self.original, save_directory, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return _RoutedElsewhere, ()


class _RoutedElsewhere:
    """``save_pretrained`` of an unpickled copy of an accelerated model: says what to call instead."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise CheckpointError("save_pretrained of this copy was routed to atorch's export in the processes that "
                              "trained the model; on a copy, call type(model).save_pretrained(model, ...)",
                              key="save_pretrained")


def _save_pretrained(model_ref: weakref.ref, original: Optional[Callable], save_directory: Union[str, os.PathLike],
                     is_main_process: bool = True, state_dict: Optional[dict] = None,
                     max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, **kwargs: Any) -> None:
    """``save_pretrained`` of the accelerated model: collective (every process calls it; process 0
    writes, whatever ``is_main_process`` says). A ``state_dict`` the caller gathered itself goes to
    transformers' own method, as given."""
    model = model_ref()
    if model is None:
        raise CheckpointError("save_pretrained: the accelerated model no longer exists", key="save_pretrained")
    if state_dict is not None and original is not None:
        original(model_roots(model)[0], save_directory, is_main_process=is_main_process, state_dict=state_dict,
                 max_shard_size=max_shard_size, **kwargs)
        return
    if original is not None and not _is_transformers(original) and _takes_state_dict(original):
        _save_adapters(model, original, save_directory, **kwargs)
        return
    others = sorted(k for k, v in kwargs.items() if k not in _DEFAULT_LIKE or v != _DEFAULT_LIKE[k])
    if others:
        raise CheckpointError(
            f"save_pretrained over several processes writes through atorch.export_model (unsharded weights, "
            f"config.json, safetensors shards of max_shard_size), which does not take {others}; call it with "
            "save_directory and max_shard_size on every process, or pass a state_dict you gathered "
            "(atorch.export_model, then transformers' tools on its directory)", key=others[0])
    _every_process_arrives()
    export_module(model, save_directory, max_shard_size=max_shard_size, caller="save_pretrained")


def _is_transformers(method: Callable) -> bool:
    return getattr(method, "__module__", "").split(".")[0] == "transformers"


def _takes_state_dict(method: Callable) -> bool:
    """Whether a library's ``save_pretrained`` can be handed the gathered weights (``state_dict=``, or
    ``**kwargs`` as PEFT's takes it); one that cannot keeps the export."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "state_dict" or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def _save_adapters(model: nn.Module, original: Callable, save_directory: Union[str, os.PathLike],
                   **kwargs: Any) -> None:
    """``save_pretrained`` of a library other than transformers (PEFT's ``PeftModel``: the adapters and
    their config, not the model around them): process 0 calls the library's own method with the
    trainable parameters gathered whole (``state_dict=``, which PEFT's method reads its adapters from),
    and its outcome reaches every process. Before, the whole model was exported in transformers' layout,
    which ``PeftModel.from_pretrained`` cannot read (no adapter_config.json)."""
    _every_process_arrives()
    gathered = gather_trainable(model)
    error = None
    if is_main_rank():
        try:
            root = model_roots(model)[0]
            with _whole_structure(root):
                original(root, save_directory, is_main_process=True, state_dict=gathered, **kwargs)
        except Exception as failure:  # the library's own error, on every process
            error = f"{type(failure).__name__}: {failure}"
    agree(error, "save_pretrained", str(save_directory), only_main=True)


@contextlib.contextmanager
def _whole_structure(root: nn.Module) -> Iterator[None]:
    """For the call's length, every module of a pipeline stage's model that another stage holds is put back
    as its meta-device copy (``atorch_stands_for``), so a library that reads the model's layers (PEFT picks
    its adapters' names from them) sees every layer, while the values come from the gathered state_dict."""
    swapped = []
    for name, module in list(root.named_modules(remove_duplicate=False)):
        if name and callable(getattr(type(module), "atorch_stands_for", None)):
            parent, _, child = name.rpartition(".")
            owner = root.get_submodule(parent) if parent else root
            swapped.append((owner, child, module))
    for owner, child, module in swapped:
        setattr(owner, child, module.atorch_stands_for())
    try:
        yield
    finally:
        for owner, child, module in reversed(swapped):
            setattr(owner, child, module)


def _every_process_arrives() -> None:
    """Wait, through the rendezvous store rather than a collective, until every process has called;
    CheckpointError naming the missing ones after ``ARRIVAL_TIMEOUT``."""
    timeout = ARRIVAL_TIMEOUT
    store = dist.distributed_c10d._get_default_store()
    key = next_store_key("atorch/save_pretrained")
    store.set(f"{key}/{dist.get_rank()}", "1")
    keys = [f"{key}/{rank}" for rank in range(world_size())]
    try:
        store.wait(keys, timeout)
    except Exception as error:  # the store's own timeout error type differs between torch versions
        missing = [rank for rank, k in enumerate(keys) if not store.check([k])]
        raise CheckpointError(
            f"save_pretrained is collective over the {world_size()} processes (each writes its part; process 0 "
            f"writes the files, is_main_process=rank == 0 only says so): processes {missing} did not call it "
            f"within {timeout.total_seconds():.0f} s. Call it on every process", key="save_pretrained") from error

"""``export_model``: the trained weights unsharded, under the user's names, for one process to load.

Unlike a checkpoint (sharded, for resuming under any strategy), an export is the plain weights of
the unwrapped model: a Hugging Face model in its own layout (config + safetensors), any other as
``model.safetensors`` (or ``model.pt``, loadable with ``weights_only=True``). ``load_exported``
reads it back.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from atorch.checkpoint.agreement import agree
from atorch.checkpoint.files import check_path
from atorch.checkpoint.safe_load import load_weights_only
from atorch.checkpoint.tensors import model_roots
from atorch.distributed.agreement import is_main_rank
from atorch.errors import AtorchError, CheckpointError
from atorch.utils.modules import full_state_dict

try:  # optional: export_model's format when installed
    import safetensors.torch as safetensors_torch
except ImportError:  # pragma: no cover
    safetensors_torch = None

if TYPE_CHECKING:  # the result type lives in the entry point's layer
    from atorch.auto.accelerate import AutoAccelerateResult


def export_model(result: "AutoAccelerateResult", path: str | os.PathLike) -> str:
    """Write the trained weights unsharded, under the user's parameter names, for one process to load
    into the unwrapped model (collective: every process calls it; process 0 writes).

    A Hugging Face model (``save_pretrained``) is written in its own layout (config + safetensors);
    any other model as ``<path>/model.safetensors`` when safetensors is installed, else
    ``<path>/model.pt`` (``torch.save`` of a dict of tensors, loadable with ``weights_only=True``).
    Tied weights appear under every name, as ``state_dict()`` has them. Returns the file or
    directory written.
    """
    target = check_path(path, "export_model")
    weights = full_state_dict(result.model)  # gathers shards and pipeline stages on every process
    user_model = model_roots(result.model)[0]
    written, error = None, None
    if is_main_rank():
        try:
            written = _write_export(target, weights, user_model)
        except (OSError, TypeError, ValueError, AtorchError) as failure:
            error = f"{type(failure).__name__}: {failure}"
    agree(error, "export_model: writing", target, only_main=True)
    return written or target


def _write_export(target: str, weights: dict[str, torch.Tensor], user_model: nn.Module) -> str:
    os.makedirs(target, exist_ok=True)
    if hasattr(user_model, "save_pretrained") and hasattr(user_model, "config"):
        user_model.save_pretrained(target, state_dict=weights)
        return target
    if safetensors_torch is not None:
        file = os.path.join(target, "model.safetensors")
        # full_state_dict's copies share no memory, as safetensors requires
        safetensors_torch.save_file({k: v.contiguous() for k, v in weights.items()}, file)
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
    return load_weights_only(path)

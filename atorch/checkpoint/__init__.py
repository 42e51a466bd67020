"""Training checkpoints under every strategy, one file per job.

One canonical form whatever the strategy, so a checkpoint saved under one strategy (or number of
processes) loads under another (docs/checkpoints.md). The public names are ``atorch.save_checkpoint``,
``atorch.load_checkpoint``, ``atorch.wait_for_checkpoint``, ``atorch.export_model`` and
``atorch.load_pretrained``.

- ``api.py``: ``save_checkpoint`` / ``load_checkpoint``, the order of a save and of a load;
- ``tensors.py``: the model's tensors under canonical names, element orders of a method's own;
- ``optimizer_state.py``: the optimizer's state and hyperparameters by parameter name;
- ``adapters.py``: how a method declares what its optimizer holds (``register_optimizer_adapter``);
- ``train_state.py``: the metadata file and the RNG files;
- ``async_save.py``: the background writer and ``wait_for_checkpoint``;
- ``export.py``: ``export_model`` / ``load_exported``;
- ``pretrained.py``: ``load_pretrained``, Hugging Face safetensors weights into a model under any strategy;
- ``files.py``: atomic files and directories (also used by strategy files);
- ``agreement.py``: every process raises, or none does (also used by ``save_strategy_to_file``);
- ``safe_load.py``: unpicklers that run no code, weights-only loads (also used by strategy files).

This ``__init__`` imports nothing up front, so that ``atorch/auto/strategy.py`` can use the helpers
below the checkpoint code without loading it; ``from atorch.checkpoint import save_checkpoint``
still works: the public names load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {"save_checkpoint": "api", "load_checkpoint": "api", "wait_for_checkpoint": "async_save",
           "export_model": "export", "load_exported": "export", "last_export_record": "export",
           "load_pretrained": "pretrained", "LoadResult": "pretrained"}
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'atorch.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"atorch.checkpoint.{_PUBLIC[name]}"), name)

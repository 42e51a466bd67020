"""The user's model's values, read through the module a method returns in its place.

A script reads values on the model it trains: HF's ``model.config`` (``config.use_cache = False``,
``config.vocab_size``), ``batch.to(model.device)``, ``model.dtype``. Where a method returns a module of its
own instead of the user's (a pipeline's stages, micro_batch's micro-steps), those raised a bare
"'PipelineModule' object has no attribute 'device'". ``read_through`` returns the few values scripts read
(``READ_THROUGH``) from the user's model inside, the same objects (a setting reaches the model), and for
anything else of the user's model an AttributeError that says why it is not there and what to use.
Everything else stays as ``nn.Module`` has it: atorch's own code probes these modules with ``getattr``.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

READ_THROUGH = ("config", "generation_config", "device", "dtype", "name_or_path", "main_input_name")


def read_through(wrapper: nn.Module, name: str, user_model: Optional[nn.Module], why: str) -> Any:
    """``wrapper.name`` where ``nn.Module`` found no such attribute: one of ``READ_THROUGH`` from
    ``user_model``, else an AttributeError; ``why`` says why the user's model's other attributes are not
    there and what to use instead."""
    if user_model is None or name.startswith("_") or not hasattr(user_model, name):
        raise AttributeError(f"{type(wrapper).__name__!r} object has no attribute {name!r}")
    if name in READ_THROUGH:
        return getattr(user_model, name)
    raise AttributeError(f"{name!r} of your {type(user_model).__name__} is not on {type(wrapper).__name__}: {why}; of "
                         f"its values {list(READ_THROUGH)} are read through")

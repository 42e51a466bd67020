"""ATorch's import path of the ``checkpoint`` method, which is activation checkpointing.

The code is in ``atorch/auto/opt_lib/activation_checkpoint.py`` (training-state checkpoints are
``atorch.checkpoint``); this module keeps ``atorch.auto.opt_lib.checkpoint`` importable.
"""
from atorch.auto.opt_lib.activation_checkpoint import (
    CheckpointConfig,
    CheckpointOptimization,
    enable_checkpoint,
    matching_modules,
)

__all__ = ["CheckpointConfig", "CheckpointOptimization", "enable_checkpoint", "matching_modules"]

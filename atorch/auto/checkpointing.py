"""The former home of the checkpoint code, kept so that ``atorch.auto.checkpointing`` imports work.

The code lives in the package ``atorch.checkpoint`` (one file per job); use ``atorch.save_checkpoint``
and friends.
"""
from atorch.checkpoint.api import load_checkpoint, save_checkpoint
from atorch.checkpoint.async_save import PendingSave, wait_for_checkpoint
from atorch.checkpoint.export import export_model, load_exported
from atorch.checkpoint.optimizer_state import OptimizerView, optimizer_state_tensors
from atorch.checkpoint.safe_load import SafeFileSystemReader
from atorch.checkpoint.tensors import canonical_name, in_saved_order, model_tensors, saved_orders

__all__ = ["save_checkpoint", "load_checkpoint", "wait_for_checkpoint", "PendingSave", "export_model",
           "load_exported", "OptimizerView", "optimizer_state_tensors", "SafeFileSystemReader", "canonical_name",
           "in_saved_order", "model_tensors", "saved_orders"]

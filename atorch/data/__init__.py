"""``from atorch.data import data_to_device``: ATorch's import path for the batch mover, kept for
scripts written against ATorch (the same function as ``atorch.common.util_func.data_to_device``)."""
from atorch.common.util_func import data_to_device

__all__ = ["data_to_device"]

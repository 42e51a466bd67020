"""``from atorch.common.util_func import data_to_device``, as in ATorch's example scripts."""
from __future__ import annotations

from typing import Any, Union

import torch

from atorch.utils.batch import move_to_device


def data_to_device(data: Any, device: Union[str, torch.device]) -> Any:
    """``data`` (a tensor, or dicts / lists / tuples / namedtuples of them) with every tensor moved
    to ``device``; other leaves are left as they are. Usable as auto_accelerate's ``prepare_input``."""
    return move_to_device(data, torch.device(device))


__all__ = ["data_to_device"]

"""``from atorch.common.util_func import data_to_device, find_free_port``, as in ATorch's scripts."""
from __future__ import annotations

import socket
from typing import Any, Union

import torch

from atorch.utils.batch import move_to_device


def data_to_device(data: Any, device: Union[str, torch.device]) -> Any:
    """``data`` (a tensor, or dicts / lists / tuples / namedtuples of them) with every tensor moved
    to ``device``; other leaves are left as they are. Usable as auto_accelerate's ``prepare_input``."""
    return move_to_device(data, torch.device(device))


def find_free_port(address: str = "") -> int:
    """A TCP port free on ``address`` (every interface by default) when asked: a rendezvous port
    for a process group started without a launcher (``init_distributed`` in a plain process). The
    port is released before returning, so another process may take it first; bind it soon."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


__all__ = ["data_to_device", "find_free_port"]

"""ATorch's names, for scripts written against ATorch (issue 16): ``atorch.rank()`` and friends,
``reset_distributed``, ``init_distributed``'s keywords, ``data_to_device``,
``get_data_partition_rank_and_size`` at both import paths, and ``result.args`` as a mapping."""
from __future__ import annotations

import datetime
import os
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist

import atorch
from atorch.auto.accelerate import auto_accelerate
from atorch.distributed import mesh
from atorch.errors import InputError
from atorch.testing import run_distributed


def test_rank_local_rank_world_size_outside_a_process_group():
    assert not dist.is_initialized()
    assert atorch.rank() is None
    assert atorch.local_rank() is None
    assert atorch.world_size() == 1


def test_init_distributed_without_env_returns_false(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert atorch.init_distributed("nccl", set_cuda_device_using_local_rank=True) is False
    assert atorch.init_distributed(timeout=datetime.timedelta(seconds=5)) is False


def test_init_distributed_checks_its_arguments():
    with pytest.raises(InputError, match="backend"):
        atorch.init_distributed(3)
    with pytest.raises(InputError, match="timedelta"):
        atorch.init_distributed(timeout=5)


def test_init_distributed_one_rank_env_and_reset(monkeypatch):
    from atorch.testing.launcher import free_port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    try:
        # nccl on a machine without CUDA falls back to gloo
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        assert atorch.init_distributed(backend, set_cuda_device_using_local_rank=True) is True
        assert atorch.init_distributed() is True  # already initialised
        assert (atorch.rank(), atorch.local_rank(), atorch.world_size()) == (0, 0, 1)
    finally:
        atorch.reset_distributed()
    assert not dist.is_initialized()
    assert atorch.rank() is None
    atorch.reset_distributed()  # a no-op the second time


def test_nccl_without_cuda_falls_back_to_gloo(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from atorch.testing.launcher import free_port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    try:
        assert atorch.init_distributed("nccl", set_cuda_device_using_local_rank=True) is True
        assert dist.get_backend() == "gloo"
    finally:
        atorch.reset_distributed()


def test_get_data_partition_rank_and_size_both_import_paths():
    from atorch.auto.model_context import get_data_partition_rank_and_size as from_model_context
    from atorch.distributed.distributed import get_data_partition_rank_and_size as from_distributed
    assert from_model_context is from_distributed
    assert from_distributed() == (0, 1)


def test_data_to_device():
    from atorch.common.util_func import data_to_device
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.ones(2), "b": [Pair(torch.zeros(1), 3)], "c": "text"}
    moved = data_to_device(batch, "cpu")
    assert isinstance(moved["b"][0], Pair) and moved["b"][0].y == 3 and moved["c"] == "text"
    assert moved["a"].device.type == "cpu"
    assert data_to_device(batch, torch.device("meta"))["a"].device.type == "meta"


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_result_args_attribute_and_mapping_access():
    ok, result, _ = auto_accelerate(_model(), torch.optim.SGD, optim_args={"lr": 0.1}, load_strategy=[])
    assert ok
    args = result.args
    assert args["use_optim_backward"] is args.use_optim_backward is False
    assert "use_optim_backward" in args and "nope" not in args
    assert args.get("requires_set_gradient_accumulation_boundary") is False
    assert args.get("nope", 7) == 7
    assert "use_optim_backward" in args.keys() and "data_parallel_size" in list(args)
    assert dict(args)["data_parallel_size"] == 1 == dict(args.items())["data_parallel_size"]
    assert len(args) == len(args.values())
    with pytest.raises(KeyError, match="valid keys.*use_optim_backward"):
        args["use_optim_backwards"]


def _two_ranks_names():
    assert mesh.parallel_state() is None
    from atorch.distributed.distributed import get_data_partition_rank_and_size
    without_mesh = get_data_partition_rank_and_size()
    ok, result, _ = auto_accelerate(_model(), torch.optim.SGD, optim_args={"lr": 0.1},
                                    load_strategy=["parallel_mode"])
    assert ok
    with_mesh = get_data_partition_rank_and_size()
    names = (atorch.rank(), atorch.local_rank(), atorch.world_size(), os.environ["LOCAL_RANK"])
    atorch.reset_distributed()
    after = (dist.is_initialized(), mesh.parallel_state() is None, atorch.rank(), atorch.world_size())
    return without_mesh, with_mesh, names, after


@pytest.mark.multirank
def test_names_on_two_ranks_and_reset():
    values = run_distributed(_two_ranks_names, 2)
    for rank, (without_mesh, with_mesh, names, after) in enumerate(values):
        assert without_mesh == (rank, 2)
        assert with_mesh == (rank, 2)
        assert names == (rank, rank, 2, str(rank))
        assert after == (False, True, None, 1)

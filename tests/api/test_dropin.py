"""ATorch's names, for scripts written against ATorch (issue 16): ``atorch.rank()`` and friends,
``reset_distributed``, ``init_distributed``'s keywords, ``data_to_device``,
``get_data_partition_rank_and_size`` at both import paths, and ``result.args`` as a mapping."""
from __future__ import annotations

import datetime
import gc
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


def _plain_process(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("backend, keywords", [("gloo", {}), ("nccl", {"set_cuda_device_using_local_rank": True}),
                                               (None, {"timeout": datetime.timedelta(seconds=30)})])
def test_init_distributed_in_a_plain_process_makes_a_one_process_group(monkeypatch, backend, keywords):
    """As ATorch: rank 0 of 1 on loopback at a free port (nccl without CUDA falls back to gloo)."""
    _plain_process(monkeypatch)
    try:
        assert atorch.init_distributed(backend, **keywords) is True
        assert (atorch.rank(), atorch.local_rank(), atorch.world_size()) == (0, 0, 1)
        if not torch.cuda.is_available():
            assert dist.get_backend() == "gloo"
        assert "MASTER_PORT" not in os.environ and "RANK" not in os.environ  # the environment is left as it was
    finally:
        atorch.reset_distributed()


def test_auto_accelerate_in_a_plain_process_trains_alone_or_in_the_users_group(monkeypatch):
    """auto_accelerate makes no group in a plain process (distributed-only methods are dropped);
    after the user's ``init_distributed("gloo")`` it runs fsdp in that one-process group."""
    _plain_process(monkeypatch)
    dataset = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))

    def run():
        return auto_accelerate(
            _model(), torch.optim.SGD, dataset, lambda batch, out: out.pow(2).mean(),
            prepare_input=lambda batch, device: batch[0], optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
            load_strategy=["parallel_mode", "fsdp"])

    ok, _, strategy = run()
    assert ok and strategy.names() == [] and not dist.is_initialized()
    try:
        assert atorch.init_distributed("gloo")
        ok, _, strategy = run()
        assert ok and strategy == ["parallel_mode", "fsdp"] and dist.get_world_size() == 1
    finally:
        atorch.reset_distributed()


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


def test_atorchs_import_paths():
    """``atorch.data.data_to_device``, ``atorch.distributed.distributed.init_distributed`` and
    ``atorch.common.util_func.find_free_port``, as ATorch's scripts import them."""
    import socket

    from atorch.common import util_func
    from atorch.data import data_to_device
    from atorch.distributed.distributed import init_distributed
    assert data_to_device is util_func.data_to_device and init_distributed is atorch.init_distributed
    port = util_func.find_free_port()
    assert isinstance(port, int) and 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))  # free: it binds


def test_old_checkpoint_import_paths():
    """``atorch.auto.opt_lib.checkpoint`` (the activation-checkpointing method, ATorch's path) and
    ``atorch.auto.checkpointing`` (the checkpoint code before it became ``atorch.checkpoint``)."""
    from atorch.auto import checkpointing
    from atorch.auto.opt_lib import get_optimization
    from atorch.auto.opt_lib.activation_checkpoint import CheckpointConfig
    from atorch.auto.opt_lib.checkpoint import CheckpointConfig as old_config
    from atorch.auto.opt_lib.checkpoint import CheckpointOptimization
    assert old_config is CheckpointConfig and isinstance(get_optimization("checkpoint"), CheckpointOptimization)
    import atorch.checkpoint as package
    for name in ("save_checkpoint", "load_checkpoint", "wait_for_checkpoint", "export_model"):
        assert getattr(checkpointing, name) is getattr(atorch, name) is getattr(package, name)


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
    del result  # the DDP wrapper holds the process group: free it before the group is destroyed
    gc.collect()
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


# --- sample_batch / batch_size: dry runs and the search without a dataset ----------------------------

class TupleModel(torch.nn.Module):
    """Takes the whole (x, y) batch, as ATorch's toy model does."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, batch):
        return self.net(batch[0])


def _mse(batch, output):
    return torch.nn.functional.mse_loss(output, batch[1])


def _sample(rows=3):
    return (torch.randn(rows, 4), torch.randn(rows, 2))


def test_sample_rows_dataset_repeats_the_rows():
    from atorch.utils.batch import SampleRowsDataset
    sample = {"x": torch.arange(6).view(3, 2), "tag": "t"}
    data = SampleRowsDataset(sample, 7)
    assert len(data) == 7 and data[4]["x"].tolist() == [2, 3] and data[4]["tag"] == "t"
    batch = next(iter(torch.utils.data.DataLoader(data, batch_size=5)))
    assert batch["x"][:, 0].tolist() == [0, 2, 4, 0, 2]
    with pytest.raises(IndexError):
        data[7]


def test_sample_batch_dry_run_in_semi_automatic_mode():
    ok, result, _ = auto_accelerate(TupleModel(), torch.optim.SGD, None, _mse, optim_args={"lr": 0.1}, load_strategy=[],
                                    ignore_dryrun_on_load_strategy=False, sample_batch=_sample(3), batch_size=8)
    assert ok and result.dataloader is None
    assert result.args.dryrun is not None and result.args.dryrun.ok
    assert result.args["per_rank_batch_size"] == 8
    batch = _sample()
    loss = result.loss_func(batch, result.model(batch))  # the model trains as usual
    loss.backward()
    result.optim.step()


def test_sample_batch_drives_the_search():
    ok, result, strategy = auto_accelerate(TupleModel(), torch.optim.SGD, None, _mse, optim_args={"lr": 0.1},
                                           sample_batch=_sample(4), time_limit=60)
    assert ok and result.dataloader is None and strategy is not None
    assert result.args.per_rank_batch_size == 4  # the sample's rows: the default batch_size


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 4}, "give sample_batch with it"),
    ({"sample_batch": _sample(), "dataset": [1]}, "drop sample_batch"),
    ({"sample_batch": _sample(), "loss_func": None}, "loss_func"),
    ({"sample_batch": _sample(), "batch_size": 0}, "positive int"),
    ({"sample_batch": _sample(), "batch_size": 4, "dataloader_args": {"batch_size": 6}}, "disagree"),
    ({"sample_batch": {"a": "no tensor"}}, "at least one tensor"),
    ({"sample_batch": (torch.zeros(2, 4), torch.zeros(3, 2))}, "first .batch. dimension"),
])
def test_sample_batch_bad_inputs(kwargs, match):
    args = {"loss_func": _mse, "dataset": None, "load_strategy": [], "ignore_dryrun_on_load_strategy": False}
    args.update(kwargs)
    with pytest.raises(InputError, match=match):
        auto_accelerate(_model(), torch.optim.SGD, optim_args={"lr": 0.1}, **args)


def test_sample_batch_refused_when_the_dry_run_is_skipped():
    with pytest.raises(InputError, match="ignore_dryrun_on_load_strategy"):
        auto_accelerate(_model(), torch.optim.SGD, None, _mse, load_strategy=[], sample_batch=_sample())


# --- a script in ATorch's style, end to end on 2 gloo ranks --------------------------------------------

class NumpyPairs(torch.utils.data.Dataset):
    """Tuple rows (x, y) of numpy arrays, as ATorch's example datasets give them."""

    def __init__(self, size=64):
        import numpy as np
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((size, 8)).astype(np.float32)
        self.y = (self.x[:, :4] * 0.5).astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class ToyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([ToyBlock() for _ in range(3)])
        self.head = torch.nn.Linear(8, 4)

    def forward(self, batch):
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def toy_loss(batch, output):
    return torch.nn.functional.mse_loss(output, batch[1])


def _atorch_style_script(strategy_file):
    import pickle

    from atorch.auto.model_context import get_data_partition_rank_and_size
    from atorch.common.util_func import data_to_device
    assert atorch.init_distributed("nccl", set_cuda_device_using_local_rank=True)  # already up: True
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parallel_config = ([("data", 8)], None)  # written for 8 ranks; fitted to 2
    fsdp_config = {"sync_module_states": True, "limit_all_gathers": True, "forward_prefetch": True,
                   "atorch_wrap_cls": (ToyBlock,)}
    strategy = pickle.dumps(atorch.Strategy([("parallel_mode", parallel_config), ("fsdp", fsdp_config)]))
    dataset = NumpyPairs()
    status, res, best = auto_accelerate(
        ToyModel(), torch.optim.AdamW, dataset, toy_loss, data_to_device, None, {"lr": 0.01}, None,
        {"batch_size": 16, "shuffle": False}, None, None, None, strategy, None, None, False, strategy_file, True)
    assert status
    assert best == [("parallel_mode", parallel_config), ("fsdp", fsdp_config)]  # ATorch's tests compare so
    model, optim, dataloader, loss_func, prepare_input = (res.model, res.optim, res.dataloader, res.loss_func,
                                                          res.prepare_input)
    losses = []
    for _ in range(3):
        for batch in dataloader:
            optim.zero_grad()
            batch = prepare_input(batch, device)
            loss = loss_func(batch, model(batch))
            optim.backward(loss) if res.args["use_optim_backward"] else loss.backward()
            optim.step()
            losses.append(loss.item())
    assert atorch.rank() is None or atorch.rank() in (0, 1)  # ATorch's example's logging test
    names = (atorch.rank(), atorch.local_rank(), atorch.world_size(), get_data_partition_rank_and_size(),
             type(model).__name__)
    # the saved strategy, reused with only a model
    status2, res2, best2 = auto_accelerate(ToyModel(), load_strategy=strategy_file)
    assert status2 and res2.optim is None and res2.dataloader is None
    out = res2.model((torch.ones(2, 8, device=device), None))
    atorch.reset_distributed()
    after = (dist.is_initialized(), mesh.parallel_state() is None, atorch.rank())
    return losses, names, [str(item) for item in best2], tuple(out.shape), after


@pytest.mark.multirank
def test_atorch_style_script_on_two_ranks(tmp_path):
    path = str(tmp_path / "strategy.pkl")
    values = run_distributed(_atorch_style_script, 2, path, timeout_s=300)
    for rank, (losses, names, reused, shape, after) in enumerate(values):
        assert len(losses) == 3 * (64 // 16)
        assert losses[-1] < losses[0]
        assert names[:4] == (rank, rank, 2, (rank, 2))
        assert "FSDP" in names[4]
        assert any("fsdp" in item for item in reused) and any("parallel_mode" in item for item in reused)
        assert shape == (2, 4)
        assert after == (False, True, None)
    assert os.path.exists(path)

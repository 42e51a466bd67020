"""Each method on real gloo ranks (world sizes 1, 2 and 4) against a single-process fp32 reference
with the same seed and global batch. Tolerances: fp32 relative difference < 1e-5 (losses and all
final weights together); with bf16/fp16 < 2e-2. One launch per world size keeps the suite fast."""
import pytest
import torch
import torch.distributed as dist

import atorch.distributed as adist
from atorch.auto.strategy import Strategy
from atorch.distributed.mesh import ParallelModeConfig, group_ranks, normalize_parallel_config, parse_parallel_config
from atorch.testing import run_distributed
from atorch.testing.training import train_gpt
from tests.parity import BF16, CKPT, assert_matches, run_suite

pytestmark = pytest.mark.multirank

CASES_1 = {
    "ddp": ["parallel_mode"],
    "bf16": ["parallel_mode", BF16],
    "half_bf16": ["parallel_mode", ("half", "bf16")],
    "checkpoint": ["parallel_mode", CKPT],
}
CASES_2 = {
    "ddp": ["parallel_mode"],
    "bf16": ["parallel_mode", BF16],
    "fp16": ["parallel_mode", "amp_native"],
    # parallel_mode implied
    "bf16_skip_nonfinite": [("amp_native", {"dtype": torch.bfloat16, "skip_if_nonfinite": True})],
    "half_bf16": ["parallel_mode", ("half", "bf16")],
    "checkpoint": ["parallel_mode", CKPT],
    "reentrant_checkpoint_bf16": ["parallel_mode", ("checkpoint", {"wrap_class": ("GPTBlock",), "no_reentrant": False}),
                                  BF16],
    # made for 4 ranks: data 4 -> 2; tensor 2 x data 2 -> tensor 2 x data 1 (no data split, no DDP)
    "from_4_ranks_data": Strategy([("parallel_mode", ([("data", 4)], None))]).to_bytes(),
    "from_4_ranks_tensor_data": Strategy([("parallel_mode", ([("tensor", 2), ("data", 2)], None))]).to_bytes(),
    "from_4_ranks_refused": Strategy([("parallel_mode", ([("tensor", 4)], None))]).to_bytes(),
}
CASES_4 = {
    "ddp": ["parallel_mode"],
    "bf16_checkpoint": ["parallel_mode", BF16, CKPT],
    "tensor2_data2_fp16": [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "amp_native"],
}


@pytest.fixture(scope="module")
def reference():
    return train_gpt([])


def _check_all(results: list, cases: dict, reference: dict, world: int, skip=()) -> None:
    for key, strategy in cases.items():
        if key in skip:
            continue
        if isinstance(strategy, bytes):
            strategy = list(Strategy.from_bytes(strategy))
        for rank, per_rank in enumerate(results):
            assert_matches(per_rank[key], reference, strategy, f"world {world}, rank {rank}, {key}")


def test_world_size_1(reference):
    results = run_distributed(run_suite, 1, CASES_1)
    _check_all(results, CASES_1, reference, 1)


def test_world_size_2(reference):
    results = run_distributed(run_suite, 2, CASES_2)
    _check_all(results, CASES_2, reference, 2, skip={"from_4_ranks_refused"})
    for rank_result in results:
        # the strategy came back through pickle, which stores configs as plain dicts: parse them again
        data = parse_parallel_config(rank_result["from_4_ranks_data"]["strategy"].get("parallel_mode"))
        assert data == ParallelModeConfig(dims=(("data", 2),))
        tensor_data = parse_parallel_config(rank_result["from_4_ranks_tensor_data"]["strategy"].get("parallel_mode"))
        assert tensor_data == ParallelModeConfig(dims=(("tensor", 2), ("data", 1)))
        assert rank_result["bf16_skip_nonfinite"]["strategy"].names() == ["parallel_mode", "amp_native"]
        error = rank_result["from_4_ranks_refused"]["error"]
        assert error.startswith("ParallelModeError") and "tensor=4" in error and "world size 2" in error


def test_world_size_4(reference):
    results = run_distributed(run_suite, 4, CASES_4)
    _check_all(results, CASES_4, reference, 4)


def _mesh_groups(config) -> dict:
    from atorch.auto.accelerate import auto_accelerate
    from atorch.models.gpt import GPT, GPTConfig

    auto_accelerate(GPT(GPTConfig(n_layer=1)), load_strategy=[("parallel_mode", config)])
    return {name: adist.parallel_group_ranks(name) for name in ("tensor", "data")} | {"rank": dist.get_rank()}


@pytest.mark.parametrize("order", [None, [3, 1, 2, 0]])
def test_live_mesh_groups_match_the_pure_layout(order):
    config = ([("tensor", 2), ("data", 2)], order)
    expected = group_ranks(normalize_parallel_config(config, 4))
    for got in run_distributed(_mesh_groups, 4, config):
        for name in ("tensor", "data"):
            mine = [g for g in expected[name] if got["rank"] in g]
            assert len(mine) == 1 and sorted(got[name]) == sorted(mine[0]), (name, got, expected)

"""Rank-local faults on 2 gloo ranks: an exception on one rank only, while the other rank is inside
a collective, ends the dry run on every rank with DryRunError within seconds, and the process group
stays usable for the next case (all cases share one launch, so every later case proves it).

Matrix: where the fault is raised (loss_func, the model's forward at its second block, the user's
prepare_input) × when (first call, third call) × the data-parallel method (DDP, zero1, zero2, fsdp).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from atorch.auto.accelerate import auto_accelerate
from atorch.errors import DryRunError
from atorch.models import SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import SMALL_GPT, build_gpt
from atorch.utils.batch import move_to_device

pytestmark = pytest.mark.multirank

METHODS = {"ddp": ["parallel_mode"], "zero1": ["zero1"], "zero2": ["zero2"], "fsdp": ["fsdp"]}
PLACES = ("loss_func", "forward", "prepare_input")
CALLS = (1, 3)
CASE_LIMIT_S = 30.0
COLLECTIVE_TIMEOUT_S = 3.0  # how long a rank waits inside a collective for a failed peer


class FaultOnRank1:
    """Counts calls on this rank and raises at call ``at`` on rank 1 only."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self) -> None:
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == self.at:
            raise RuntimeError(f"injected fault on rank 1 at call {self.at}")


def _accelerate(method: str, place: str, at: int):
    fault = FaultOnRank1(at)
    model = build_gpt(0)

    def loss_func(batch, output):
        if place == "loss_func":
            fault()
        return gpt_loss(batch, output)

    def prepare_input(batch, device):
        if place == "prepare_input":
            fault()
        return move_to_device(batch, device)

    if place == "forward":  # inside the forward, after the first block ran (FSDP has gathered and freed it)
        model.blocks[1].register_forward_pre_hook(lambda module, args: fault())
    return auto_accelerate(
        model, torch.optim.SGD, SyntheticTokenDataset(64, SMALL_GPT.block_size, SMALL_GPT.vocab_size), loss_func,
        prepare_input=prepare_input, optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
        model_input_format="unpack_dict", load_strategy=METHODS[method], ignore_dryrun_on_load_strategy=False,
        dryrun_collective_timeout=COLLECTIVE_TIMEOUT_S,
    )


def launch() -> dict:
    cases = {}
    for method in METHODS:
        for place in PLACES:
            for at in CALLS:
                started = time.monotonic()
                try:
                    _accelerate(method, place, at)
                    outcome = "no error"
                except DryRunError as error:
                    outcome = f"DryRunError: {error}"
                except Exception as error:  # reported, so the test shows what leaked
                    outcome = f"{type(error).__name__}: {error}"
                cases[f"{method}/{place}/call{at}"] = (outcome, time.monotonic() - started)
    status, result, _ = _accelerate("fsdp", "loss_func", at=10**9)  # healthy: the group still works
    value = torch.ones(1)
    dist.all_reduce(value)
    return {"cases": cases, "healthy": status, "all_reduce": value.item()}


@pytest.fixture(scope="module")
def faults():
    return run_distributed(launch, 2, timeout_s=600)


def test_every_rank_ends_each_fault_with_dry_run_error_quickly(faults):
    for rank, out in enumerate(faults):
        for case, (outcome, seconds) in out["cases"].items():
            print(f"rank {rank} {case}: {seconds:.2f} s, {outcome[:90]}")
            assert outcome.startswith("DryRunError"), f"rank {rank} {case}: {outcome}"
            assert "injected fault on rank 1" in outcome, f"rank {rank} {case} lost the reason: {outcome}"
            assert seconds < CASE_LIMIT_S, f"rank {rank} {case} took {seconds:.1f} s"


def test_the_process_group_is_usable_after_the_faults(faults):
    assert all(out["healthy"] and out["all_reduce"] == 2.0 for out in faults)

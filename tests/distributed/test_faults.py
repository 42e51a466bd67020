"""Rank-local faults on 2 gloo ranks: an exception on one rank only, while the other rank is inside
a collective, ends the dry run on every rank with DryRunError within seconds (InputError where it is the
user's loss_items count on the first row, which auto_accelerate checks before applying anything), and the process group
stays usable for the next case (all cases share one launch, so every later case proves it).

Matrix: where the fault is raised (loss_func, the model's forward at its second block, the user's
prepare_input; the user's loss_items count under DDP, fsdp and a pipeline) × when (first call, third
call) × the method (DDP, zero1, zero2, fsdp, tensor_parallel,
pipeline_parallel: rank 0 then waits in a point-to-point receive, not a collective; ds_3d_parallel where
DeepSpeed is installed).
The same three places inside the fully automatic search (the sharded candidates fail on rank 1: the
search completes without them), and a rank killed with SIGKILL during a dry run (the survivor ends
with RankLostError naming it). Each case's wall time is printed and must stay under 30 s.

On 4 ranks: after a rank's failure rebuilt the process group, a tensor x data model whose mesh equals
one built before the failure trains as that one did (DTensor's caches would otherwise serve it the old
mesh, whose groups are gone). In one process: a cap nested in another (a dry run inside a conformance
cell) leaves the outer one in force when it ends.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from atorch.auto.accelerate import auto_accelerate
from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason
from atorch.errors import DryRunError, RankLostError
from atorch.models import SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import SMALL_GPT, build_gpt
from atorch.utils.batch import move_to_device

# solo: its assertions read this machine's timings / memory or wait on timeouts, so it runs alone (make test)
pytestmark = [pytest.mark.multirank, pytest.mark.solo]

METHODS = {"ddp": ["parallel_mode"], "zero1": ["zero1"], "zero2": ["zero2"], "fsdp": ["fsdp"],
           # rank 1 holds the second half of each weight (its collectives wait for rank 0's), or the second
           # pipeline stage (block 1, the loss: rank 0 waits for its gradients in a point-to-point receive)
           "tensor_parallel": [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"],
           "pipeline_parallel": [("parallel_mode", ([("pipeline", 2)], None)),
                                 ("pipeline_parallel", {"num_micro_batch": 2})],
           # DeepSpeed's pipeline engine: rank 1's fault at the cut's traced forward (call 1 of "forward") comes
           # before DeepSpeed makes its groups, whose creation a peer's failure would not end
           **({"ds_3d_parallel": [("parallel_mode", ([("pipeline", 2)], None)),
                                  ("ds_3d_parallel", {"num_micro_batch": 2})]}
              if deepspeed_unavailable_reason() is None else {})}
PLACES = ("loss_func", "forward", "prepare_input")
# the user's loss_items count (rank 0 then waits in the count's all-reduce over the data ranks, or, under a
# pipeline, in its micro-batches' point-to-point receive): where atorch calls it
LOSS_ITEMS_METHODS = ("ddp", "fsdp", "pipeline_parallel")
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

    def count_items(batch):
        if place == "loss_items":
            fault()
        return batch["labels"].numel()

    if place == "forward":  # inside the forward, after the first block ran (FSDP has gathered and freed it)
        model.blocks[1].register_forward_pre_hook(lambda module, args: fault())
    return auto_accelerate(
        model, torch.optim.SGD, SyntheticTokenDataset(64, SMALL_GPT.block_size, SMALL_GPT.vocab_size), loss_func,
        prepare_input=prepare_input, optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
        model_input_format="unpack_dict", load_strategy=METHODS[method], ignore_dryrun_on_load_strategy=False,
        dryrun_collective_timeout=COLLECTIVE_TIMEOUT_S, loss_items=count_items if place == "loss_items" else None,
    )


def launch() -> dict:
    cases = {}
    for method in METHODS:
        for place in PLACES + (("loss_items",) if method in LOSS_ITEMS_METHODS else ()):
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
            # the count's first call is auto_accelerate's check of the first row, before anything is applied
            expected = "InputError" if case.endswith("loss_items/call1") else "DryRunError"
            assert outcome.startswith(expected), f"rank {rank} {case}: {outcome}"
            assert "injected fault on rank 1" in outcome, f"rank {rank} {case} lost the reason: {outcome}"
            assert seconds < CASE_LIMIT_S, f"rank {rank} {case} took {seconds:.1f} s"


# where nothing outside the dry run's own context holds the process group (DDP's reducer, ZeroRedundancyOptimizer's
# group), the failed rank drops it (``run_isolated``'s ``release``) and gloo closes its connections, so the peer's
# collective fails at once instead of waiting out COLLECTIVE_TIMEOUT_S (3.2-3.7 s a case before)
PROMPT_METHODS = ("ddp", "zero1")


def test_a_peer_of_the_failed_rank_stops_at_once_where_the_dry_run_held_the_group_alone(faults):
    for rank, out in enumerate(faults):
        for case, (outcome, seconds) in out["cases"].items():
            if case.split("/")[0] in PROMPT_METHODS:
                assert seconds < COLLECTIVE_TIMEOUT_S / 2, f"rank {rank} {case} took {seconds:.2f} s"


def test_the_process_group_is_usable_after_the_faults(faults):
    assert all(out["healthy"] and out["all_reduce"] == 2.0 for out in faults)


# --- inside the search: a candidate that fails on rank 1 only is marked failed, the search goes on ---
SEARCH_ONLY_SHARDING = ["amp_native", "half", "checkpoint", "tensor_parallel", "pipeline_parallel", "mixed_parallel",
                        "module_replace", "native_dynamo", "fp8"]


class ShardedStepFault:
    """Raises on rank 1 only while a sharded candidate (fsdp / zero2: an FSDP2 root) trains."""

    def __init__(self, place: str):
        self.place, self.sharded = place, False

    def watch_root(self, root) -> None:
        self.sharded = isinstance(root, FSDPModule)

    def check(self) -> None:
        if self.sharded and dist.get_rank() == 1:
            raise RuntimeError(f"injected fault on rank 1 in {self.place} of a sharded candidate")


def _search_with_fault(place: str):
    fault = ShardedStepFault(place)
    model = build_gpt(0)
    # plain functions (not bound methods): the search's deep copies of the model keep calling these
    model.register_forward_pre_hook(lambda module, args, kwargs: fault.watch_root(module), with_kwargs=True)
    if place == "forward":  # mid-forward, after the first block ran
        model.blocks[1].register_forward_pre_hook(lambda module, args: fault.check())

    def loss_func(batch, output):
        if place == "loss_func":
            fault.check()
        return gpt_loss(batch, output)

    def prepare_input(batch, device):
        if place == "prepare_input":
            fault.check()
        return move_to_device(batch, device)

    status, result, strategy = auto_accelerate(
        model, torch.optim.SGD, SyntheticTokenDataset(64, SMALL_GPT.block_size, SMALL_GPT.vocab_size), loss_func,
        prepare_input=prepare_input, optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
        model_input_format="unpack_dict", excluded=SEARCH_ONLY_SHARDING, search_exhaustive=True,
        use_profile_cache=False, dryrun_collective_timeout=COLLECTIVE_TIMEOUT_S,
    )
    rows = {row.label: (row.status, row.reason) for row in result.args.extras["search"].rows}
    return {"status": status, "strategy": strategy.names(), "rows": rows}


def search_launch() -> dict:
    out = {}
    for place in PLACES:
        started = time.monotonic()
        out[place] = _search_with_fault(place)
        out[place]["seconds"] = time.monotonic() - started
    return out


@pytest.fixture(scope="module")
def searched_with_faults():
    return run_distributed(search_launch, 2, timeout_s=600)


def test_the_search_completes_with_the_failing_candidates_marked_failed(searched_with_faults):
    for rank, out in enumerate(searched_with_faults):
        for place, found in out.items():
            print(f"rank {rank} search with a fault in {place}: {found['seconds']:.1f} s, chose {found['strategy']}")
            assert found["status"], (rank, place, found)
            sharded = {label: row for label, row in found["rows"].items()  # micro-batch splits the unsplit batch
                       if label.startswith(("fsdp", "zero2")) and row[0] != "not tried"}  # made needless are not run
            assert sharded, found["rows"]
            for label, (status, reason) in sharded.items():
                assert status == "failed" and "injected fault on rank 1" in reason, (rank, place, label, status, reason)
            assert not set(found["strategy"]) & {"fsdp", "zero2"}, found["strategy"]
            assert any(status == "ok" for status, _ in found["rows"].values())


# --- a rank killed with SIGKILL in the middle of a dry run ---
def killed_launch() -> dict:
    def loss_func(batch, output):
        if dist.get_rank() == 1 and loss_func.calls == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss_func.calls += 1
        return gpt_loss(batch, output)

    loss_func.calls = 0
    started = time.monotonic()
    try:
        auto_accelerate(build_gpt(0), torch.optim.SGD,
                        SyntheticTokenDataset(64, SMALL_GPT.block_size, SMALL_GPT.vocab_size), loss_func,
                        optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
                        model_input_format="unpack_dict", load_strategy=["fsdp"], ignore_dryrun_on_load_strategy=False,
                        dryrun_collective_timeout=COLLECTIVE_TIMEOUT_S)
        outcome = "no error"
    except RankLostError as error:
        outcome = f"RankLostError {error.lost_ranks}: {error}"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    return {"outcome": outcome, "seconds": time.monotonic() - started}


def test_a_killed_rank_ends_the_others_with_rank_lost_error():
    survivor, killed = run_distributed(killed_launch, 2, timeout_s=300, may_die=(1,))
    print(f"survivor: {survivor['seconds']:.1f} s, {survivor['outcome'][:160]}")
    assert killed is None
    assert survivor["outcome"].startswith("RankLostError [1]"), survivor["outcome"]
    assert survivor["seconds"] < CASE_LIMIT_S


# --- after a rebuild, a mesh equal to one from before the failure is not served the old one's groups ---
TP2_DP2 = [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel"]


def _tensor_parallel_after_a_rebuild() -> dict:
    """Groups made before the first mesh (as a job's own groups would be) push its group names past
    those the rebuilt process group will have made when the second mesh, equal to the first, is built.
    DTensor's caches hold the first mesh; served it, the second model's collectives would name groups
    that the rebuild destroyed ("Could not resolve the process group registered under the name ...")."""
    from atorch.distributed.fault import run_isolated
    from atorch.testing.training import train_gpt

    for _ in range(4):
        dist.new_group(list(range(dist.get_world_size())))
    before = train_gpt(TP2_DP2, steps=2)["losses"]
    failed = run_isolated(FaultOnRank1(at=1), collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        after = train_gpt(TP2_DP2, steps=2)["losses"]
    except Exception as error:  # reported: the test shows the leak's message
        after = f"{type(error).__name__}: {error}"
    return {"failed": failed.ok is False, "before": before, "after": after}


def test_a_mesh_built_after_a_rank_failure_uses_its_own_groups():
    for rank, out in enumerate(run_distributed(_tensor_parallel_after_a_rebuild, 4, timeout_s=300)):
        assert out["failed"], rank
        assert out["after"] == out["before"], f"rank {rank}: {out['after']}"


def _caps_seen() -> list:
    from atorch.distributed.timeouts import collective_timeout_cap, current_timeout, normal_timeout

    seen = []
    with collective_timeout_cap(7.0):
        with collective_timeout_cap(3.0):
            seen.append(current_timeout().total_seconds())
        seen.append(current_timeout().total_seconds())  # the outer cap is back
    seen.append(current_timeout() == normal_timeout())
    return seen


def test_a_nested_cap_leaves_the_outer_one_in_force():
    """A dry run's cap inside a conformance cell's (or a search candidate's): when the dry run ends, the
    cell's remaining collectives still give up after the cell's cap, not after the normal 10 minutes."""
    assert run_distributed(_caps_seen, 1, timeout_s=120)[0] == [3.0, 7.0, True]

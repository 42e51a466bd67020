"""``spread_over_ranks`` on 2 gloo ranks: each rank does its share of the items alone, then every rank has
every result in the items' order; a share that raises is raised on every rank (naming the rank and the item)
without aborting the process group; a rank that dies while the others wait is reported with RankLostError
once its heartbeat stops, not after a collective timeout.

The search spreads its alone measurements this way, so training alone must run no collective: rank 1 trains
alone under every setting method (fp32, bf16 and fp16 autocast with its grad scaler's non-finite check,
half, checkpointing), on a normal model and on one built on the meta device (whose initialisation agrees a
seed over the ranks when it is not alone), while rank 0 only waits; a collective there would wait for
rank 0 until the 5 s cap and fail the measurement."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from atorch.auto import opt_lib
from atorch.auto.model_context import ModelContext
from atorch.auto.search.measure import train_alone
from atorch.auto.strategy import Strategy, StrategyItem
from atorch.distributed.spread import ShareFailedError, assignment, spread_over_ranks
from atorch.distributed.timeouts import collective_timeout_cap
from atorch.errors import RankLostError
from atorch.models import SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import SMALL_GPT, build_gpt

# solo: its assertions read this machine's timings / memory or wait on timeouts, so it runs alone (make test)
pytestmark = [pytest.mark.multirank, pytest.mark.solo]

LOST_AFTER_S = 2.0


def _cases() -> dict:
    out = {}
    rank = dist.get_rank()
    # 5 items on 2 ranks: rank 0 does 0, 2, 4 and rank 1 does 1, 3 and, so as not to idle while rank 0 does
    # the last round's one item, 4 again (rank 1 slower: the others wait for it)
    def work(item: int) -> str:
        time.sleep(0.3 if rank == 1 else 0.0)
        return f"{item} on rank {rank}"

    out["results"] = spread_over_ranks(list(range(5)), work, LOST_AFTER_S)

    def failing(item: int) -> str:
        if item == 1:
            raise ValueError("no such setting")
        time.sleep(1.0)  # rank 0 is still working when rank 1 fails: it must not be interrupted
        return str(item)

    started = time.monotonic()
    try:
        spread_over_ranks([0, 1], failing, LOST_AFTER_S, describe=lambda item: f"item {item}")
        out["failure"] = "no error"
    except ShareFailedError as error:
        out["failure"] = str(error)
    out["failure_s"] = time.monotonic() - started
    total = torch.ones(1)
    dist.all_reduce(total)  # the group was not aborted
    out["after"] = total.item()
    return out


def _killed() -> str:
    def work(item: int) -> str:
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return str(item)

    started = time.monotonic()
    try:
        spread_over_ranks([0, 1], work, LOST_AFTER_S)
        return "no error"
    except RankLostError as error:
        return f"RankLostError {error.lost_ranks} after {time.monotonic() - started:.1f} s: {error}"


SETTINGS = {"fp32": [], "amp bf16": [("amp_native", {"dtype": torch.bfloat16})],
            "amp fp16": [("amp_native", {"dtype": torch.float16, "skip_if_nonfinite": True})],
            "half": [("half", "bf16")], "checkpoint": [("checkpoint", ("GPTBlock",))]}


def _strategy(entries: list) -> Strategy:
    """The setting's methods with their configs normalised, as the search applies them alone."""
    items = []
    for entry in entries:
        name, config = entry if isinstance(entry, tuple) else (entry, None)
        items.append(StrategyItem(name, opt_lib.get_optimization(name).normalize(config), False))
    return Strategy(items)


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return build_gpt(0)


def _train_alone_on_rank_1() -> dict:
    items = [(name, meta) for name in SETTINGS for meta in (False, True)]

    def work(item: tuple) -> str:
        name, meta = item
        if dist.get_rank() == 0:
            return "idle"
        model = _meta_gpt() if meta else build_gpt(0)
        dataset = SyntheticTokenDataset(32, SMALL_GPT.block_size, SMALL_GPT.vocab_size)
        ctx = ModelContext(model, torch.optim.SGD, dataset, gpt_loss, model_input_format="unpack_dict",
                           optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8}, local=True, per_rank_batch_size=4)
        result, state = train_alone(ctx, _strategy(SETTINGS[name]), steps=3, agree=False)
        return "ok" if result.ok else f"failed: {result.error}"

    # rank 0 takes the even items, rank 1 the odd: give rank 0 placeholders so that rank 1 trains every setting
    placed = [entry for item in items for entry in (("rank 0", False), item)]
    with collective_timeout_cap(5.0):
        results = spread_over_ranks(placed, work, LOST_AFTER_S * 30)
    return {f"{name}{' (meta)' if meta else ''}": results[2 * i + 1][0] for i, (name, meta) in enumerate(items)}


def test_training_alone_runs_no_collective_under_any_setting():
    outcome = run_distributed(_train_alone_on_rank_1, 2, timeout_s=300)[0]
    print(outcome)
    assert outcome and all(value == "ok" for value in outcome.values()), outcome


def test_the_assignment_keeps_every_rank_busy_in_every_round():
    assert assignment(4, 2) == [[0, 2], [1, 3]]
    assert assignment(3, 2) == [[0, 2], [1, 2]]
    assert assignment(1, 4) == [[0], [0], [0], [0]]  # one setting on 4 ranks: measured on each, as before
    assert assignment(6, 4) == [[0, 4], [1, 5], [2, 4], [3, 5]]
    assert assignment(0, 2) == [[], []]


def test_every_rank_gets_every_result_in_order_and_a_failing_share_fails_every_rank():
    for rank, out in enumerate(run_distributed(_cases, 2, timeout_s=120)):
        print(f"rank {rank}: {out}")
        assert out["results"] == [["0 on rank 0"], ["1 on rank 1"], ["2 on rank 0"], ["3 on rank 1"],
                                  ["4 on rank 0", "4 on rank 1"]]
        assert out["failure"] == "rank 1 failed on item 1: ValueError: no such setting", out["failure"]
        assert out["failure_s"] < 10.0
        assert out["after"] == 2.0


def test_a_rank_killed_during_its_share_is_reported_lost_by_the_others():
    survivor, killed = run_distributed(_killed, 2, timeout_s=120, may_die=(1,))
    print(f"survivor: {survivor}")
    assert killed is None
    assert survivor.startswith("RankLostError [1]"), survivor
    seconds = float(survivor.split(" after ")[1].split(" s")[0])
    assert seconds < LOST_AFTER_S + 5.0, survivor

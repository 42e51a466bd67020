"""``torchrun --max-restarts 1`` after a killed rank resumes exactly, with no environment variable set.

torchrun's workers share the agent's TCPStore across restarts, so without atorch's per-attempt
namespace (``atorch/distributed/elastic.py``) a restarted rank reads the dead attempt's addresses and
``init_process_group`` fails or hangs (here 13 of 19 restarts did). Each launch of
tests/scripts/elastic_restart.py trains a tiny GPT on 2 ranks, checkpoints every 4 steps, and rank 1
kills itself (SIGKILL) after step 7; torchrun restarts both ranks, which resume from step 4. The losses
of steps 5-10 and the final weights must equal an uninterrupted run's bit for bit.

Here one kill under DDP and one under fsdp (each with its uninterrupted reference: about 25 s a
strategy): the fix is in process-group set-up, whatever the strategy, and tests/test_checkpoints.py
checks exact resume under every strategy. ``ATORCH_RESTART_RUNS=10`` repeats each kill to show it is
not luck, ``ATORCH_RESTART_STRATEGIES=ddp,fsdp,zero1,zero2`` adds strategies (10 of 10 each, measured).
The handshake itself is also tested in threads on a store that holds a dead attempt's keys.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from atorch.distributed.elastic import ATTEMPT_KEY, agree_attempt
from atorch.errors import RankLostError

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_restart.py"
STEPS, KILL_STEP, RESUMED_FROM = 10, 7, 4
RUNS = int(os.environ.get("ATORCH_RESTART_RUNS", "1"))
STRATEGIES = os.environ.get("ATORCH_RESTART_STRATEGIES", "ddp,fsdp").split(",")
TIMEOUT_S = 240


def launch(out: Path, strategy: str, kill_step: int) -> None:
    """One torchrun launch of the script on 2 ranks, with one restart allowed; fails the test on a bad exit."""
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", str(SCRIPT), str(out), strategy, str(kill_step)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if run.returncode != 0:
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-25:])
        pytest.fail(f"{strategy}: torchrun exited with {run.returncode}:\n{tail}")


def losses(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"losses-{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_killed_mid_training_resumes_exactly_after_torchrun_restarts_it(tmp_path, strategy):
    reference = tmp_path / "reference"
    launch(reference, strategy, kill_step=-1)
    expected = [{row["step"]: row["loss"] for row in losses(reference, rank)} for rank in (0, 1)]  # each rank's batch
    expected_weights = torch.load(reference / "weights.pt", weights_only=True)
    for run in range(RUNS):
        out = tmp_path / f"killed-{run}"
        launch(out, strategy, KILL_STEP)
        for rank in (0, 1):
            rows = losses(out, rank)
            attempts = [(row["attempt"], row["step"]) for row in rows]
            assert attempts == ([(0, s) for s in range(1, KILL_STEP + 1)]
                                + [(1, s) for s in range(RESUMED_FROM + 1, STEPS + 1)]), attempts
            resumed = {row["step"]: row["loss"] for row in rows if row["attempt"] == 1}
            assert resumed == {s: expected[rank][s] for s in resumed}, f"run {run} rank {rank}: {resumed} vs {expected}"
        weights = torch.load(out / "weights.pt", weights_only=True)
        assert weights.keys() == expected_weights.keys()
        for name, value in weights.items():
            assert torch.equal(value, expected_weights[name]), f"run {run}: {name} differs from the uninterrupted run"
    print(f"{strategy}: {RUNS} of {RUNS} killed runs resumed exactly")


def _agree_in_threads(store_port: int, world: int, timeout_s: float, delay_rank0_s: float = 0.0) -> list:
    """``agree_attempt`` on ``world`` threads with a client store each; each thread's attempt or error."""
    results: list = [None] * world

    def rank_main(rank: int) -> None:
        if rank == 0 and delay_rank0_s:
            threading.Event().wait(delay_rank0_s)
        store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        try:
            results[rank] = agree_attempt(store, rank, world, timeout_s)
        except RankLostError as error:
            results[rank] = error

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_every_rank_agrees_on_a_new_attempt_past_a_dead_attempts_keys():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    assert _agree_in_threads(server.port, 3, 20) == [1, 1, 1]
    # a dead attempt 2 that rank 0 opened and answered other tokens in: the followers read 2 before
    # the new rank 0 counts, must not take those answers, and join attempt 3
    server.add(ATTEMPT_KEY, 1)
    for rank in (1, 2):
        server.set(f"{ATTEMPT_KEY}/2/hello/{rank}", b"old")
        server.set(f"{ATTEMPT_KEY}/2/welcome/{rank}", b"old")
    assert _agree_in_threads(server.port, 3, 20, delay_rank0_s=0.5) == [3, 3, 3]


def test_a_rank_that_never_joins_is_named_by_rank_lost_error():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    store = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    with pytest.raises(RankLostError, match=r"rank\(s\) \[1\] did not join") as caught:
        agree_attempt(store, 0, 2, timeout_s=0.5)
    assert caught.value.lost_ranks == [1]
    with pytest.raises(RankLostError, match="rank 0 did not open"):
        agree_attempt(store, 1, 2, timeout_s=0.5)

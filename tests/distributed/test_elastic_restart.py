"""``torchrun --max-restarts 1`` after a killed rank resumes exactly, with no environment variable set.

torchrun's workers share the agent's TCPStore across restarts, so without atorch's per-attempt
namespace (``atorch/distributed/elastic.py``) a restarted rank reads the dead attempt's addresses and
``init_process_group`` fails or hangs (here 13 of 19 restarts did). Each launch of
tests/distributed/scripts/elastic_restart.py trains a tiny GPT on 2 ranks, checkpoints every 4 steps, and rank 1
kills itself (SIGKILL) after step 7; torchrun restarts both ranks, which resume from step 4. The losses
of steps 5-10 and the final weights must equal an uninterrupted run's bit for bit.

Here, under DDP, one kill on one node and one on two nodes (agents of one rank each, which disagree on
their restart count), with one uninterrupted reference: about 20 s a launch. The fix is in
process-group set-up, whatever the strategy, and tests/checkpoint/test_checkpoints.py checks exact resume under
every strategy. ``ATORCH_RESTART_RUNS=10`` repeats each single-node kill to show it is not luck,
``ATORCH_RESTART_STRATEGIES=ddp,fsdp,zero1,zero2`` adds strategies (10 of 10 each, measured).
The handshake itself is also tested in threads on a store that holds a dead attempt's keys.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from atorch.distributed.elastic import ATTEMPT_KEY, agree_attempt
from atorch.errors import RankLostError
from atorch.testing.launcher import free_port

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "elastic_restart.py"
STEPS, KILL_STEP, RESUMED_FROM = 10, 7, 4
RUNS = int(os.environ.get("ATORCH_RESTART_RUNS", "1"))
STRATEGIES = os.environ.get("ATORCH_RESTART_STRATEGIES", "ddp").split(",")
TIMEOUT_S = 240


def launch(out: Path, strategy: str, kill_step: int, nodes: int = 1, hold: bool = False) -> None:
    """One torchrun launch of the script on 2 ranks, with one restart allowed: one agent with 2 ranks, or
    ``nodes=2`` agents of 1 rank joined by c10d rendezvous (two "nodes" that count their restarts apart).
    Fails the test on a bad exit or a hang."""
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    where = (["--standalone"] if nodes == 1 else ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                                  f"127.0.0.1:{free_port()}", "--rdzv-id", out.name])
    command = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(2 // nodes),
               "--max-restarts", "1", str(SCRIPT), str(out), strategy, str(kill_step), *(["hold"] if hold else [])]
    logs = [out / f"agent{node}.log" for node in range(nodes)]
    agents = [subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
              for log in logs]
    try:
        codes = [agent.wait(timeout=TIMEOUT_S) for agent in agents]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    if codes != [0] * nodes:
        tail = "\n".join("\n".join(log.read_text().splitlines()[-25:]) for log in logs)
        pytest.fail(f"{strategy} on {nodes} node(s): agent exit codes {codes}:\n{tail}")


def losses(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"losses-{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Callable[[str], tuple[list[dict], dict]]:
    """An uninterrupted run's losses by step (each rank's) and final weights, one launch per strategy."""
    done: dict = {}

    def get(strategy: str) -> tuple[list[dict], dict]:
        if strategy not in done:
            out = tmp_path_factory.mktemp("reference") / strategy
            launch(out, strategy, kill_step=-1)
            done[strategy] = ([{row["step"]: row["loss"] for row in losses(out, rank)} for rank in (0, 1)],
                              torch.load(out / "weights.pt", weights_only=True))
        return done[strategy]

    return get


def check_resumed(out: Path, expected: list[dict], expected_weights: dict, label: str) -> None:
    """Each rank ran steps 1-7, died (rank 1) or was stopped (rank 0), and ran 5-10 again from the step-4
    checkpoint, with the uninterrupted run's losses; the final weights are the uninterrupted run's."""
    for rank in (0, 1):
        rows = losses(out, rank)
        steps = [row["step"] for row in rows]
        assert steps == list(range(1, KILL_STEP + 1)) + list(range(RESUMED_FROM + 1, STEPS + 1)), (label, rank, steps)
        resumed = {row["step"]: row["loss"] for row in rows[KILL_STEP:]}
        assert resumed == {s: expected[rank][s] for s in resumed}, f"{label} rank {rank}: {resumed} vs {expected}"
    weights = torch.load(out / "weights.pt", weights_only=True)
    assert weights.keys() == expected_weights.keys()
    for name, value in weights.items():
        assert torch.equal(value, expected_weights[name]), f"{label}: {name} differs from the uninterrupted run"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_killed_mid_training_resumes_exactly_after_torchrun_restarts_it(tmp_path, reference, strategy):
    expected, expected_weights = reference(strategy)
    for run in range(RUNS):
        out = tmp_path / f"killed-{run}"
        launch(out, strategy, KILL_STEP)
        check_resumed(out, expected, expected_weights, f"{strategy} run {run}")
    print(f"{strategy}: {RUNS} of {RUNS} killed runs resumed exactly")


def test_a_meta_model_loaded_pretrained_resumes_exactly_as_a_normal_build(tmp_path, reference):
    """fsdp on the GPT built on meta, its weights streamed in with load_pretrained, killed at step 7 and
    resumed from the step-4 checkpoint: the losses and final weights of the normal build's run."""
    expected, expected_weights = reference("fsdp")
    out = tmp_path / "killed-meta"
    launch(out, "fsdp_meta", KILL_STEP)
    check_resumed(out, expected, expected_weights, "fsdp_meta")


def test_two_nodes_whose_restart_counts_disagree_resume_exactly(tmp_path, reference):
    """Rank 1's agent counts a restart, rank 0's does not (it restarts its rank because the membership
    changed): the attempt atorch agrees on must not depend on TORCHELASTIC_RESTART_COUNT. Rank 0 holds after
    the kill step so that it cannot fail on its dead peer first (then both agents would count a restart)."""
    expected, expected_weights = reference("ddp")
    out = tmp_path / "killed-two-nodes"
    launch(out, "ddp", KILL_STEP, nodes=2, hold=True)
    check_resumed(out, expected, expected_weights, "two nodes")
    counts = [{row["attempt"] for row in losses(out, rank)[KILL_STEP:]} for rank in (0, 1)]
    assert counts[0] != counts[1], counts  # what this test is about: the agents disagree


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

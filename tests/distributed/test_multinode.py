"""Beyond one machine: two torchrun agents of 2 ranks each on localhost, joined by c10d rendezvous, are two
"nodes" (LOCAL_WORLD_SIZE 2, WORLD_SIZE 4, GROUP_RANK the node). One launch
(tests/distributed/scripts/multinode.py) trains
data parallelism, fsdp, hybrid sharding, tensor x data, pipeline x data and the fully automatic search, each
against the single-process reference on rank 0, and records the process groups each ran with: tensor and shard
groups must stay inside a node, and the search must measure the two links apart and keep tensor groups in a node.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from atorch.testing.launcher import free_port

pytestmark = pytest.mark.multirank

SCRIPT = Path(__file__).parent / "scripts" / "multinode.py"
NODES, PER_NODE = 2, 2
TIMEOUT_S = 240  # the launch takes about 40 s on 2 busy CPU cores
MODEL_PARALLEL_TOL, DATA_PARALLEL_TOL = 1e-4, 1e-5


def _agent(endpoint: str, run_id: str, out: Path, log: Path) -> subprocess.Popen:
    """One torchrun agent (a "node") in its own process group, so a hang can be ended with all its ranks."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "0",
               str(SCRIPT), str(out)]
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _end(agents: list[subprocess.Popen]) -> None:
    """Stop agents still running: SIGTERM first (torchrun then ends its ranks, which run in sessions of their
    own), SIGKILL for the agent's group after a grace period (the ranks also exit once their agent is gone)."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    for agent in agents:
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def launch_two_nodes(out: Path) -> list[dict]:
    """Both agents, killed together on a hang; every rank's JSON record, ordered by rank."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"multinode-{uuid.uuid4().hex[:8]}"
    logs = [out / f"agent{i}.log" for i in range(NODES)]
    agents = [_agent(endpoint, run_id, out, log) for log in logs]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        codes = [agent.wait(timeout=max(deadline - time.monotonic(), 1)) for agent in agents]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        _end(agents)
    output = "\n".join(f"--- agent {i} ---\n" + log.read_text()[-6000:] for i, log in enumerate(logs))
    print(output)
    assert codes is not None, f"the two agents did not finish within {TIMEOUT_S} s\n{output}"
    assert codes == [0, 0], f"agent exit codes {codes}\n{output}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(NODES * PER_NODE)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch_two_nodes(tmp_path_factory.mktemp("multinode"))


def _node(rank: int) -> int:
    return rank // PER_NODE


def test_the_launch_is_two_nodes_of_two_ranks(ranks):
    for record in ranks:
        assert (record["world"], record["local_world"]) == (NODES * PER_NODE, PER_NODE)
        assert record["node"] == _node(record["rank"]), record  # c10d numbers ranks node by node


@pytest.mark.parametrize("case, tolerance", [("dp", DATA_PARALLEL_TOL), ("fsdp", DATA_PARALLEL_TOL),
                                             ("hsdp", DATA_PARALLEL_TOL), ("tensor", MODEL_PARALLEL_TOL),
                                             ("pipeline", MODEL_PARALLEL_TOL), ("search", MODEL_PARALLEL_TOL),
                                             ("search_tensor", MODEL_PARALLEL_TOL)])
def test_losses_match_the_single_process_reference(ranks, case, tolerance):
    run = ranks[0]["cases"][case]
    assert "error" not in run, run["error"]
    if case == "search" and not {"tensor_parallel", "pipeline_parallel", "mixed_parallel"} & set(run["strategy"]):
        tolerance = DATA_PARALLEL_TOL
    assert run["loss_diff"] < tolerance, (case, run["losses"], ranks[0]["reference"])
    for record in ranks[1:]:
        assert record["cases"][case]["losses"] == pytest.approx(run["losses"], rel=tolerance), (case, record["rank"])


def test_tensor_and_shard_groups_stay_inside_a_node(ranks):
    for record in ranks:
        cases = record["cases"]
        for case, dim in (("tensor", "tensor"), ("hsdp", "zero")):
            group = cases[case]["groups"][dim]
            assert len(group) == PER_NODE and {_node(r) for r in group} == {record["node"]}, (case, group)
        for case, dim in (("hsdp", "data"), ("tensor", "data"), ("pipeline", "data")):
            group = cases[case]["groups"][dim]  # replicas: the same local rank on every node
            assert len({_node(r) for r in group}) == NODES and len({r % PER_NODE for r in group}) == 1, (case, group)


def test_the_search_measures_both_links_and_keeps_tensor_groups_in_a_node(ranks):
    found = ranks[0]["cases"]["search"]["search"]
    print(found["table"])
    print(found["links"])
    assert not any("tp4" in label for label in found["labels"]), found["labels"]
    assert any(label.startswith("hsdp2") for label in found["labels"]), found["labels"]  # nodes were detected
    dims = dict(found["parallel_mode"])
    assert dims.get("tensor", 1) <= PER_NODE
    for record in ranks:  # the applied strategy's live groups, whatever was chosen
        for dim in ("tensor", "zero"):
            group = record["cases"]["search"]["groups"].get(dim, [record["rank"]])
            assert {_node(r) for r in group} == {record["node"]}, (dim, group)
    hardware = found["hardware"]
    assert hardware["intra_node_bandwidth"] > 0 and hardware["inter_node_bandwidth"] > 0, hardware
    assert hardware["link_sources"] == {"intra_node": "measured", "inter_node": "measured"}, hardware
    assert "intra-node" in found["table"] and "measured" in found["table"]
    for record in ranks[1:]:
        assert record["cases"]["search"]["strategy"] == ranks[0]["cases"]["search"]["strategy"]


def test_the_search_with_tensor_parallelism_keeps_each_tensor_group_in_a_node(ranks):
    """Every candidate has tensor_parallel: tp4 would span both nodes, so the only sizes are 2 (inside a node), and
    the applied strategy's live tensor groups are a node's ranks. The inter-node bandwidth was given, not measured."""
    found = ranks[0]["cases"]["search_tensor"]["search"]
    print(found["table"])
    assert found["labels"] and all("tp2" in label for label in found["labels"]), found["labels"]
    assert dict(found["parallel_mode"])["tensor"] == PER_NODE, found["parallel_mode"]
    for record in ranks:
        group = record["cases"]["search_tensor"]["groups"]["tensor"]
        assert {_node(r) for r in group} == {record["node"]}, (record["rank"], group)
    hardware = found["hardware"]
    assert hardware["link_sources"] == {"intra_node": "measured", "inter_node": "given"}, hardware
    assert hardware["inter_node_bandwidth"] == 1e9
    assert "inter-node 1 GB/s (given)" in found["table"]

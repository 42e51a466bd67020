"""Topology in the search: tensor groups stay inside a node, and hybrid sharding (fsdp inside a node,
replicated across nodes) is proposed when the network between nodes is the bottleneck. Checked on
the candidate and cost level, with nodes simulated by ``ranks_per_node`` and the two bandwidths."""
from __future__ import annotations

import dataclasses

import torch

from atorch.auto.search.analyser import analyse_model
from atorch.auto.search.candidates import Candidate, SearchSpace, enumerate_candidates
from atorch.auto.search.layouts import layout_facts
from atorch.auto.search.measure import HardwareProfile, VariantProfile
from atorch.auto.search.options import SearchOptions
from atorch.auto.search.topology import Links, Topology, keep_tensor_in_node, topology_estimate, topology_for
from atorch.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=8, n_embd=64)
MIB = 2**20


def _space(world: int, ranks_per_node: int) -> SearchSpace:
    model = GPT(CONFIG)
    profile = analyse_model(model)
    topology = topology_for(world, ranks_per_node)
    profile.layouts = keep_tensor_in_node(layout_facts(model, world), topology)
    return SearchSpace(world, torch.device("cpu"), profile, per_rank_batch=2,
                       ranks_per_node=ranks_per_node if topology.nodes > 1 else 0)


def test_topology_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert topology_for(4) == Topology(2, 2)
    assert topology_for(4, ranks_per_node=4) == Topology(1, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # does not divide: one node
    assert topology_for(4) == Topology(1, 4)
    assert SearchOptions.from_kargs({"ranks_per_node": 2, "inter_node_bandwidth": 1e9}).inter_node_bandwidth == 1e9


def test_tensor_groups_never_span_nodes():
    candidates, skipped = enumerate_candidates(_space(8, 2))
    assert max(c.tensor for c in candidates) == 2
    assert any(c.pipeline > 2 for c in candidates)  # pipeline and data dimensions may cross nodes
    assert "span nodes" in skipped["ddp+fp32+tp4"]
    one_node, _ = enumerate_candidates(_space(8, 8))
    assert max(c.tensor for c in one_node) == 8


def test_hybrid_sharding_is_a_candidate_with_a_zero_by_data_mesh():
    candidates, _ = enumerate_candidates(_space(8, 2))
    hybrid = [c for c in candidates if c.shard]
    assert hybrid and all(c.sharding == "fsdp" and c.shard == 2 and c.tensor * c.pipeline == 1 for c in hybrid)
    mode = hybrid[0].strategy(8).get("parallel_mode")
    assert list(mode[0]) == [("zero", 2), ("data", 4)]
    single, _ = enumerate_candidates(_space(8, 8))
    assert not any(c.shard for c in single)


def _variant() -> VariantProfile:
    return VariantProfile("amp_bf16", False, 2, peak_bytes=600 * MIB, step_time_s=0.5,
                          params=100 * MIB, grads=100 * MIB, optim_state=200 * MIB)


def _times(intra: float, inter: float) -> dict[str, float]:
    space = _space(8, 2)
    hardware = HardwareProfile("sim", 2**34, bandwidth_bytes_per_s=inter)
    topology, links = Topology(4, 2), Links(intra, inter)
    fsdp = Candidate("fsdp", "amp_bf16", block="GPTBlock")
    out = {}
    for candidate in (fsdp, dataclasses.replace(fsdp, shard=2), Candidate("ddp", "amp_bf16")):
        out[candidate.label] = topology_estimate(candidate, _variant(), 8, space.profile, hardware, topology, links)
    return out


def test_hybrid_sharding_wins_when_the_network_is_the_bottleneck():
    slow = _times(intra=100e9, inter=1e9)  # 100x slower between nodes
    assert slow["hsdp2+amp_bf16"].step_time_s < slow["fsdp+amp_bf16"].step_time_s
    assert slow["hsdp2+amp_bf16"].step_time_s < slow["ddp+amp_bf16"].step_time_s
    assert slow["hsdp2+amp_bf16"].memory_bytes > slow["fsdp+amp_bf16"].memory_bytes  # shards over fewer ranks
    flat = _times(intra=10e9, inter=10e9)  # no bottleneck: little to gain, and hybrid costs memory
    gain = {name: t["fsdp+amp_bf16"].step_time_s / t["hsdp2+amp_bf16"].step_time_s for name, t in
            (("slow", slow), ("flat", flat))}
    assert gain["slow"] > 1.2 and gain["flat"] < 1.05, gain


def test_planner_proposes_hybrid_sharding_across_slow_nodes():
    import atorch

    layouts = ["tensor_parallel", "pipeline_parallel", "mixed_parallel"]  # data-parallel plans only
    best = {}
    for network in (2e9, 100e9):
        cluster = {"nodes": 8, "gpus_per_node": 8, "device": {"base": "A100-80GB", "network_bytes_per_s": network}}
        result = atorch.plan("llama3-8b", cluster, global_batch=64, seq_len=4096, excluded=layouts)
        best[network] = result.best.candidate
    assert best[2e9].shard == 8 and list(best[2e9].strategy(64).get("parallel_mode")[0]) == [("zero", 8), ("data", 8)]
    assert best[100e9].shard == 0 and best[100e9].sharding == "fsdp"

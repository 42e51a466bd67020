"""Two torchrun agents x 2 ranks on one machine, each agent a "node": every case of
tests/distributed/test_multinode.py in one
launch (start-up is the slow part), each rank writing ``rank<N>.json`` into the directory given as argv[1].

Rank 0 first trains the single-process reference (before the process group exists); then every rank trains each
case and records its losses, the process groups it ran with and, for the search, what was measured and chosen.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

import atorch
from atorch.distributed import mesh
from atorch.testing.training import relative_difference, train_gpt

SEARCH_EXCLUDED = ["amp_native", "checkpoint", "micro_batch", "native_dynamo", "module_replace", "zero2"]
CASES: dict[str, Any] = {
    "dp": [("parallel_mode", ([("data", 4)], None))],
    "fsdp": [("parallel_mode", ([("data", 4)], None)), "fsdp"],
    "hsdp": [("parallel_mode", ([("zero", 2), ("data", 2)], None)), "fsdp"],
    "tensor": [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel"],
    "pipeline": [("parallel_mode", ([("pipeline", 2), ("data", 2)], None)),
                 ("pipeline_parallel", {"schedule": "GPipe"})],
    "search": None,  # fully automatic
    "search_tensor": None,  # fully automatic, every candidate with tensor_parallel, the inter-node link given
}
SEARCH_KARGS = {"excluded": SEARCH_EXCLUDED, "search_topk": 2, "dryrun_steps": 1, "use_profile_cache": False}
GIVEN_INTER_NODE = 1e9  # bytes/s
CASE_KARGS: dict[str, dict] = {
    "search": SEARCH_KARGS,
    "search_tensor": {**SEARCH_KARGS, "included": ["tensor_parallel"], "inter_node_bandwidth": GIVEN_INTER_NODE},
}


@contextmanager
def alone() -> Iterator[None]:
    """Hide torchrun's RANK / WORLD_SIZE so auto_accelerate trains in this process alone (the reference)."""
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def exit_when_orphaned() -> None:
    """torchrun starts each rank in its own session, so killing a hung agent leaves its ranks behind: a rank
    whose agent is gone exits by itself instead of waiting in a collective for a peer that will never come."""
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(2)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def groups() -> dict[str, list[int]]:
    """This rank's live process group along every dimension of the strategy that ran."""
    config = mesh.parallel_config()
    names = [name for name, _ in config.dims] if config else []
    return {name: mesh.parallel_group_ranks(name) for name in names}


def search_facts(result: Any) -> dict:
    """What the search saw and chose: the rows, the chosen layout, the links it measured or was given."""
    found = result.args.extras["search"]
    hardware = found.hardware
    return {"labels": [row.label for row in found.rows], "table": found.table,
            "statuses": [r.status for r in found.rows],
            "parallel_mode": [list(d) for d in mesh.parallel_config().dims],  # as applied (None in the strategy: data)
            "hardware": {k: v for k, v in vars(hardware).items() if isinstance(v, (int, float, str, dict, type(None)))},
            "links": hardware.describe_links()}


def run_case(name: str, strategy: Any, reference: list[float] | None) -> dict:
    started = time.perf_counter()
    run = train_gpt(strategy, **CASE_KARGS.get(name, {}))
    out = {"losses": run["losses"], "groups": groups(), "strategy": run["strategy"].names(),
           "seconds": time.perf_counter() - started}
    if strategy is None:
        out["search"] = search_facts(run["result"])
    if reference is not None:
        out["loss_diff"] = relative_difference(run["losses"], reference)
    return out


def main(out_dir: Path) -> None:
    exit_when_orphaned()
    rank = int(os.environ["RANK"])
    reference = None
    if rank == 0:
        with alone():
            reference = train_gpt([])["losses"]
    atorch.init_distributed(timeout_s=120)  # a lost peer fails the launch in minutes, not half an hour
    torch.set_num_threads(1)
    record: dict[str, Any] = {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
        "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]), "reference": reference,
        "cases": {},
    }
    for name, strategy in CASES.items():
        try:
            record["cases"][name] = run_case(name, strategy, reference)
        except Exception:  # one broken case must not hide the others' results
            record["cases"][name] = {"error": traceback.format_exc()}
            raise
        finally:
            (out_dir / f"rank{rank}.json").write_text(json.dumps(record, default=str))
        if rank == 0:
            case = record["cases"][name]
            print(f"case {name}: {case['seconds']:.1f} s, loss diff {case.get('loss_diff', 0):.2e}", flush=True)
            if "search" in case:
                print(f"case {name}: chose {'+'.join(case['strategy'])} {case['search']['parallel_mode']}; "
                      f"{case['search']['links']}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

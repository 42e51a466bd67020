"""Iterable (streaming) datasets under data parallelism (issue 23): a torch IterableDataset (an
endless generator of token blocks) and a Hugging Face streaming dataset (``to_iterable_dataset``).

On 2 ranks, semi-automatic (``["parallel_mode", "fsdp"]``, DDP, with and without a dry run) and
fully automatic (the search), with ``num_workers`` 0 and 2: within a step no sample reaches two
ranks and the ranks together use each sample of the one-process global batch once; the losses match
a one-process run on the same global batches (fp32, relative difference < 1e-5). Ranks of one
tensor-parallel group (one data-parallel rank) see the same samples. A run resumed from a
checkpoint trains on the same samples with the same losses as the uninterrupted one. One launch
holds every multi-rank case; the splitting itself is also checked in one process, per rank.
"""
from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
from typing import Any, Iterator, Optional

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import atorch
from atorch.errors import InputError
from atorch.models import gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import SMALL_GPT, build_gpt, global_mean, relative_difference
from atorch.utils.batch import move_to_device
from atorch.utils.data import RankShareCollate, ResumableDataLoader

datasets = pytest.importorskip("datasets")

STEPS, GLOBAL, HF_SAMPLES = 4, 8, 64
FP32_TOL = 1e-5
SMALL_SEARCH = {"excluded": ["amp_native", "half", "checkpoint", "tensor_parallel", "sequence_parallel",
                             "pipeline_parallel", "mixed_parallel"],
                "search_topk": 1, "dryrun_steps": 1, "use_profile_cache": False}


class TokenStream(IterableDataset):
    """An endless stream of token blocks; block i depends on i alone and carries its id. With
    ``worker_aware`` each DataLoader worker yields every num_workers-th block (torch's documented
    pattern), so the workers together yield each block once."""

    def __init__(self, worker_aware: bool = False):
        self.worker_aware = worker_aware

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info() if self.worker_aware else None
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for index in itertools.count(start, step):
            yield token_block(index)


def token_block(index: int) -> dict:
    generator = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, SMALL_GPT.vocab_size, (SMALL_GPT.block_size + 1,), generator=generator)
    return {"id": index, "input_ids": tokens[:-1], "labels": tokens[1:]}


def hf_stream() -> Any:
    """A finite HF streaming dataset in 4 shards, built in memory (nothing is downloaded)."""
    blocks = [token_block(i) for i in range(HF_SAMPLES)]
    columns = {key: [b[key].tolist() if torch.is_tensor(b[key]) else b[key] for b in blocks] for key in blocks[0]}
    return datasets.Dataset.from_dict(columns).to_iterable_dataset(num_shards=4).with_format("torch")


def make_dataset(kind: str) -> IterableDataset:
    return {"torch": TokenStream, "torch_workers": lambda: TokenStream(worker_aware=True), "hf": hf_stream}[kind]()


def prepare_input(batch: dict, device: torch.device) -> dict:
    """The model's input: the ids stay behind."""
    return move_to_device({"input_ids": batch["input_ids"], "labels": batch["labels"]}, device)


# --- the reference: one process, plain torch, the global batch ----------------------------------------
@functools.lru_cache(maxsize=None)
def reference_run(kind: str, num_workers: int = 0, steps: int = STEPS) -> dict:
    """Global batches and losses of a one-process loop with batch_size = the global batch."""
    model = build_gpt(0)
    optim = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loader = DataLoader(make_dataset(kind), batch_size=GLOBAL, num_workers=num_workers)
    ids, losses = [], []
    for batch in itertools.islice(loader, steps):
        ids.append(batch["id"].tolist())
        inputs = prepare_input(batch, torch.device("cpu"))
        loss = gpt_loss(inputs, model(**inputs))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return {"ids": ids, "losses": losses}


# --- on every rank ----------------------------------------------------------------------------------
def accelerate(kind: str, strategy: Any, num_workers: int = 0, **kargs: Any) -> tuple:
    # workers forked as under torchrun (the launcher's ranks are spawned, so their default is spawn,
    # which would import torch again in every worker)
    loader_args = {"batch_size": GLOBAL, "num_workers": num_workers,
                   "multiprocessing_context": "fork" if num_workers else None}
    status, result, chosen = atorch.auto_accelerate(
        build_gpt(0), torch.optim.SGD, make_dataset(kind), gpt_loss, prepare_input=prepare_input,
        model_input_format="unpack_dict", optim_args={"lr": 0.2, "momentum": 0.9},
        dataloader_args=loader_args, load_strategy=strategy, **kargs)
    assert status, "auto_accelerate failed"
    return result, chosen


def train(result: Any, batches: Iterator, steps: int) -> dict:
    """``steps`` steps of the seed's loop; this rank's sample ids and the global mean loss per step."""
    ids, losses = [], []
    for _ in range(steps):
        batch = next(batches)
        ids.append(batch["id"].tolist())
        inputs = result.prepare_input(batch)
        loss = result.loss_func(inputs, result.model(**inputs))
        loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(global_mean(loss.detach().float()))
    return {"ids": ids, "losses": losses}


def run_case(kind: str, strategy: Any, num_workers: int = 0, **kargs: Any) -> dict:
    result, chosen = accelerate(kind, strategy, num_workers, **kargs)
    run = train(result, iter(result.dataloader), STEPS)
    return {**run, "strategy": chosen.names()}


def resume_case(kind: str, strategy: Any, checkpoint: str, num_workers: int = 0) -> dict:
    """Train 2 steps, save, train 2 more (uninterrupted); a new run loads the checkpoint and trains 2."""
    result, _ = accelerate(kind, strategy, num_workers)
    batches = iter(result.dataloader)
    first = train(result, batches, 2)
    atorch.save_checkpoint(checkpoint, result, step=2)
    uninterrupted = train(result, batches, 2)
    del batches
    resumed_result, _ = accelerate(kind, strategy, num_workers)
    assert atorch.load_checkpoint(checkpoint, resumed_result)["step"] == 2
    resumed = train(resumed_result, iter(resumed_result.dataloader), 2)
    return {"first": first, "uninterrupted": uninterrupted, "resumed": resumed}


CASES = {
    "torch_fsdp": ("torch", ["parallel_mode", "fsdp"], 0, {"ignore_dryrun_on_load_strategy": False}),
    "torch_workers_ddp": ("torch_workers", ["parallel_mode"], 2, {}),
    "torch_search": ("torch", None, 0, SMALL_SEARCH),
    "hf_fsdp": ("hf", ["parallel_mode", "fsdp"], 0, {}),
    "hf_workers_fsdp": ("hf", ["parallel_mode", "fsdp"], 2, {"ignore_dryrun_on_load_strategy": False}),
    "hf_search": ("hf", None, 0, SMALL_SEARCH),
    "torch_tensor_parallel": ("torch", [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"], 0, {}),
}
RESUME_CASES = {
    "resume_torch_fsdp": ("torch", ["parallel_mode", "fsdp"], 0),
    "resume_hf_workers_ddp": ("hf", ["parallel_mode"], 2),
}


def launch(checkpoint_dir: str, keys: Optional[list] = None) -> dict:
    allow_worker_processes()
    out = {}
    for key, (kind, strategy, workers, kargs) in CASES.items():
        if keys is None or key in keys:
            out[key] = run_case(kind, strategy, workers, **kargs)
    for key, (kind, strategy, workers) in RESUME_CASES.items():
        if keys is None or key in keys:
            out[key] = resume_case(kind, strategy, os.path.join(checkpoint_dir, key), workers)
    return out


def allow_worker_processes() -> None:
    """The launcher's ranks are daemonic processes (they end with the test), and multiprocessing
    refuses children to those; DataLoader workers end with their loader and watch their parent."""
    multiprocessing.current_process()._config["daemon"] = False


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_distributed(launch, 2, str(tmp_path_factory.mktemp("streaming")), timeout_s=600)


def assert_split(per_rank: list[dict], reference_ids: list[list[int]], label: str, split: bool = True) -> None:
    """Each step: the ranks' ids are disjoint and together the one-process global batch (``split``),
    or every rank has the whole global batch (one data-parallel rank)."""
    for step, global_ids in enumerate(reference_ids):
        seen = [rank["ids"][step] for rank in per_rank]
        if not split:
            assert all(ids == global_ids for ids in seen), f"{label}, step {step}: {seen} vs {global_ids}"
            continue
        flat = [i for ids in seen for i in ids]
        assert len(flat) == len(set(flat)), f"{label}, step {step}: a sample reached two ranks: {seen}"
        assert flat == global_ids, f"{label}, step {step}: ranks saw {seen}, one process {global_ids}"


def assert_losses(run: dict, reference: dict, label: str) -> None:
    diff = relative_difference(run["losses"], reference["losses"])
    assert diff < FP32_TOL, f"{label}: losses differ by {diff:.2e}\n{run['losses']}\n{reference['losses']}"


@pytest.mark.multirank
@pytest.mark.parametrize("key", list(CASES))
def test_two_ranks_split_every_global_batch(two_ranks, key):
    kind, strategy, workers, _ = CASES[key]
    reference = reference_run(kind, workers)
    per_rank = [rank[key] for rank in two_ranks]
    assert_split(per_rank, reference["ids"], key, split=key != "torch_tensor_parallel")
    for rank, run in enumerate(per_rank):
        assert_losses(run, reference, f"{key}, rank {rank}")
    if strategy is None:  # the search chose a strategy that ran
        assert "parallel_mode" in per_rank[0]["strategy"], per_rank[0]["strategy"]


@pytest.mark.multirank
@pytest.mark.parametrize("key", list(RESUME_CASES))
def test_resumed_stream_matches_the_uninterrupted_run(two_ranks, key):
    kind, _, workers = RESUME_CASES[key]
    reference = reference_run(kind, workers)
    per_rank = [rank[key] for rank in two_ranks]
    for phase, steps in (("first", slice(0, 2)), ("uninterrupted", slice(2, 4)), ("resumed", slice(2, 4))):
        assert_split([rank[phase] for rank in per_rank], reference["ids"][steps], f"{key} {phase}")
    for rank, run in enumerate(per_rank):
        assert run["resumed"]["ids"] == run["uninterrupted"]["ids"], f"{key}, rank {rank}"
        assert run["resumed"]["losses"] == run["uninterrupted"]["losses"], f"{key}, rank {rank}"
        assert_losses({"losses": run["first"]["losses"] + run["resumed"]["losses"]}, reference, f"{key}, rank {rank}")


# --- one process: the split of each rank, the last global batch, refused inputs --------------------
def rank_loader(dataset: IterableDataset, rank: int, batch_size: int = GLOBAL, **args: Any) -> ResumableDataLoader:
    """The loader auto_accelerate builds on data-parallel rank ``rank`` of 2."""
    return ResumableDataLoader(dataset, batch_size=batch_size, collate_fn=RankShareCollate(None, rank, 2), **args)


@pytest.mark.parametrize("kind, workers", [("torch_workers", 2), ("hf", 0)])
def test_each_rank_collates_its_contiguous_share_of_every_global_batch(kind, workers):
    reference = reference_run(kind, workers)["ids"]
    args = {"num_workers": workers, "multiprocessing_context": "fork" if workers else None}
    shares = [[batch["id"].tolist() for batch in itertools.islice(rank_loader(make_dataset(kind), rank, **args), STEPS)]
              for rank in (0, 1)]
    for step, global_ids in enumerate(reference):
        assert shares[0][step] == global_ids[:4] and shares[1][step] == global_ids[4:]


def test_a_last_global_batch_that_does_not_divide_is_dropped_and_logged(caplog):
    class Finite(IterableDataset):
        def __init__(self, count: int):
            self.count = count

        def __iter__(self):
            return (token_block(i) for i in range(self.count))

    # 8 + 4 samples: the last global batch (4) divides over 2 ranks: 2 each, as one process would train on it
    assert [len(b["id"]) for b in rank_loader(Finite(12), 1)] == [4, 2]
    with caplog.at_level("WARNING"):
        assert [b["id"].tolist() for b in rank_loader(Finite(11), 1)] == [[4, 5, 6, 7]]  # 3 left: dropped
    assert "last global batch has 3 sample(s)" in caplog.text


def test_an_iterable_dataset_refuses_what_would_split_it_twice():
    from datasets.distributed import split_dataset_by_node
    from torch.utils.data.distributed import DistributedSampler

    common = dict(optim_func=torch.optim.SGD, loss_func=gpt_loss, prepare_input=prepare_input,
                  model_input_format="unpack_dict", optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
                  load_strategy=[])
    with pytest.raises(InputError, match="already split by node"):
        atorch.auto_accelerate(build_gpt(0), dataset=split_dataset_by_node(hf_stream(), rank=0, world_size=2),
                               **common)
    with pytest.raises(InputError, match="distributed_sampler_cls does not apply to an IterableDataset"):
        atorch.auto_accelerate(build_gpt(0), dataset=TokenStream(), distributed_sampler_cls=DistributedSampler,
                               **common)

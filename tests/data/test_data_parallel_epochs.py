"""A map-style dataset's epochs under data parallelism, as the loader auto_accelerate returns reads them.

Each epoch draws a new order, as one process's ``shuffle=True`` does: its ``DistributedSampler`` moves
on by ``set_epoch`` each time the loop starts iterating it again (the user's loop never sees the
sampler); those tests need no process group (each rank's loader built as atorch builds it). And no
sample is trained twice in an epoch: the last samples that do not divide over the processes are left
out (2 gloo ranks)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from atorch.testing import run_distributed
from atorch.utils.data import ResumableDataLoader

ROWS = 16


def _loader(rank: int) -> ResumableDataLoader:
    rows = [torch.tensor([float(i)]) for i in range(ROWS)]
    return ResumableDataLoader(rows, batch_size=4, sampler=DistributedSampler(rows, num_replicas=2, rank=rank,
                                                                              shuffle=True))


def _epoch(loader: ResumableDataLoader) -> list[int]:
    return [int(v) for batch in loader for v in batch.flatten()]


def test_every_epoch_draws_a_new_order_that_the_ranks_share_out():
    """Before, every epoch repeated the first one's order (the sampler's epoch stayed 0)."""
    loaders = [_loader(0), _loader(1)]
    epochs = [[_epoch(loader) for loader in loaders] for _ in range(3)]
    for ranks in epochs:
        assert sorted(ranks[0] + ranks[1]) == list(range(ROWS))  # each row once per epoch, over both ranks
    assert epochs[0][0] != epochs[1][0] and epochs[1][0] != epochs[2][0], epochs
    assert [loader.sampler.epoch for loader in loaders] == [2, 2]


def test_an_epoch_the_user_sets_is_kept():
    """``loader.sampler.set_epoch(e)`` in the user's loop, as with a plain DistributedSampler, wins."""
    loader, other = _loader(0), _loader(0)
    loader.sampler.set_epoch(7)
    first = _epoch(loader)
    other.sampler.set_epoch(7)
    assert first == _epoch(other) and loader.sampler.epoch == 7
    loader.sampler.set_epoch(7)  # the same epoch again: the same order
    assert _epoch(loader) == first
    assert _epoch(loader) != first and loader.sampler.epoch == 2  # left alone: the loader's count again


def test_a_resumed_epoch_continues_its_own_order():
    """Saved one batch into the second epoch (of two batches a rank), a new loader resumes that epoch's
    order where it was, and the epoch after it is the uninterrupted run's third."""
    whole = _loader(0)
    uninterrupted = [_epoch(whole) for _ in range(3)]
    run = _loader(0)
    _epoch(run)
    iterator = iter(run)
    seen = [int(v) for v in next(iterator).flatten()]
    resumed = _loader(0)
    resumed.resume_from(run.position())
    assert seen + _epoch(resumed) == uninterrupted[1]
    assert _epoch(resumed) == uninterrupted[2]


def _epoch_rows(rows: int, drop_last: bool) -> list[list[list[int]]]:
    """Each rank's batches of one epoch over ``rows`` numbered rows, data parallel over the ranks."""
    from atorch.auto import auto_accelerate

    data = [{"x": torch.tensor([float(i)])} for i in range(rows)]
    _, result, _ = auto_accelerate(nn.Linear(1, 1), torch.optim.SGD, data, lambda batch, output: output.sum(),
                                   optim_args={"lr": 0.0}, dataloader_args={"batch_size": 4, "drop_last": drop_last},
                                   load_strategy=["parallel_mode"])
    return [[int(v) for v in batch["x"].flatten()] for batch in result.dataloader]


def _every_case() -> dict:
    return {(rows, drop_last): _epoch_rows(rows, drop_last) for rows in (17, 18) for drop_last in (False, True)}


@pytest.mark.multirank
def test_no_sample_is_trained_twice_in_an_epoch():
    """17 rows over 2 processes: DistributedSampler padded the epoch to 18 by repeating row 0, so the
    last global batch was [16, 0] where one process trains [16] (row 0 twice an epoch, silently). Now
    row 16, which does not divide over the 2 processes, is left out of the epoch (logged); 18 rows
    train as one process does, the last global batch [16, 17] split one row each."""
    ranks = run_distributed(_every_case, 2)
    for (rows, drop_last), _ in ranks[0].items():
        seen = [row for rank in ranks for batch in rank[rows, drop_last] for row in batch]
        assert len(seen) == len(set(seen)), (rows, drop_last, seen)
        # drop_last (the loader's): a rank's last batch of 1 of 2 rows is dropped too
        assert sorted(seen) == list(range(18 if (rows, drop_last) == (18, False) else 16)), (rows, drop_last)
    assert ranks[0][17, False] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    assert ranks[1][18, False] == [[1, 3], [5, 7], [9, 11], [13, 15], [17]]

"""The loader auto_accelerate returns draws a new order every epoch under data parallelism, as one
process's ``shuffle=True`` does: its ``DistributedSampler`` moves on by ``set_epoch`` each time the
loop starts iterating it again (the user's loop never sees the sampler). No process group: each
rank's loader is built as atorch builds it (``num_replicas`` / ``rank`` given)."""
from __future__ import annotations

import torch
from torch.utils.data.distributed import DistributedSampler

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

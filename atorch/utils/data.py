"""The dataloader auto_accelerate returns: a DataLoader that knows where it is in its epoch.

A resumed run must see the batches it would have seen. ``ResumableDataLoader`` counts the batches
each iterator has yielded and keeps the torch RNG state its current iterator started from (a
shuffling sampler draws its permutation seed from that generator when the iterator is made).
``position()`` is what a checkpoint stores; after ``resume_from(position)`` the next ``iter()``
makes the same permutation and skips the batches already consumed, without loading them when it
can (single-process loading of a map-style dataset skips sampler indices only).

An ``IterableDataset`` has no sampler to shard it. Under data parallelism every process reads the
same stream in whole global batches (the loader's ``batch_size`` is the global batch), exactly the
batches one process would read with the same arguments, ``num_workers`` included, and
``RankShareCollate`` keeps and collates only this process's contiguous share of each. So each
sample of a global batch goes to exactly one process, processes of one tensor / pipeline group
(one data-parallel rank) get the same share, and the union over processes is the one-process
global batch: losses match a one-process run. A resumed epoch skips the consumed global batches
as for map-style data (reading them again: a stream cannot seek).
"""
from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import logging
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate

logger = logging.getLogger(__name__)


def encode_rng(state: torch.Tensor) -> str:
    """A torch RNG state (uint8 tensor) as base64 text, for JSON files."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


class IncompleteGlobalBatch:
    """What ``RankShareCollate`` returns for a stream's last global batch when its samples do not
    divide over the data-parallel processes: the loader drops it (logged) rather than train some
    processes on fewer samples, or none, which would leave the others waiting in a collective."""

    def __init__(self, samples: int, size: int):
        self.samples = samples
        self.size = size


class RankShareCollate:
    """``collate_fn`` of an IterableDataset's loader under data parallelism (see the module
    docstring): given the samples of one global batch, collates this data-parallel rank's
    contiguous share with the user's ``collate_fn`` (torch's ``default_collate`` when None).
    A module-level class, so worker processes can unpickle it."""

    def __init__(self, collate_fn: Optional[Callable[[list], Any]], rank: int, size: int):
        self.collate_fn = collate_fn or default_collate
        self.rank = rank
        self.size = size

    def __call__(self, samples: list) -> Any:
        share, extra = divmod(len(samples), self.size)
        if extra or not share:
            return IncompleteGlobalBatch(len(samples), self.size)
        return self.collate_fn(samples[self.rank * share:(self.rank + 1) * share])


def _from_first_rank(state: torch.Tensor, group: Any) -> torch.Tensor:
    """``group``'s first rank's ``state`` (a CPU generator state), carried through CUDA where the group's
    backend is nccl."""
    cuda = dist.get_backend(group) == "nccl"
    carried = state.to(torch.device("cuda", torch.cuda.current_device())) if cuda else state.clone()
    dist.broadcast(carried, src=dist.get_global_rank(group, 0), group=group)
    return carried.cpu()


def _noting_calls(set_epoch: Callable[[int], None], loader: "ResumableDataLoader") -> Callable[[int], None]:
    """The sampler's ``set_epoch``, telling ``loader`` when the user calls it (the loader calls the
    sampler's own)."""
    @functools.wraps(set_epoch)
    def user_set_epoch(epoch: int) -> None:
        loader._user_set_epoch = True
        set_epoch(epoch)

    return user_set_epoch


class ResumableDataLoader(DataLoader):
    """A torch DataLoader (``isinstance(..., DataLoader)`` holds) whose position can be saved and
    restored; see the module docstring. Iterate it as usual."""

    def __init__(self, *args: Any, same_batch_groups: Sequence[Any] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        # process groups whose ranks read the same batches (tensor, pipeline): see _drawing_as_first_rank
        self.same_batch_groups = tuple(same_batch_groups)
        self.iterations = 0        # how many iterators were made (epochs started)
        self.consumed = 0          # batches the latest iterator yielded
        self.rng_at_iter: Optional[torch.Tensor] = None  # torch RNG state when the latest iterator was made
        self._resume: Optional[dict] = None
        self._user_set_epoch = False  # the user called the sampler's set_epoch since the last iterator
        self._set_epoch = getattr(self.sampler, "set_epoch", None)  # the sampler's own, for this loader's calls
        if self._set_epoch is not None:
            self.sampler.set_epoch = _noting_calls(self._set_epoch, self)

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        self._next_epoch()
        with self._drawing_as_first_rank():
            current = torch.get_rng_state()
            if resume is not None and resume.get("rng_at_iter") is not None:
                torch.set_rng_state(resume["rng_at_iter"])  # the permutation of the interrupted epoch
            self.rng_at_iter = torch.get_rng_state()
            iterator = super().__iter__()
            self._start_sampler(iterator)
            if resume is not None and resume.get("rng_at_iter") is not None:
                torch.set_rng_state(current)  # the training RNG continues from the checkpoint's state
        self.iterations += 1
        self.consumed = 0
        skip = resume["consumed"] if resume is not None else 0
        return self._counted(iterator, skip)

    def _next_epoch(self) -> None:
        """A data-parallel sampler (``DistributedSampler``) shuffles by its seed and its epoch, which
        only ``set_epoch`` moves: left alone, every epoch would repeat the first one's order, where one
        process's ``shuffle=True`` draws a new order each epoch. The user's loop never sees the sampler,
        so each new iterator sets the epoch to the number of iterators made before it, unless the user
        called ``loader.sampler.set_epoch`` since the last one (as with a plain DistributedSampler):
        their epoch is kept."""
        if self._user_set_epoch or self._set_epoch is None:
            self._user_set_epoch = False
            return
        self._set_epoch(self.iterations)

    def _start_sampler(self, iterator: Any) -> None:
        """Draw the first indices now: a shuffling sampler takes its seed from the torch RNG on its
        first ``next``, which must see ``rng_at_iter`` (with workers, the iterator prefetched already)."""
        sampler_iter = getattr(iterator, "_sampler_iter", None)
        if self.num_workers != 0 or sampler_iter is None:
            return
        try:
            first = next(sampler_iter)
        except StopIteration:
            return
        iterator._sampler_iter = itertools.chain([first], sampler_iter)

    @contextlib.contextmanager
    def _drawing_as_first_rank(self) -> Iterator[None]:
        """Ranks that read the same batches (a tensor group, a pipeline's stages) must make the same
        random draws while reading them: a collator's random masking (BERT's masked-token collator),
        a dataset's random crops, the workers' seeds drawn when an iterator is made. Their own streams
        differ (each pipeline stage draws its own layers' dropout; a script may seed each process
        apart), and a last stage scoring labels masked otherwise than the first stage's inputs would
        train on a wrong target with no error. So these draws are made from the torch generator state
        of the first rank of each group (one broadcast of a few kilobytes each), and every other rank
        takes its own state back after: the first rank's stream runs as in one process."""
        if not self.same_batch_groups:
            yield
            return
        own = torch.get_rng_state()
        agreed = own
        for group in self.same_batch_groups:
            agreed = _from_first_rank(agreed, group)
        first = all(dist.get_rank(group) == 0 for group in self.same_batch_groups)
        torch.set_rng_state(agreed)
        try:
            yield
        finally:
            if not first:
                torch.set_rng_state(own)

    def _fetched(self, iterator: Any) -> Iterator[Any]:
        """``iterator``'s batches, each read under ``_drawing_as_first_rank``."""
        while True:
            with self._drawing_as_first_rank():
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch

    def _counted(self, iterator: Any, skip: int) -> Iterator[Any]:
        self._skip(iterator, skip)
        self.consumed = skip
        for batch in self._fetched(iterator):
            if isinstance(batch, IncompleteGlobalBatch):
                logger.warning("the stream's last global batch has %d sample(s), which do not divide over the %d "
                               "data-parallel processes: dropped (a one-process run would train on it)",
                               batch.samples, batch.size)
                continue
            self.consumed += 1
            yield batch

    def _skip(self, iterator: Any, count: int) -> None:
        """Advance past ``count`` batches; by sampler indices only when no worker prefetched data."""
        if count <= 0:
            return
        sampler_iter = getattr(iterator, "_sampler_iter", None)
        if self.num_workers == 0 and not isinstance(self.dataset, IterableDataset) and sampler_iter is not None:
            for _ in range(count):
                next(sampler_iter)
            iterator._num_yielded += count
            return
        for _ in range(count):
            with self._drawing_as_first_rank():
                next(iterator)

    # --- checkpoints ---------------------------------------------------------------------------------
    def position(self) -> dict:
        """Where this loader is: JSON-able, plus ``rng_at_iter`` (this rank's, a tensor or None)."""
        sampler = self.sampler
        return {"iterations": self.iterations, "consumed": self.consumed,
                "sampler_epoch": getattr(sampler, "epoch", None), "rng_at_iter": self.rng_at_iter}

    def resume_from(self, position: dict) -> None:
        """The next ``iter()`` continues the saved epoch: same permutation, consumed batches skipped.
        A saved epoch that was complete starts the next one normally."""
        self.iterations = int(position.get("iterations", 0))
        if position.get("sampler_epoch") is not None and self._set_epoch is not None:
            self._set_epoch(int(position["sampler_epoch"]))
        consumed = int(position.get("consumed", 0))
        try:
            complete = consumed >= len(self)
        except TypeError:  # no __len__: resume mid-epoch
            complete = False
        self._resume = None if complete or consumed == 0 and self.iterations == 0 else {
            "consumed": consumed, "rng_at_iter": position.get("rng_at_iter")}
        self.iterations -= 1 if self._resume is not None else 0

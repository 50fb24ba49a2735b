"""The training order of map-style datasets, resumable part-way through an epoch, and the seeds of
each example's random draws (augmentation), so a resumed run replays them too."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler, IterableDataset, get_worker_info

from attnlab.core.errors import ConfigError

Key = tuple[int, int]  # (epoch, index): what ResumableSampler yields


def example_seed(seed: int, key: int | Key) -> int | None:
    """The seed of an example's draws in a training epoch, from ``(seed, epoch, index)`` alone (not
    which worker reads it: a resumed run's workers start afresh); ``None`` for a plain index (eval)."""
    if isinstance(key, int):
        return None
    epoch, index = key
    return ((seed * 1_000_003 + epoch) * 1_000_003 + index) % 2**63


def carve(n: int, sizes: list[int | float], seed: int, key: str = "data.source.val_size") -> list[list[int]]:
    """Indices ``0..n-1`` in a seeded order, cut into the held-out ``sizes`` (counts, or shares of
    ``n``) and the rest (last)."""
    sizes = [s if isinstance(s, int) else int(n * s) for s in sizes]
    held = sum(sizes)
    if held >= n:
        raise ConfigError(f"{key} ({held}) must be smaller than the {n} examples it is carved from")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    cuts = list(itertools.accumulate([0, *sizes]))
    return [order[a:b] for a, b in itertools.pairwise(cuts)] + [order[held:]]


@contextmanager
def seeded_globals(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's global generators seeded for a block, then put back as they
    were: for library transforms (timm's RandAugment) that draw from the global generators."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class BatchStream(IterableDataset):
    """Endless seeded batches, ``batch(n)`` drawn from a generator seeded by ``(seed, n)``: ranks and
    workers interleave the numbers ``n`` from the ``start``-th on, so each is drawn once and a
    resumed run (``start``: the batches it had consumed) sees the uninterrupted run's batches."""

    start = 0

    def batch(self, index: int) -> Any:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        for n in itertools.count(self.start + worker, n_workers):
            yield self.batch(n * world + rank)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler``'s permutation per ``(seed, epoch)`` as ``(epoch, index)`` keys (the
    examples' draws are seeded by them), able to start part-way through an epoch (``resume``)."""

    def __init__(self, n: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(
            range(n), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self._start: dict[int, int] = {}  # epoch -> samples of it already seen

    def resume(self, batches_consumed: int, batch_size: int) -> None:
        """Start after ``batches_consumed`` batches (of ``batch_size``, incomplete ones dropped)."""
        per_epoch = len(self) // batch_size
        if per_epoch and batches_consumed:
            epoch, done = divmod(batches_consumed, per_epoch)
            # the epoch is set here too: a loader with workers draws its first indices when its
            # iterator is made, which a resumed run does before Lightning's set_epoch
            self.set_epoch(epoch)
            self._start = {epoch: done * batch_size}

    def __iter__(self) -> Iterator[Key]:
        # a generator: the epoch is read at the first index, after Lightning's set_epoch
        order = list(super().__iter__())
        epoch = self.epoch
        yield from ((epoch, i) for i in order[self._start.pop(epoch, 0) :])

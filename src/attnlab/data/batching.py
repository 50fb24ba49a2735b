"""Batches shared out between processes so each runs as many steps and evaluation scores every
example once (text training too: similar-length sequences under a token budget)."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler


class RepeatedBatch(list):
    """An evaluation batch repeated only so that every process runs as many steps (not to be scored)."""


class TokenBatchSampler(DistributedSampler):
    """Batches of similar-length examples of at most ``max_tokens`` tokens (with padding), shared out
    between ``num_replicas`` processes, each as many batches (under DDP an extra step would hang in the
    others' collectives). Every process builds the same list from ``(seed, epoch)``: sorted by length
    (with noise when shuffling), cut, shuffled; rank ``r`` takes batches ``r, r + num_replicas, ...``.
    Training pads the list by repeating its first batches; evaluation halves its largest batches
    instead, repeating (``RepeatedBatch``, skipped by the task) only where it cannot. A
    ``DistributedSampler`` so Lightning leaves it alone and calls ``set_epoch``."""

    def __init__(
        self,
        lengths: list[int] | np.ndarray,
        max_tokens: int,
        shuffle: bool,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(
            range(len(lengths)), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
        )
        self.lengths, self.max_tokens = lengths, max_tokens
        self._cache: tuple[int, list[list[int]]] | None = None
        self._start: dict[int, int] = {}  # epoch -> its batches already seen (a resumed run)

    def global_batches(self) -> list[list[int]] | list[np.ndarray]:
        """The batches of all processes for this epoch, before padding (for lengths in a numpy
        array, millions of pairs read from shards: each batch a view of one index array)."""
        n = len(self.lengths)
        if isinstance(self.lengths, np.ndarray):
            rng = np.random.default_rng(self.seed + self.epoch)
            noise = rng.random(n) if self.shuffle else np.zeros(n)
        else:
            rng = random.Random(self.seed + self.epoch)
            noise = np.array([rng.random() if self.shuffle else 0.0 for _ in self.lengths])
        lengths = np.asarray(self.lengths, dtype=np.int64)
        order = np.lexsort((np.arange(n), lengths + noise))
        longest = lengths[order]  # non-decreasing: a batch's longest example is its last
        cuts, start = [], 0
        while start < n:  # the first position whose example would break the budget
            end = bisect.bisect_right(
                range(start, n), self.max_tokens, key=lambda q: longest[q] * (q - start + 1)
            )
            start = start + max(end, 1)
            cuts.append(start)
        batches = np.split(order, cuts[:-1]) if n else []
        if isinstance(rng, random.Random):
            batches = [b.tolist() for b in batches]
            if self.shuffle:
                rng.shuffle(batches)
        elif self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def _shard(self) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        batches, w = self.global_batches(), self.num_replicas
        if not batches:
            return []
        if not self.shuffle:
            while len(batches) % w and max(map(len, batches)) > 1:
                i = max(range(len(batches)), key=lambda j: len(batches[j]))  # the first largest
                half = len(batches[i]) // 2
                batches[i : i + 1] = [batches[i][:half], batches[i][half:]]
        missing = -len(batches) % w
        repeat = list if self.shuffle else RepeatedBatch
        batches = batches + [repeat(batches[k % len(batches)]) for k in range(missing)]
        shard = batches[self.rank :: w]
        self._cache = (self.epoch, shard)
        return shard

    def resume(self, batches_consumed: int) -> None:
        """Start after ``batches_consumed`` batches of this process, counted from epoch 0 (epochs
        differ in their number of batches), so a resumed run sees the batches the uninterrupted
        one would have."""
        epoch, left = 0, batches_consumed
        while left:
            self.epoch = epoch
            n = len(self._shard())
            if n == 0 or left < n:
                break
            epoch, left = epoch + 1, left - n
        # the epoch stays set: a loader with workers draws its first batches when its iterator is
        # made, which a resumed run does before Lightning's set_epoch
        self.epoch, self._start = epoch, ({epoch: left} if left else {})

    def __iter__(self) -> Iterator[list[int]]:
        # a generator: the epoch is read at the first batch, after Lightning's set_epoch (a resumed
        # run's loader makes its iterator, and with batch_size=None calls this, before that)
        yield from self._shard()[self._start.pop(self.epoch, 0) :]

    def batch(self, k: int) -> list[int]:
        """This process's ``k``-th batch of the current epoch."""
        return self._shard()[k]

    def __len__(self) -> int:
        return len(self._shard())


def pad(seqs: list[list[int]], pad_id: int) -> Tensor:
    """(B, T) ids, padded to the longest. (Not to a multiple of 8: the extra padding costs more
    than the shapes save; benchmarks/RESULTS.md.)"""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


class Batches(Dataset):
    """A split indexed by whole batches: ``dataset[[i, j]]`` is ``collate`` of those indices;
    ``dataset[k]`` the sampler's ``k``-th batch (what Lightning's ``overfit_batches`` asks for)."""

    def __init__(self, collate: Callable[[list[int]], Any], sampler: TokenBatchSampler) -> None:
        self.collate, self.sampler = collate, sampler

    def __getitem__(self, idx: list[int] | int) -> dict[str, Any]:
        if isinstance(idx, int):
            idx = self.sampler.batch(idx)
        return self.collate(idx)

    def __len__(self) -> int:
        return len(self.sampler)


def collate_examples(dataset: Dataset, collate_fn: Callable[[list[Any]], Any], idx: list[int]) -> Any:
    """``collate_fn`` of ``dataset``'s examples at ``idx`` (module-level: loader workers unpickle it)."""
    return collate_fn([dataset[i] for i in idx])

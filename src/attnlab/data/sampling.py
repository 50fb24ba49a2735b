"""The training order of map-style datasets, resumable part-way through an epoch."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """A permutation per epoch seeded by ``(seed, epoch)`` (``DistributedSampler``'s), shared out
    between ``num_replicas`` processes, that can start part-way through an epoch.

    ``resume(batches_consumed, batch_size)`` with what a checkpoint's run had consumed makes the
    epoch it was in start at the next batch, so a resumed run sees exactly the batches the
    uninterrupted one would have. A ``DistributedSampler`` for Lightning's sake: it leaves the loader
    alone (no sampler injection) and calls ``set_epoch`` at every epoch. With the defaults (one
    process) it needs no process group.
    """

    def __init__(self, n: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(n), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                         drop_last=True)
        self._start: dict[int, int] = {}  # epoch -> samples of it already seen

    def resume(self, batches_consumed: int, batch_size: int) -> None:
        """Start after ``batches_consumed`` batches (of ``batch_size``, incomplete ones dropped)."""
        per_epoch = len(self) // batch_size
        if per_epoch and batches_consumed:
            epoch, done = divmod(batches_consumed, per_epoch)
            self._start = {epoch: done * batch_size}

    def __iter__(self) -> Iterator[int]:
        # a generator: the epoch is read at the first index, after Lightning's set_epoch
        order = list(super().__iter__())
        yield from order[self._start.pop(self.epoch, 0) :]

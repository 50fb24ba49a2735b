"""What every attnlab DataModule declares beyond Lightning's hooks, so train, eval and every
inference CLI handle text, images and image-text pairs the same way."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from attnlab.core.errors import DataError
from attnlab.data.batching import Batches, TokenBatchSampler, collate_examples
from attnlab.data.sampling import ResumableSampler


class DataModule(L.LightningDataModule):
    """A LightningDataModule that can describe and rebuild its data side.

    - ``model_kwargs()``: model constructor arguments the data decides, filled into the ``???``
      fields of ``model.net``; nested for models made of parts, e.g.
      ``{"vocab_size": 8000}`` or ``{"text": {"vocab_size": 8000}}``.
    - ``artifacts()``: what inference needs to rebuild the data side without the training data,
      as JSON-able values (a tokenizer for text; class names, image size and normalisation for
      images; both for image-text). Stored in every checkpoint.
    - ``load_artifacts(artifacts)``: use them instead of fitting anew (resuming, eval, inference).

    The training batches consumed travel in the checkpoint (``state_dict``), so a resumed run's
    training loader can continue with the batch the interrupted run would have seen next
    (``train_batches_consumed``).
    """

    train_batches_consumed = 0

    def state_dict(self) -> dict[str, int]:
        trainer = self.trainer
        consumed = trainer.global_step * trainer.accumulate_grad_batches if trainer else 0
        return {"train_batches_consumed": consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.train_batches_consumed = int(state.get("train_batches_consumed", 0))

    def model_kwargs(self) -> dict[str, Any]:
        return {}

    def artifacts(self) -> dict[str, Any]:
        return {}

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        pass

    def train_sampler(self, n: int, batch_size: int, seed: int) -> ResumableSampler:
        """The training order of ``n`` examples on this process, starting after the batches a
        resumed run's checkpoint had consumed."""
        rank, world = self.rank_world()
        sampler = ResumableSampler(n, seed, world, rank)
        sampler.resume(self.train_batches_consumed, batch_size)
        return sampler

    def eval_sampler(self, lengths: list[int], max_tokens: int, split: str) -> TokenBatchSampler:
        """This process's batches of an evaluation split, in order: every example scored once in
        all, every process as many steps (``TokenBatchSampler``). A split with fewer examples than
        processes cannot be shared out without repeating some, and is refused."""
        rank, world = self.rank_world()
        if len(lengths) < world:
            raise DataError(
                f"the {split} split has {len(lengths)} examples, fewer than the {world} processes "
                "that evaluate it: add examples or run fewer processes"
            )
        return TokenBatchSampler(lengths, max_tokens, shuffle=False, num_replicas=world, rank=rank)

    def eval_loader(
        self,
        dataset: Dataset,
        batch_size: int,
        split: str,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        num_workers: int = 0,
    ) -> DataLoader:
        """Batches of ``batch_size`` examples of a map-style split, in order, shared out as
        ``eval_sampler`` does. (Lightning's ``DistributedSampler`` would pad the split with
        copies of its first examples, which every metric would then count twice.)"""
        sampler = self.eval_sampler([1] * len(dataset), batch_size, split)
        return DataLoader(
            Batches(partial(collate_examples, dataset, collate_fn), sampler),
            sampler=sampler,
            batch_size=None,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            # its own generator: starting its workers draws nothing from the global one (which a
            # resumed run restores, and which an evaluation must leave where training had it)
            generator=torch.Generator().manual_seed(0),
        )

    def rank_world(self) -> tuple[int, int]:
        """This process's rank and the number of processes (the trainer's, else torch.distributed's),
        for samplers that shard batches themselves."""
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

"""What every attnlab DataModule declares beyond Lightning's hooks, so train, eval and inference
handle every modality the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from attnlab.core.errors import DataError
from attnlab.data.batching import Batches, TokenBatchSampler, collate_examples
from attnlab.data.sampling import ResumableSampler
from attnlab.data.text.tokenizers import tokenizer_from_json

log = logging.getLogger(__name__)


def log_splits(where: str, sizes: Iterable[int], what: str) -> None:
    """One line of what a DataModule holds: ``<where>: <n> train / <n> val / <n> test <what>``."""
    log.info("%s: %d train / %d val / %d test %s", where, *sizes, what)


class DataModule(L.LightningDataModule):
    """A LightningDataModule that describes and rebuilds its data side: ``model_kwargs()`` fills
    ``model.net``'s ``???`` (nested for models of parts: ``{"text": {"vocab_size": 8000}}``);
    ``artifacts()`` (JSON-able: tokenizer, classes, normalisation) travel in every checkpoint and
    ``load_artifacts`` uses them instead of fitting anew; so do the training batches consumed
    (``state_dict``), so a resumed run's loader continues where it stopped."""

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

    def eval_sampler(self, lengths: list[int], max_tokens: int, split: str) -> TokenBatchSampler:
        """This process's batches of an evaluation split, in order: every example scored once in
        all, every process as many steps."""
        rank, world = self.rank_world()
        if len(lengths) < world:
            raise DataError(
                f"the {split} split has {len(lengths)} examples, fewer than the {world} processes "
                "that evaluate it: add examples or run fewer processes"
            )
        return TokenBatchSampler(lengths, max_tokens, shuffle=False, num_replicas=world, rank=rank)

    def split_loader(self, split: str) -> DataLoader:
        """The batches of "train", "val" or "test" (what the three hooks below return)."""
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return self.split_loader("train")

    def val_dataloader(self) -> DataLoader:
        return self.split_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self.split_loader("test")

    def loader(
        self, dataset: Dataset, sampler: Any = None, workers: int | None = None, seed: int | None = None
    ) -> DataLoader:
        """The batches ``dataset`` (or ``sampler``) makes, in workers seeded by the loader's own
        generator: starting them draws nothing from the global one, which a resumed run restores."""
        workers = self.num_workers if workers is None else workers
        generator = torch.Generator().manual_seed(self.seed if seed is None else seed)
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,
            num_workers=workers,
            persistent_workers=workers > 0,
            generator=generator,
        )

    def token_sampler(self, lengths: list[int], max_tokens: int, split: str) -> TokenBatchSampler:
        """Token-budget batches of a split: training's shuffled every epoch (resumed), an evaluation
        split's as ``eval_sampler`` shares them out."""
        if split != "train":
            return self.eval_sampler(lengths, max_tokens, split)
        rank, world = self.rank_world()
        sampler = TokenBatchSampler(lengths, max_tokens, True, self.seed, world, rank)
        sampler.resume(self.train_batches_consumed)
        return sampler

    def token_loader(
        self, collate: Callable[[list[int]], Any], lengths: list[int], max_tokens: int, split: str
    ) -> DataLoader:
        """``collate``'s batches of a split's indices, as ``token_sampler`` draws them."""
        sampler = self.token_sampler(lengths, max_tokens, split)
        return self.loader(Batches(collate, sampler), sampler)

    def eval_loader(
        self,
        dataset: Dataset,
        batch_size: int,
        split: str,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        num_workers: int = 0,
    ) -> DataLoader:
        """Batches of a map-style split, in order, shared out as ``eval_sampler`` does (Lightning's
        ``DistributedSampler`` would pad it with copies, which every metric would count twice)."""
        sampler = self.eval_sampler([1] * len(dataset), batch_size, split)
        return self.loader(
            Batches(partial(collate_examples, dataset, collate_fn), sampler), sampler, num_workers, 0
        )

    def rank_world(self) -> tuple[int, int]:
        """This process's rank and the number of processes."""
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1


class TokenizerDataModule(DataModule):
    """A DataModule whose artifacts are its ``tokenizer`` (a checkpoint's, used instead of fitting one)."""

    tokenizer: Any = None

    def artifacts(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer.to_json(), **super().artifacts()}

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        self.tokenizer = tokenizer_from_json(artifacts["tokenizer"])
        super().load_artifacts(artifacts)


class SplitsDataModule(DataModule):
    """A DataModule whose splits are map-style datasets in ``splits``, batched by ``collate_of(split)``."""

    splits: dict[str, Dataset]
    batch_size: int
    num_workers: int
    seed: int

    collate: Callable[[list[Any]], Any] = staticmethod(default_collate)

    def collate_of(self, split: str) -> Callable[[list[Any]], Any]:
        return self.collate

    def train_dataloader(self) -> DataLoader:
        """Training batches in this process's order, after the batches consumed, the last partial
        one dropped."""
        rank, world = self.rank_world()
        sampler = ResumableSampler(len(self.splits["train"]), self.seed, world, rank)
        sampler.resume(self.train_batches_consumed, self.batch_size)
        return DataLoader(
            self.splits["train"],
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            generator=torch.Generator().manual_seed(sampler.seed),
            collate_fn=self.collate_of("train"),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def split_loader(self, split: str) -> DataLoader:
        return self.eval_loader(
            self.splits[split], self.batch_size, split, self.collate_of(split), self.num_workers
        )

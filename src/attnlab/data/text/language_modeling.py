"""Language-modelling data: a text corpus cut into (input, next-token target) windows."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from attnlab.core.errors import AttnlabError, ConfigError, DataError
from attnlab.core.specs import PositiveInt
from attnlab.data.base import DataModule
from attnlab.data.sampling import stream_batch_numbers
from attnlab.data.sources import Builtin, Shards, Source
from attnlab.data.text.corpora import load_corpus
from attnlab.data.text.shards import ShardWindows, TokenShards
from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer, tokenizer_from_json

log = logging.getLogger(__name__)

Batch = tuple[Tensor, Tensor]


def windows(tokens: Tensor, starts: Tensor, max_len: int) -> Batch:
    """Inputs (B, T) and targets (B, T) of the windows starting at ``starts``."""
    idx = starts[:, None] + torch.arange(max_len + 1)  # (B, T+1)
    chunk = tokens[idx]
    return chunk[:, :-1], chunk[:, 1:]


def random_batch(tokens: Tensor, max_len: int, batch_size: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(tokens) - max_len, (batch_size,), generator=g)
    return windows(tokens, starts, max_len)


class RandomWindows(IterableDataset):
    """Endless batches of random windows, as nanoGPT's ``get_batch``.

    Batch ``n`` is drawn from a generator seeded by ``(seed, n)``, so the stream is the same on
    every run and can restart at any batch (``start``): resuming a killed run sees exactly the
    batches the uninterrupted run would have seen. Ranks and workers interleave the stream.
    """

    def __init__(self, tokens: Tensor, max_len: int, batch_size: int, seed: int) -> None:
        self.tokens, self.max_len, self.batch_size, self.seed = tokens, max_len, batch_size, seed
        self.start = 0

    def __iter__(self) -> Iterator[Batch]:
        for index in stream_batch_numbers(self.start):
            yield random_batch(self.tokens, self.max_len, self.batch_size, self.seed * 1_000_003 + index)


class TextDataModule(DataModule):
    """Character- or BPE-level language modelling on a text corpus.

    The text is cut in three: the first ``1 - val_size - test_size`` trains, the next
    ``val_size`` validates (it picks the checkpoint), the last ``test_size`` is the test
    split, scored once at the end. Validation during training uses ``val_batches`` fixed random
    batches (nanoGPT's estimate, but the same batches every time); the test stage scores the
    whole test split in non-overlapping windows.

    Args:
        source: ``Builtin("tinyshakespeare")`` (downloaded or read from its ``data_dir``) or
            ``Builtin("pydoc")`` (Python's reference manual, shipped with Python), cut into splits
            and tokenised here; or ``Shards(path)``, token shards made by ``attnlab-prepare`` (a
            corpus of any size): tokenised and split when prepared (the tokenizer and held-out
            splits are theirs), training windows read from disk as they are drawn.
        tokenizer: "char" or "bpe" (byte-level BPE trained on the training split).
        vocab_size: vocabulary size of the BPE tokenizer.
        max_len: window length (the model's context).
        batch_size: windows per batch.
        val_size: share of the text held out for validation.
        test_size: share of the text held out for the test (the end of the text).
        val_batches: batches in each periodic validation.
        test_stride: also score the test split with windows sliding by this stride (see
            ``test_dataloader``); ``None``: non-overlapping windows only.
        num_workers: DataLoader workers for the training stream.
        seed: seed of the training and validation batch streams.
    """

    def __init__(
        self,
        source: Source | None = None,
        tokenizer: str = "char",
        vocab_size: PositiveInt = 1024,
        max_len: PositiveInt = 64,
        batch_size: PositiveInt = 12,
        val_size: float = 0.05,
        test_size: float = 0.05,
        val_batches: PositiveInt = 20,
        test_stride: int | None = None,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        if test_stride is not None and not (isinstance(test_stride, int) and 0 < test_stride <= max_len):
            raise ConfigError(
                f"data.test_stride must be in 1..max_len ({max_len}) or null, got {test_stride!r}"
            )
        if tokenizer not in ("char", "bpe"):
            raise ConfigError(f"data.tokenizer must be 'char' or 'bpe', got {tokenizer!r}")
        if not (0.0 < val_size < 1.0 and 0.0 < test_size < 1.0 and val_size + test_size < 1.0):
            raise ConfigError(
                f"data.val_size ({val_size}) and data.test_size ({test_size}) must be "
                "between 0 and 1, with room left for training"
            )
        self.source = source or Builtin("tinyshakespeare")
        self.tokenizer_kind, self.vocab_size_wanted = tokenizer, vocab_size
        self.max_len, self.batch_size = max_len, batch_size
        self.val_size, self.test_size = val_size, test_size
        self.val_batches, self.test_stride = val_batches, test_stride
        self.num_workers, self.seed = num_workers, seed
        self.shards: TokenShards | None = None
        self.tokenizer: CharTokenizer | BPETokenizer | None = None
        self.train_tokens: Tensor | None = None
        self.val_tokens: Tensor | None = None
        self.test_tokens: Tensor | None = None

    @property
    def vocab_size(self) -> int:
        assert self.tokenizer is not None, "call setup() first"
        return self.tokenizer.vocab_size

    def model_kwargs(self) -> dict[str, int]:
        """Model constructor arguments that the data decides."""
        return {"vocab_size": self.vocab_size}

    def artifacts(self) -> dict[str, Any]:
        assert self.tokenizer is not None, "call setup() first"
        return {"tokenizer": self.tokenizer.to_json()}

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """Use a saved tokenizer (from a checkpoint) instead of fitting one."""
        self.tokenizer = tokenizer_from_json(artifacts["tokenizer"])

    def prepare_data(self) -> None:
        if isinstance(self.source, Builtin):
            load_corpus(self.source)

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is not None or self.shards is not None:
            return
        if isinstance(self.source, Shards):
            return self._setup_shards()
        text = load_corpus(self.source)
        val_start = int(len(text) * (1 - self.val_size - self.test_size))
        test_start = int(len(text) * (1 - self.test_size))
        train_text, val_text, test_text = text[:val_start], text[val_start:test_start], text[test_start:]
        if self.tokenizer is None:
            self.tokenizer = (
                CharTokenizer.fit(text)
                if self.tokenizer_kind == "char"
                else BPETokenizer.fit(train_text, self.vocab_size_wanted)
            )
        try:
            self.train_tokens = torch.tensor(self.tokenizer.encode(train_text), dtype=torch.long)
            self.val_tokens = torch.tensor(self.tokenizer.encode(val_text), dtype=torch.long)
            self.test_tokens = torch.tensor(self.tokenizer.encode(test_text), dtype=torch.long)
        except AttnlabError as e:
            raise DataError(f"corpus {self.source.where} does not fit the checkpoint's tokenizer: {e}") from e
        self._check_lengths([("train", len(self.train_tokens)), ("validation", len(self.val_tokens))])
        log.info(
            "corpus %s: %d train / %d val / %d test tokens, vocab %d (%s)",
            self.source.where,
            len(self.train_tokens),
            len(self.val_tokens),
            len(self.test_tokens),
            self.vocab_size,
            self.tokenizer_kind,
        )

    def _setup_shards(self) -> None:
        shards = TokenShards(self.source.path)
        if self.tokenizer is not None and self.tokenizer.to_json() != shards.tokenizer_json:
            raise DataError(
                f"{shards.folder}: its shards were made with another tokenizer than the checkpoint's "
                "(the manifest's tokenizer differs); prepare them with the run's tokenizer"
            )
        self.tokenizer = self.tokenizer or shards.tokenizer()
        self.val_tokens, self.test_tokens = shards.read_split("val"), shards.read_split("test")
        largest = max((s.tokens for s in shards.splits["train"]), default=0)
        self._check_lengths([("train", largest), ("validation", len(self.val_tokens))])
        self.shards = shards
        log.info(
            "shards %s: %d train / %d val / %d test tokens, vocab %d",
            self.source.path,
            shards.tokens("train"),
            len(self.val_tokens),
            len(self.test_tokens),
            self.vocab_size,
        )

    def _check_lengths(self, splits: list[tuple[str, int]]) -> None:
        shards = isinstance(self.source, Shards)
        source = f"{'shards' if shards else 'corpus'} {self.source.where}"
        for split, n in [*splits, ("test", len(self.test_tokens))]:
            if n <= self.max_len + 1:
                raise DataError(
                    f"the {split} split of {source} has {n} tokens"
                    f"{' in its largest shard' if split == 'train' and shards else ''}, "
                    f"fewer than data.max_len + 2 = {self.max_len + 2}"
                )

    def train_dataloader(self) -> DataLoader:
        if self.shards is not None:
            ds = ShardWindows(self.shards, self.max_len, self.batch_size, self.seed)
        else:
            ds = RandomWindows(self.train_tokens, self.max_len, self.batch_size, self.seed)
        ds.start = self.train_batches_consumed
        return DataLoader(
            ds,
            batch_size=None,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        seed = self.seed * 1_000_003 + 10**12  # a stream apart from the training batches
        batches = [
            random_batch(self.val_tokens, self.max_len, self.batch_size, seed + i)
            for i in range(self.val_batches)
        ]
        x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
        return self.eval_loader(list(zip(x, y, strict=True)), self.batch_size, "validation")

    def test_dataloader(self) -> list[DataLoader]:
        """The whole test split, every target scored exactly once.

        Loader 0 cuts it into non-overlapping windows (a token's context is 0..T-1 tokens, as in
        training and in nanoGPT's estimate). With ``test_stride``, loader 1 slides windows by that
        stride and scores only targets not scored before, so each has at least ``T - stride``
        tokens of context: the usual way to score a fixed-context model on a long text.
        """
        loaders = [self._scored_windows(self.max_len)]
        if self.test_stride is not None:
            loaders.append(self._scored_windows(self.test_stride))
        return loaders

    def _scored_windows(self, stride: int) -> DataLoader:
        toks, t = self.test_tokens, self.max_len
        last = len(toks) - 1 - t  # start of the last full window
        starts = list(range(0, last + 1, stride))
        if starts[-1] != last:
            starts.append(last)
        x, y = windows(toks, torch.tensor(starts), t)
        scored_until = torch.tensor([0] + [s + t for s in starts[:-1]])  # targets before: done
        target_pos = torch.tensor(starts)[:, None] + torch.arange(t)  # (N, T) index of y[j]
        y = y.masked_fill(target_pos < scored_until[:, None], -100)
        return self.eval_loader(list(zip(x, y, strict=True)), self.batch_size * 4, "test")

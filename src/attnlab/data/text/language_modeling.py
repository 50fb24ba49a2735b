"""Language-modelling data: a text corpus cut into (input, next-token target) windows."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from attnlab.core.checks import check_positive
from attnlab.core.errors import AttnlabError, ConfigError, DataError
from attnlab.data.base import DataModule
from attnlab.data.remote import location
from attnlab.data.sampling import stream_batch_numbers
from attnlab.data.text.corpora import load_corpus
from attnlab.data.text.shards import ShardWindows, TokenShards
from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer, tokenizer_from_json

log = logging.getLogger(__name__)

Batch = tuple[Tensor, Tensor]


def windows(tokens: Tensor, starts: Tensor, block_size: int) -> Batch:
    """Inputs (B, T) and targets (B, T) of the windows starting at ``starts``."""
    idx = starts[:, None] + torch.arange(block_size + 1)  # (B, T+1)
    chunk = tokens[idx]
    return chunk[:, :-1], chunk[:, 1:]


def random_batch(tokens: Tensor, block_size: int, batch_size: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=g)
    return windows(tokens, starts, block_size)


class RandomWindows(IterableDataset):
    """Endless batches of random windows, as nanoGPT's ``get_batch``.

    Batch ``n`` is drawn from a generator seeded by ``(seed, n)``, so the stream is the same on
    every run and can restart at any batch (``start``): resuming a killed run sees exactly the
    batches the uninterrupted run would have seen. Ranks and workers interleave the stream.
    """

    def __init__(self, tokens: Tensor, block_size: int, batch_size: int, seed: int) -> None:
        self.tokens, self.block_size, self.batch_size, self.seed = tokens, block_size, batch_size, seed
        self.start = 0

    def __iter__(self) -> Iterator[Batch]:
        for index in stream_batch_numbers(self.start):
            yield random_batch(self.tokens, self.block_size, self.batch_size, self.seed * 1_000_003 + index)


class TextDataModule(DataModule):
    """Character- or BPE-level language modelling on a text corpus.

    The text is cut in three: the first ``1 - val_fraction - test_fraction`` trains, the next
    ``val_fraction`` validates (it picks the checkpoint), the last ``test_fraction`` is the test
    split, scored once at the end. Validation during training uses ``val_batches`` fixed random
    batches (nanoGPT's estimate, but the same batches every time); the test stage scores the
    whole test split in non-overlapping windows.

    Args:
        corpus: "tinyshakespeare" (downloaded or read from ``data_dir``) or "pydoc" (Python's
            reference manual, shipped with Python: needs no download).
        data_dir: directory holding the corpus file; no download when set.
        cache_dir: where downloads are kept.
        url, sha256: override the corpus' download source.
        tokenizer: "char" or "bpe" (byte-level BPE trained on the training split).
        bpe_vocab_size: vocabulary size of the BPE tokenizer.
        block_size: window length (the model's context).
        batch_size: windows per batch.
        val_fraction: share of the text held out for validation.
        test_fraction: share of the text held out for the test (the end of the text).
        val_batches: batches in each periodic validation.
        test_stride: also score the test split with windows sliding by this stride (see
            ``test_dataloader``); ``None``: non-overlapping windows only.
        num_workers: DataLoader workers for the training stream.
        seed: seed of the training and validation batch streams.
        shards_dir: a folder of token shards made by ``attnlab-prepare`` (a corpus of any size;
            a local path or an ``s3://``, ``gs://`` or ``https://`` URL, ranged reads):
            training windows are read from disk as they are drawn, validation and test are the
            shards' held-out splits, and the tokenizer is the one they were made with;
            ``corpus``, ``tokenizer`` and the fractions are then not used.
    """

    def __init__(
        self,
        corpus: str = "tinyshakespeare",
        data_dir: str | None = None,
        cache_dir: str = "data",
        url: str | None = None,
        sha256: str | None = None,
        tokenizer: str = "char",
        bpe_vocab_size: int = 1024,
        block_size: int = 64,
        batch_size: int = 12,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        val_batches: int = 20,
        test_stride: int | None = None,
        num_workers: int = 0,
        seed: int = 1337,
        shards_dir: str | None = None,
    ) -> None:
        super().__init__()
        check_positive(
            "data",
            block_size=block_size,
            batch_size=batch_size,
            val_batches=val_batches,
            bpe_vocab_size=bpe_vocab_size,
        )
        if test_stride is not None and not (isinstance(test_stride, int) and 0 < test_stride <= block_size):
            raise ConfigError(
                f"data.test_stride must be in 1..block_size ({block_size}) or null, got {test_stride!r}"
            )
        if tokenizer not in ("char", "bpe"):
            raise ConfigError(f"data.tokenizer must be 'char' or 'bpe', got {tokenizer!r}")
        if not (
            0.0 < val_fraction < 1.0 and 0.0 < test_fraction < 1.0 and val_fraction + test_fraction < 1.0
        ):
            raise ConfigError(
                f"data.val_fraction ({val_fraction}) and data.test_fraction ({test_fraction}) must be "
                "between 0 and 1, with room left for training"
            )
        self.corpus, self.data_dir, self.cache_dir = corpus, data_dir, cache_dir
        self.url, self.sha256 = url, sha256
        self.tokenizer_kind, self.bpe_vocab_size = tokenizer, bpe_vocab_size
        self.block_size, self.batch_size = block_size, batch_size
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.val_batches, self.test_stride = val_batches, test_stride
        self.num_workers, self.seed = num_workers, seed
        if shards_dir is not None:
            location(shards_dir, "data.shards_dir")  # a URL's scheme and package, checked here
        self.shards_dir, self.shards = shards_dir, None
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
        if self.shards_dir is None:
            load_corpus(self.corpus, self.data_dir, self.cache_dir, self.url, self.sha256)

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is not None or self.shards is not None:
            return
        if self.shards_dir is not None:
            return self._setup_shards()
        text = load_corpus(self.corpus, self.data_dir, self.cache_dir, self.url, self.sha256)
        val_start = int(len(text) * (1 - self.val_fraction - self.test_fraction))
        test_start = int(len(text) * (1 - self.test_fraction))
        train_text, val_text, test_text = text[:val_start], text[val_start:test_start], text[test_start:]
        if self.tokenizer is None:
            self.tokenizer = (
                CharTokenizer.fit(text)
                if self.tokenizer_kind == "char"
                else BPETokenizer.fit(train_text, self.bpe_vocab_size)
            )
        try:
            self.train_tokens = torch.tensor(self.tokenizer.encode(train_text), dtype=torch.long)
            self.val_tokens = torch.tensor(self.tokenizer.encode(val_text), dtype=torch.long)
            self.test_tokens = torch.tensor(self.tokenizer.encode(test_text), dtype=torch.long)
        except AttnlabError as e:
            raise DataError(f"corpus {self.corpus!r} does not fit the checkpoint's tokenizer: {e}") from e
        self._check_lengths([("train", len(self.train_tokens)), ("validation", len(self.val_tokens))])
        log.info(
            "corpus %s: %d train / %d val / %d test tokens, vocab %d (%s)",
            self.corpus,
            len(self.train_tokens),
            len(self.val_tokens),
            len(self.test_tokens),
            self.vocab_size,
            self.tokenizer_kind,
        )

    def _setup_shards(self) -> None:
        shards = TokenShards(self.shards_dir)
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
            self.shards_dir,
            shards.tokens("train"),
            len(self.val_tokens),
            len(self.test_tokens),
            self.vocab_size,
        )

    def _check_lengths(self, splits: list[tuple[str, int]]) -> None:
        source = f"shards {self.shards_dir}" if self.shards_dir else f"corpus {self.corpus!r}"
        for split, n in [*splits, ("test", len(self.test_tokens))]:
            if n <= self.block_size + 1:
                raise DataError(
                    f"the {split} split of {source} has {n} tokens"
                    f"{' in its largest shard' if split == 'train' and self.shards_dir else ''}, "
                    f"fewer than data.block_size + 2 = {self.block_size + 2}"
                )

    def train_dataloader(self) -> DataLoader:
        if self.shards is not None:
            ds = ShardWindows(self.shards, self.block_size, self.batch_size, self.seed)
        else:
            ds = RandomWindows(self.train_tokens, self.block_size, self.batch_size, self.seed)
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
            random_batch(self.val_tokens, self.block_size, self.batch_size, seed + i)
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
        loaders = [self._scored_windows(self.block_size)]
        if self.test_stride is not None:
            loaders.append(self._scored_windows(self.test_stride))
        return loaders

    def _scored_windows(self, stride: int) -> DataLoader:
        toks, t = self.test_tokens, self.block_size
        last = len(toks) - 1 - t  # start of the last full window
        starts = list(range(0, last + 1, stride))
        if starts[-1] != last:
            starts.append(last)
        x, y = windows(toks, torch.tensor(starts), t)
        scored_until = torch.tensor([0] + [s + t for s in starts[:-1]])  # targets before: done
        target_pos = torch.tensor(starts)[:, None] + torch.arange(t)  # (N, T) index of y[j]
        y = y.masked_fill(target_pos < scored_until[:, None], -100)
        return self.eval_loader(list(zip(x, y, strict=True)), self.batch_size * 4, "test")

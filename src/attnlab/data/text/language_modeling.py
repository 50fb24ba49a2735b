"""Language-modelling data: a text corpus cut into (input, next-token target) windows."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from attnlab.core.errors import AttnlabError, ConfigError, DataError
from attnlab.core.specs import PositiveInt
from attnlab.data.base import TokenizerDataModule, log_splits
from attnlab.data.sampling import BatchStream
from attnlab.data.sources import Builtin, Shards, Source
from attnlab.data.text.corpora import load_corpus
from attnlab.data.text.shards import ShardWindows, TokenShards, split_shares
from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer

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


class RandomWindows(BatchStream):
    """Endless batches of random windows, as nanoGPT's ``get_batch``."""

    def __init__(self, tokens: Tensor, max_len: int, batch_size: int, seed: int) -> None:
        self.tokens, self.max_len, self.batch_size, self.seed = tokens, max_len, batch_size, seed

    def batch(self, index: int) -> Batch:
        return random_batch(self.tokens, self.max_len, self.batch_size, self.seed * 1_000_003 + index)


class TextDataModule(TokenizerDataModule):
    """Language modelling on a ``Builtin`` corpus (``tinyshakespeare``, ``pydoc``), cut here into
    train, ``val_size`` and ``test_size`` shares (the test split at the end) and tokenised ("char":
    at most ``vocab_size`` characters if set; "bpe": ``vocab_size``, null: 1024); or on ``Shards``
    (``tokenizer`` and ``vocab_size`` null, or the shards' own). Validation scores ``val_batches``
    fixed random batches; the test split is scored whole (and in windows sliding by ``test_stride``)."""

    def __init__(
        self,
        source: Source | None = None,
        tokenizer: str | None = None,
        vocab_size: PositiveInt | None = None,
        max_len: PositiveInt = 64,
        batch_size: PositiveInt = 12,
        val_batches: PositiveInt = 20,
        test_stride: int | None = None,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        self.source = source or Builtin("tinyshakespeare")
        if test_stride is not None and not (isinstance(test_stride, int) and 0 < test_stride <= max_len):
            raise ConfigError(
                f"data.test_stride must be in 1..max_len ({max_len}) or null, got {test_stride!r}"
            )
        if tokenizer not in ("char", "bpe", None):
            raise ConfigError(f"data.tokenizer must be 'char' or 'bpe', got {tokenizer!r}")
        if not isinstance(self.source, Shards):
            self.val_size, self.test_size = split_shares(self.source)
            tokenizer = tokenizer or "char"
        self.tokenizer_kind, self.vocab_size_wanted = tokenizer, vocab_size
        self.max_len, self.batch_size = max_len, batch_size
        self.val_batches, self.test_stride = val_batches, test_stride
        self.num_workers, self.seed = num_workers, seed
        self.shards: TokenShards | None = None
        self.tokenizer: CharTokenizer | BPETokenizer | None = None
        self.train_tokens = self.val_tokens = self.test_tokens = None  # (N,) token ids once set up

    @property
    def vocab_size(self) -> int:
        assert self.tokenizer is not None, "call setup() first"
        return self.tokenizer.vocab_size

    def model_kwargs(self) -> dict[str, int]:
        return {"vocab_size": self.vocab_size}

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
        if self.tokenizer is None and self.tokenizer_kind == "bpe":
            self.tokenizer = BPETokenizer.fit(train_text, self.vocab_size_wanted or 1024)
        elif self.tokenizer is None:
            self.tokenizer = CharTokenizer.fit(text)
            if self.vocab_size_wanted is not None and self.vocab_size > self.vocab_size_wanted:
                raise ConfigError(
                    f"data.vocab_size={self.vocab_size_wanted}: corpus {self.source.where} has "
                    f"{self.vocab_size} characters; raise it, or set it null"
                )
        try:
            self.train_tokens, self.val_tokens, self.test_tokens = (
                torch.tensor(self.tokenizer.encode(t), dtype=torch.long)
                for t in (train_text, val_text, test_text)
            )
        except AttnlabError as e:
            raise DataError(f"corpus {self.source.where} does not fit the checkpoint's tokenizer: {e}") from e
        self._check_lengths([("train", len(self.train_tokens)), ("validation", len(self.val_tokens))])
        self.log_tokens(f"corpus {self.source.where}", len(self.train_tokens), f" ({self.tokenizer_kind})")

    def _setup_shards(self) -> None:
        shards = TokenShards(self.source.path)
        self.tokenizer = shards.own_tokenizer(
            self.tokenizer, tokenizer=self.tokenizer_kind, vocab_size=self.vocab_size_wanted
        )
        self.val_tokens, self.test_tokens = shards.read_split("val"), shards.read_split("test")
        largest = max((s.count for s in shards.splits["train"]), default=0)
        self._check_lengths([("train", largest), ("validation", len(self.val_tokens))])
        self.shards = shards
        self.log_tokens(f"shards {self.source.path}", shards.tokens("train"))

    def log_tokens(self, where: str, train: int, kind: str = "") -> None:
        sizes = (train, len(self.val_tokens), len(self.test_tokens))
        log_splits(where, sizes, f"tokens, vocab {self.vocab_size}{kind}")

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
        return self.loader(ds)

    def val_dataloader(self) -> DataLoader:
        seed = self.seed * 1_000_003 + 10**12  # a stream apart from the training batches
        batches = [
            random_batch(self.val_tokens, self.max_len, self.batch_size, seed + i)
            for i in range(self.val_batches)
        ]
        x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
        return self.eval_loader(list(zip(x, y, strict=True)), self.batch_size, "validation")

    def test_dataloader(self) -> list[DataLoader]:
        """The whole test split, each target scored once: in non-overlapping windows (loader 0, as
        in training) and, with ``test_stride``, in windows sliding by it (loader 1), scoring only
        targets not scored before (each with at least ``T - stride`` tokens of context)."""
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

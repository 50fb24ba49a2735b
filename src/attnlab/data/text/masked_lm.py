"""BERT pre-training data: a document cut in two, ``[CLS] A [SEP] B [SEP]`` with B its rest or, half
of the time, another document's (next-sentence prediction), masked afresh every batch."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import PositiveInt
from attnlab.data.base import TokenizerDataModule, log_splits
from attnlab.data.batching import pad
from attnlab.data.sampling import BatchStream, carve
from attnlab.data.sources import Files, Shards, Share
from attnlab.data.text.corpora import data_file
from attnlab.data.text.formats import read_corpus
from attnlab.data.text.shards import Document, DocumentShards, ShardDocuments, split_shares
from attnlab.data.text.tokenizers import WordPieceTokenizer

IS_NEXT, NOT_NEXT = 0, 1  # NSP labels, as Hugging Face's BertForPreTraining
N_SPECIALS = len(WordPieceTokenizer.specials)  # ids below this are special tokens, never masked


def split_document(doc: Document, rng: random.Random) -> tuple[list[int], list[int]]:
    """Cut a document in two at a random sentence boundary (inside its sentence if it has one)."""
    if len(doc) >= 2:
        k = rng.randint(1, len(doc) - 1)
        return [t for s in doc[:k] for t in s], [t for s in doc[k:] for t in s]
    k = rng.randint(1, len(doc[0]) - 1)
    return doc[0][:k], doc[0][k:]


def join_pair(a: list[int], b: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """``[CLS] A [SEP] B [SEP]`` and its segment ids, cut to ``max_len`` by trimming the longer
    segment on the side away from the cut."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_len - 3:
        if len(a) > len(b):
            a.pop(0)
        else:
            b.pop()
    tok = WordPieceTokenizer
    ids = [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
    return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


def make_pair(
    docs: Sequence[Document], i: int, rng: random.Random, max_len: int
) -> tuple[list[int], list[int], int]:
    """Ids, segment ids and NSP label of a pair whose A comes from document ``i`` (a one-sentence
    document is cut inside its sentence)."""
    a, b = split_document(docs[i], rng)
    label = IS_NEXT
    if rng.random() < 0.5 and len(docs) > 1:
        j = rng.randrange(len(docs) - 1)
        _, other = split_document(docs[j + (j >= i)], rng)  # any document but i
        # no longer than the true B: a pair is never longer than its document, which is what
        # the batch sampler budgets for (and the length says nothing of the label)
        b, label = other[: len(b)], NOT_NEXT
    ids, segments = join_pair(a, b, max_len)
    return ids, segments, label


def mask_tokens(
    ids: Tensor, vocab_size: int, prob: float = 0.15, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Inputs with 15% of the ordinary tokens replaced (80% [MASK], 10% random, 10% kept), and
    the labels: the original id where chosen, -100 elsewhere. Special tokens and padding (ids
    below ``N_SPECIALS``) are never chosen."""
    u = torch.rand(ids.shape, generator=generator)
    chosen = (u < prob) & (ids >= N_SPECIALS)
    labels = ids.masked_fill(~chosen, -100)
    how = torch.rand(ids.shape, generator=generator)
    inputs = ids.masked_fill(chosen & (how < 0.8), WordPieceTokenizer.mask_id)
    random_ids = torch.randint(N_SPECIALS, vocab_size, ids.shape, generator=generator)
    swap = chosen & (how >= 0.8) & (how < 0.9)
    inputs = torch.where(swap, random_ids, inputs)
    return inputs, labels


def masked_batch(
    items: list[tuple[list[int], list[int], int]],
    vocab_size: int,
    mask_prob: float,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """A training batch of pairs (``make_pair``'s), padded and masked together (``mask_tokens``)."""
    ids = pad([it[0] for it in items], WordPieceTokenizer.pad_id)
    return batch_of(items, *mask_tokens(ids, vocab_size, mask_prob, generator))


def batch_of(
    items: list[tuple[list[int], list[int], int]], inputs: Tensor, labels: Tensor
) -> dict[str, Tensor]:
    """The batch dict of ``items`` with their (masked) ``inputs`` and ``labels``."""
    return {
        "ids": inputs,
        "segments": pad([it[1] for it in items], 0),
        "mlm_labels": labels,
        "nsp_labels": torch.tensor([it[2] for it in items]),
    }


@dataclass(eq=False)
class PairStream(BatchStream):
    """Endless MLM + NSP batches from ``docs`` (a list, or ``ShardDocuments``) as ``SegmentPairs``
    builds them: batch ``n`` draws documents (with replacement), cuts, partners and masks from
    generators seeded by ``(seed, n)``, as many pairs as ``max_tokens`` holds."""

    docs: Sequence[Document]
    max_len: int
    max_tokens: int
    vocab_size: int
    mask_prob: float
    seed: int

    def batch(self, index: int) -> dict[str, Tensor]:
        seed = self.seed * 1_000_003 + index
        rng = random.Random(seed)
        items, longest = [], 0
        while True:
            pair = make_pair(self.docs, rng.randrange(len(self.docs)), rng, self.max_len)
            longest_if_added = max(longest, len(pair[0]))
            if items and longest_if_added * (len(items) + 1) > self.max_tokens:
                break
            items.append(pair)
            longest = longest_if_added
        return masked_batch(items, self.vocab_size, self.mask_prob, torch.Generator().manual_seed(seed))


@dataclass
class SegmentPairs:
    """Masked batches of pairs, one per document index: ``pairs([i, j, ...])``. Training draws new
    cuts, partners and masks from the global RNG; evaluation (``fixed``) seeds document ``i``'s by
    ``(seed, i)``, the same however documents are batched or shared out."""

    docs: list[Document]
    max_len: int
    vocab_size: int
    mask_prob: float = 0.15
    fixed: bool = False
    seed: int = 0

    def fixed_masks(self, ids: list[int], i: int) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return mask_tokens(torch.tensor(ids), self.vocab_size, self.mask_prob, generator)

    def lengths(self) -> list[int]:
        """Each document's pair length, an upper bound (the sampler's budget unit)."""
        return [min(sum(map(len, d)) + 3, self.max_len) for d in self.docs]

    def pair(self, i: int) -> tuple[list[int], list[int], int]:
        seed = self.seed * 1_000_003 + i if self.fixed else int(torch.randint(2**62, ()).item())
        return make_pair(self.docs, i, random.Random(seed), self.max_len)

    def __call__(self, idx: list[int]) -> dict[str, Tensor]:
        items = [self.pair(i) for i in idx]
        if not self.fixed:
            return masked_batch(items, self.vocab_size, self.mask_prob)
        # each pair masked by its own seed: the same whichever batch holds it
        masked = [self.fixed_masks(it[0], i) for it, i in zip(items, idx, strict=True)]
        inputs = pad([m[0].tolist() for m in masked], WordPieceTokenizer.pad_id)
        return batch_of(items, inputs, pad([m[1].tolist() for m in masked], -100))


class MaskedLMDataModule(TokenizerDataModule):
    """BERT pre-training (MLM + NSP) on ``Files`` (``read_corpus``), carved here (seeded) and
    tokenised with WordPiece of ``vocab_size`` (null: 8000); or on document ``Shards`` (``vocab_size``
    null, or the shards'), documents read as drawn. Batches hold ``max_tokens`` with padding;
    ``val_docs`` documents of each held-out split are scored, with fixed pairs and masks."""

    def __init__(
        self,
        source: Files | Shards,
        vocab_size: PositiveInt | None = None,
        max_len: PositiveInt = 64,
        max_tokens: PositiveInt = 4096,
        mask_prob: Share = 0.15,
        val_docs: PositiveInt = 2000,
        num_workers: int = 0,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        if not isinstance(source, Shards):
            if not source.names:
                raise ConfigError("data.source.names must name at least one corpus file")
            self.val_size, self.test_size = split_shares(source)
        if max_len < 5:
            raise ConfigError(f"data.max_len must be at least 5 ([CLS] A [SEP] B [SEP]), got {max_len}")
        if max_tokens < max_len:
            raise ConfigError(f"data.max_tokens ({max_tokens}) must hold a pair of data.max_len ({max_len})")
        self.source = source
        self.vocab_size, self.max_len, self.max_tokens = vocab_size, max_len, max_tokens
        self.mask_prob, self.val_docs_scored = mask_prob, val_docs
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer: WordPieceTokenizer | None = None
        self.train_docs: Sequence[Document] | None = None
        self.val_docs: list[Document] = []
        self.test_docs: list[Document] = []

    def model_kwargs(self) -> dict[str, Any]:
        return {"encoder": {"vocab_size": self.tokenizer.vocab_size, "pad_id": WordPieceTokenizer.pad_id}}

    def prepare_data(self) -> None:
        if isinstance(self.source, Files):
            for name in self.source.names:
                data_file(name, self.source.data_dir, self.source.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.train_docs is not None:
            return
        if isinstance(self.source, Shards):
            return self._setup_shards()
        src = self.source
        docs = [d for name in src.names for d in read_corpus(data_file(name, src.data_dir, src.cache_dir))]
        if len(docs) < 3:
            raise DataError(
                f"the corpus ({self.source.where}) holds {len(docs)} document(s); "
                "pre-training needs at least three (training, validation, test)"
            )
        held = [max(1, int(len(docs) * share)) for share in (self.val_size, self.test_size)]
        val, test, train = ([docs[i] for i in part] for part in carve(len(docs), held, self.seed))
        if self.tokenizer is None:
            self.tokenizer = WordPieceTokenizer.fit([s for d in train for s in d], self.vocab_size or 8000)
        tok = self.tokenizer
        if (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) != tuple(range(N_SPECIALS)):
            raise DataError(
                "MLM pre-training here needs a vocabulary with its specials at ids 0-4 (one trained "
                "here); an imported BERT vocabulary is for the classification tasks"
            )
        self.train_docs, self.val_docs, self.test_docs = map(self._encode, (train, val, test))
        if not (self.train_docs and self.val_docs and self.test_docs):
            raise DataError(
                f"the corpus ({self.source.where}) has too few documents of two or more "
                "tokens for a training, a validation and a test split"
            )
        self.log_documents(f"corpus {self.source.where}")

    def _setup_shards(self) -> None:
        shards = DocumentShards(self.source.path)
        self.tokenizer = shards.own_tokenizer(self.tokenizer, vocab_size=self.vocab_size)
        self.val_docs, self.test_docs = shards.read_split("val"), shards.read_split("test")
        self.train_docs = ShardDocuments(shards)
        if not (len(self.train_docs) and self.val_docs and self.test_docs):
            raise DataError(
                f"{shards.folder}: a training, a validation and a test split of documents are needed; "
                f"it has {len(self.train_docs)} / {len(self.val_docs)} / {len(self.test_docs)}"
            )
        self.log_documents(f"shards {self.source.path}")

    def log_documents(self, where: str) -> None:
        sizes = map(len, (self.train_docs, self.val_docs, self.test_docs))
        log_splits(where, sizes, f"documents, vocab {self.tokenizer.vocab_size}")

    def _encode(self, docs: list[list[str]]) -> list[Document]:
        """Token ids of each document, without those too short to cut in two."""
        flat = self.tokenizer.encode_batch([s for d in docs for s in d])
        out, k = [], 0
        for d in docs:
            sentences = [ids for ids in flat[k : k + len(d)] if ids]
            k += len(d)
            if sum(map(len, sentences)) >= 2:
                out.append(sentences)
        return out

    def train_dataloader(self) -> DataLoader:
        vocab_size = self.tokenizer.vocab_size
        if not isinstance(self.source, Shards):
            pairs = SegmentPairs(self.train_docs, self.max_len, vocab_size, self.mask_prob)
            return self.token_loader(pairs, pairs.lengths(), self.max_tokens, "train")
        stream = PairStream(
            self.train_docs, self.max_len, self.max_tokens, vocab_size, self.mask_prob, self.seed
        )
        stream.start = self.train_batches_consumed
        return self.loader(stream)

    def val_dataloader(self) -> DataLoader:
        return self._held_out(self.val_docs, "validation")

    def test_dataloader(self) -> DataLoader:
        return self._held_out(self.test_docs, "test")

    def _held_out(self, docs: list[Document], split: str) -> DataLoader:
        """The first ``val_docs`` documents of a held-out split, with fixed pairs and masks."""
        vocab_size = self.tokenizer.vocab_size
        pairs = SegmentPairs(
            docs[: self.val_docs_scored], self.max_len, vocab_size, self.mask_prob, True, self.seed
        )
        return self.token_loader(pairs, pairs.lengths(), self.max_tokens, split)

    def examples(self, n: int) -> list[tuple[list[int], list[int], int]]:
        """The first ``n`` validation pairs, unmasked (the same ones every time: attention pictures)."""
        pairs = SegmentPairs(
            self.val_docs, self.max_len, self.tokenizer.vocab_size, fixed=True, seed=self.seed
        )
        return [pairs.pair(i) for i in range(min(n, len(self.val_docs)))]

"""Labelled text for fine-tuning: a label per sentence (or sentence pair) from GLUE-format TSV,
or a label per word from CoNLL files, as ``[CLS] A [SEP] (B [SEP])`` batches of WordPiece ids."""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import PositiveInt
from attnlab.data.base import TokenizerDataModule, log_splits
from attnlab.data.batching import pad
from attnlab.data.sources import SplitFiles
from attnlab.data.text.corpora import data_file
from attnlab.data.text.formats import read_conll, read_tsv
from attnlab.data.text.tokenizers import WordPieceTokenizer

Item = tuple[list[int], list[int], Any]  # ids, segment ids, label(s)


def collate(split: list[Item], pad_id: int, idx: list[int]) -> dict[str, Tensor]:
    """The padded batch of ``split``'s examples ``idx``."""
    items = [split[i] for i in idx]
    labels = [it[2] for it in items]
    return {
        "ids": pad([it[0] for it in items], pad_id),
        "segments": pad([it[1] for it in items], 0),
        "labels": pad(labels, -100) if isinstance(labels[0], list) else torch.tensor(labels),
    }


class LabelledTextDataModule(TokenizerDataModule):
    """What sentence and token classification share: a tokenizer (a pre-trained model's, or
    WordPiece fitted on the training split), inputs cut to ``max_len``, batches of ``max_tokens``
    with padding, labels ``class_names`` (default: the training file's)."""

    def __init__(
        self,
        source: SplitFiles,
        vocab_size: PositiveInt = 8000,
        max_len: PositiveInt = 64,
        max_tokens: PositiveInt = 2048,
        class_names: list[str] | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if max_tokens < max_len:
            raise ConfigError(
                f"data.max_tokens ({max_tokens}) must hold an example of data.max_len ({max_len})"
            )
        self.source, self.files = source, source.files
        self.vocab_size, self.max_len, self.max_tokens = vocab_size, max_len, max_tokens
        self.classes: list[str] | None = list(class_names) if class_names else None
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer: WordPieceTokenizer | None = None
        self.splits: dict[str, list[Item]] = {}

    # a subclass says how to read(path) a file's examples, their texts(examples) to fit a tokenizer
    # on, fit_classes(examples) and encode(examples, path) into Items
    # -- shared --------------------------------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def model_kwargs(self) -> dict[str, Any]:
        return {
            "encoder": {"vocab_size": self.tokenizer.vocab_size, "pad_id": self.tokenizer.pad_id},
            "num_classes": self.num_classes,
        }

    def artifacts(self) -> dict[str, Any]:
        return {**super().artifacts(), "classes": self.classes, "max_len": self.max_len}

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """A checkpoint's tokenizer (a pre-training run's has no classes: those come from the data)."""
        super().load_artifacts(artifacts)
        if artifacts.get("classes"):
            self.classes = list(artifacts["classes"])

    def _path(self, split: str) -> Path:
        return data_file(self.files[split], self.source.data_dir, self.source.cache_dir)

    def prepare_data(self) -> None:
        for split in self.files:
            self._path(split)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        raw = {split: self.read(self._path(split)) for split in self.files}
        if self.tokenizer is None:
            self.tokenizer = WordPieceTokenizer.fit(self.texts(raw["train"]), self.vocab_size)
        if not isinstance(self.tokenizer, WordPieceTokenizer):
            raise DataError(
                f"the checkpoint's tokenizer is a {self.tokenizer.kind} one; BERT tasks need WordPiece"
            )
        if self.classes is None:
            self.classes = self.fit_classes(raw["train"])
        self.splits = {split: self.encode(raw[split], self._path(split)) for split in self.files}
        sizes = (len(self.splits[s]) for s in ("train", "val", "test"))
        what = f"examples, {self.num_classes} classes, vocab {self.tokenizer.vocab_size}"
        log_splits(type(self).__name__, sizes, what)

    def split_loader(self, split: str) -> DataLoader:
        items = self.splits[split]
        lengths = [len(it[0]) for it in items]
        return self.token_loader(
            partial(collate, items, self.tokenizer.pad_id), lengths, self.max_tokens, split
        )

    def examples(self, n: int) -> list[Item]:
        """The first ``n`` validation examples (the same ones every time: attention pictures)."""
        return self.splits["val"][:n]


class SentenceClassificationDataModule(LabelledTextDataModule):
    """GLUE-format TSV (``sentence`` or ``sentence1``/``sentence2``, integer ``label``): SST-2,
    and any single-sentence or pair task in that format."""

    def read(self, path: Path) -> list[Any]:
        return read_tsv(path)

    def texts(self, examples: list[Any]) -> list[str]:
        return [t for e in examples for t in (e.text, e.text_pair) if t]

    def fit_classes(self, examples: list[Any]) -> list[str]:
        """Labels 0..K-1, each of them used: a gap means a stray label (set data.class_names)."""
        counts = Counter(e.label for e in examples)
        classes = range(max(counts) + 1)
        if missing := [c for c in classes if not counts[c]]:
            stray = next(e for e in examples if e.label == max(counts))
            raise DataError(
                f"{self._path('train')}: labels {sorted(counts)} leave out {missing}; a stray "
                f"label? (line {stray.line}: {stray.label}) Set data.class_names to the classes"
            )
        return [str(c) for c in classes]

    def encode(self, examples: list[Any], path: Path) -> list[Item]:
        pairs = examples[0].text_pair is not None
        budget = self.max_len - (3 if pairs else 2)
        a_ids = self.tokenizer.encode_batch([e.text for e in examples])
        b_ids = self.tokenizer.encode_batch([e.text_pair for e in examples]) if pairs else None
        tok, items = self.tokenizer, []
        for n, e in enumerate(examples):
            if not 0 <= e.label < self.num_classes:
                raise DataError(
                    f"{path}:{e.line}: label {e.label} is outside the {self.num_classes} "
                    f"classes {self.classes} (data.class_names)"
                )
            a = a_ids[n]
            if b_ids is None:
                ids = [tok.cls_id, *a[:budget], tok.sep_id]
                segments = [0] * len(ids)
            else:
                b = b_ids[n]
                while len(a) + len(b) > budget:
                    a, b = (a[:-1], b) if len(a) > len(b) else (a, b[:-1])
                ids = [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
                segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
            items.append((ids, segments, e.label))
        return items


class TokenClassificationDataModule(LabelledTextDataModule):
    """CoNLL files (``word ... tag`` per line, blank lines between sentences): one label per word,
    on its first WordPiece; the other pieces and the specials are not scored (-100)."""

    def read(self, path: Path) -> list[Any]:
        return read_conll(path)

    def texts(self, examples: list[Any]) -> list[str]:
        return [" ".join(words) for words, _ in examples]

    def fit_classes(self, examples: list[Any]) -> list[str]:
        return sorted({tag for _, tags in examples for tag in tags})

    def encode(self, examples: list[Any], path: Path) -> list[Item]:
        index = {c: i for i, c in enumerate(self.classes)}
        tok, items = self.tokenizer, []
        for words, tags in examples:
            if unknown := sorted(set(tags) - set(index)):
                raise DataError(
                    f"{path}: tags {unknown} do not occur in the training file (classes {self.classes})"
                )
            ids, labels = [tok.cls_id], [-100]
            for word, tag in zip(words, tags, strict=True):
                pieces = self.tokenizer.encode(word) or [tok.unk_id]
                ids += pieces
                labels += [index[tag]] + [-100] * (len(pieces) - 1)
            ids = ids[: self.max_len - 1] + [tok.sep_id]
            labels = labels[: self.max_len - 1] + [-100]
            items.append((ids, [0] * len(ids), labels))
        return items

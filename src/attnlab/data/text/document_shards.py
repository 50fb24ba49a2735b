"""Document shards for BERT pre-training (``attnlab-prepare --mode bert``, kind ``documents``): a
corpus read as ``formats.read_corpus`` reads it, tokenised once with WordPiece, documents of fewer
than two tokens left out. A shard is ``<name>.tokens`` (ids end to end), ``<name>.sentences`` and
``<name>.documents`` (int64 offsets); the first ``val_docs`` documents validate, the next
``test_docs`` test, the rest train.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.core.errors import DataError
from attnlab.data.remote import RemotePath
from attnlab.data.shards.folder import SPLITS, Location
from attnlab.data.shards.writer import (
    ShardWriter,
    check_count,
    counted,
    parallel,
    prepares,
    progress_bar,
)
from attnlab.data.text.shards import (
    Encoder,
    TextShards,
    check_vocab_size,
    head,
    locate,
    source_files,
    text_chunks,
    text_manifest,
    token_dtype,
)
from attnlab.data.text.tokenizers import WordPieceTokenizer

PARTS = ("tokens", "sentences", "documents")  # the files of a shard, by suffix
Document = list[list[int]]  # its sentences' token ids


# ---- tokenising ---------------------------------------------------------------------------------


def fit_wordpiece(files: Sequence[Path], vocab_size: int, sample_bytes: int) -> WordPieceTokenizer:
    """WordPiece trained on the sentences of the first ``sample_bytes`` of the corpus."""
    check_vocab_size(vocab_size)
    text = head(text_chunks(files, 1 << 22), sample_bytes)
    lines = [s for chunk in text for line in chunk.splitlines() if (s := line.strip())]
    if not lines:
        raise DataError(f"{', '.join(map(str, files))}: no sentences (non-blank lines) to train WordPiece on")
    return WordPieceTokenizer.fit(lines, vocab_size)


@dataclass
class Chunk:
    """A piece of text tokenised: its sentences' ids end to end, each sentence's length, whether a
    document starts at it (a blank line before it), and whether blank lines follow the last."""

    ids: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray
    blank_after: bool


class DocumentEncoder(Encoder):
    """Text (whole lines) -> ``Chunk``."""

    def __call__(self, text: str) -> Chunk:
        sentences, starts, blank = [], [], False
        for line in text.splitlines():
            if s := line.strip():
                sentences.append(s)
                starts.append(blank)
                blank = False
            else:
                blank = True
        ids, lengths, kept_starts, carry = [], [], [], False
        for seq, start in zip(self.tokenizer.encode_batch(sentences), starts, strict=True):
            if not seq:  # a sentence of nothing the vocabulary knows: dropped, as in memory
                carry = carry or start
                continue
            ids += seq
            lengths.append(len(seq))
            kept_starts.append(start or carry)
            carry = False
        return Chunk(
            np.asarray(ids, dtype=self.dtype),
            np.asarray(lengths, dtype=np.int64),
            np.asarray(kept_starts, dtype=bool),
            blank or carry,
        )


# ---- writing ------------------------------------------------------------------------------------


class DocumentWriter(ShardWriter):
    """Documents of one split into shards of about ``shard_tokens`` tokens (a document is never
    cut between shards): the token ids and the two offset files, written as they come."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        super().__init__(folder, split, PARTS)
        self.dtype, self.shard_tokens = dtype, shard_tokens

    def write(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """One document: its ids and its sentences' lengths."""
        if not self.files or self.shards[-1]["tokens"] >= self.shard_tokens:
            self.open(tokens=0, sentences=0, documents=0)
            for p in ("sentences", "documents"):
                super().write(p, np.zeros(1, dtype=np.int64))  # offsets start at 0
        shard = self.shards[-1]
        super().write("tokens", ids.astype(self.dtype))
        super().write("sentences", (shard["tokens"] + np.cumsum(lengths)).astype(np.int64))
        super().write("documents", np.array([shard["sentences"] + len(lengths)], dtype=np.int64))
        shard["tokens"] += len(ids)
        shard["sentences"] += len(lengths)
        shard["documents"] += 1


class DocumentRouter:
    """Sentences in corpus order -> whole documents -> the validation, test or training writer."""

    def __init__(self, writers: dict[str, DocumentWriter], val_docs: int, test_docs: int) -> None:
        self.writers, self.held_out = writers, {"val": val_docs, "test": test_docs}
        self.ids: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.new_document = True
        self.short = 0  # documents of fewer than two tokens, left out

    def add(self, chunk: Chunk) -> None:
        starts = np.flatnonzero(chunk.starts).tolist()
        if self.new_document:
            starts = [0, *(s for s in starts if s)]
        bounds = [*starts, len(chunk.lengths)]
        ends = np.concatenate([[0], np.cumsum(chunk.lengths)])
        first = bounds[0]
        if first:  # the sentences before the first start continue the open document
            self._extend(chunk, ends, 0, first)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            self.end_document()
            self._extend(chunk, ends, a, b)
        self.new_document = chunk.blank_after or (self.new_document and not len(chunk.lengths))

    def _extend(self, chunk: Chunk, ends: np.ndarray, a: int, b: int) -> None:
        if b > a:
            self.ids.append(chunk.ids[ends[a] : ends[b]])
            self.lengths.append(chunk.lengths[a:b])

    def end_document(self) -> None:
        if not self.lengths:
            return
        ids, lengths = np.concatenate(self.ids), np.concatenate(self.lengths)
        self.ids, self.lengths = [], []
        if len(ids) < 2:  # too short to cut in two
            self.short += 1
            return
        split = next((s for s in ("val", "test") if self.held_out[s] > 0), "train")
        if split != "train":
            self.held_out[split] -= 1
        self.writers[split].write(ids, lengths)


@prepares
def prepare_documents(
    inputs: Sequence[str],
    partial: Path,
    vocab_size: int = 8000,
    val_docs: int = 2000,
    test_docs: int = 2000,
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    chunk_bytes: int = 1 << 22,
    sample_bytes: int = 100 << 20,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise the documents of the files ``inputs`` name (paths or globs) with WordPiece into
    document shards in ``out_dir``; return the manifest. Written into ``<out_dir>.partial`` and
    moved into place at the end, as ``shards.prepare`` does."""
    check_count("val_docs", val_docs, why=" (a split to score)")
    check_count("test_docs", test_docs, why=" (a split to score)")
    check_count("shard_tokens", shard_tokens)
    files = source_files(inputs)

    tok = fit_wordpiece(files, vocab_size, sample_bytes)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: DocumentWriter(partial, s, dtype, shard_tokens) for s in SPLITS}
    router = DocumentRouter(writers, val_docs, test_docs)
    encoder = DocumentEncoder(tok.to_json(), dtype)
    with progress_bar(progress, sum(f.stat().st_size for f in files)) as advance, parallel(workers) as imap:
        for path in files:  # a file ends its last document
            for chunk in imap(encoder, counted(text_chunks([path], chunk_bytes), advance)):
                router.add(chunk)
            router.end_document()
            router.new_document = True
    for w in writers.values():
        w.close()
    counts = {s: sum(sh["documents"] for sh in writers[s].shards) for s in SPLITS}
    if counts["train"] == 0:
        raise DataError(
            f"{', '.join(inputs)}: {sum(counts.values())} document(s) of two or more tokens, none left "
            f"for training after {val_docs} validation and {test_docs} test documents"
        )
    splits = {s: writers[s].shards for s in SPLITS}
    return text_manifest("documents", tok, dtype, splits, files, short_documents=router.short)


# ---- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocumentShard:
    name: str
    paths: dict[str, Location]
    tokens: int
    sentences: int
    documents: int
    sha256: dict[str, str]

    def path(self, part: str) -> Location:
        return self.paths[part]


class DocumentShards(TextShards):
    """A folder of document shards: each split's shards, their files inside the folder and of
    their sizes; checked (sha256, ids) the first time this process reads a shard (``verify``)."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        super().__init__(folder, "documents")
        with self.reading():
            self.splits = {
                s: [
                    DocumentShard(e["name"], p, int(e["tokens"]), int(e["sentences"]), int(e["documents"]), h)
                    for e, p, h in self.shards(s, PARTS)
                ]
                for s in SPLITS
            }
        for shard in (shard for split in SPLITS for shard in self.splits[split]):
            self.check_tokens(shard.path("tokens"), shard.tokens)
            self.check_offsets(shard.path("sentences"), shard.sentences, "sentence")
            self.check_offsets(shard.path("documents"), shard.documents, "document")
            if shard.documents == 0:
                raise DataError(f"{shard.path('documents')}: an empty shard (no documents)")

    def verify(self, shard: DocumentShard) -> None:
        """Check the files of ``shard`` (sha256; ids in the vocabulary) unless this process did."""
        for part in PARTS:
            self._verify(shard.path(part), shard.sha256[part], ids=part == "tokens")

    def documents(self, split: str) -> int:
        return sum(s.documents for s in self.splits[split])

    def read(self, shard: DocumentShard, first: int, n: int) -> list[Document]:
        """Documents ``first .. first + n - 1`` of a shard."""
        self.verify(shard)  # a set lookup once checked
        docs = self.offsets(shard.path("documents"), first, n + 1)
        sents = self.offsets(shard.path("sentences"), int(docs[0]), int(docs[-1] - docs[0]) + 1)
        ids = self.ids(shard.path("tokens"), int(sents[0]), int(sents[-1] - sents[0])).tolist()
        sents, docs = (sents - sents[0]).tolist(), (docs - docs[0]).tolist()
        return [
            [ids[sents[k] : sents[k + 1]] for k in range(docs[d], docs[d + 1])] for d in range(len(docs) - 1)
        ]

    def read_split(self, split: str) -> list[Document]:
        """A whole (small) split in memory: validation and test."""
        return [d for s in self.splits[split] for d in self.read(s, 0, s.documents)]


class ShardDocuments(Sequence):
    """The training documents of all shards as one sequence, each read from disk when indexed:
    what ``make_pair`` takes (it draws a document, and another one for a random next segment)."""

    def __init__(self, shards: DocumentShards) -> None:
        self.shards, self.parts = shards, shards.splits["train"]
        for shard in self.parts:  # here, before the loader's workers start: each checks none again
            shards.verify(shard)
        self.ends = np.cumsum([s.documents for s in self.parts])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, i: int) -> Document:
        k, first = locate(self.ends, i)
        return self.shards.read(self.parts[k], first, 1)[0]

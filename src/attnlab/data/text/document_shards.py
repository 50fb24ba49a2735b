"""Document shards for BERT pre-training (``attnlab-prepare --mode bert``, ``data=bert_shards``): a
corpus of any size tokenised once with a WordPiece vocabulary into flat arrays on disk, and a
stream of MLM + NSP batches built from them as they are drawn.

The corpus is plain text as the in-memory path reads it (``formats.read_corpus``): one sentence
per line, documents separated by blank lines (and by the end of each file). Each shard is three
files: ``<name>.tokens`` (the token ids of its sentences, one after another), ``<name>.sentences``
(int64 offsets into them: sentence ``k`` is ``tokens[s[k]:s[k + 1]]``) and ``<name>.documents``
(int64 offsets into the sentences). A document is read with three ``np.fromfile`` calls at an
offset, so training holds neither the text nor its tokens; documents shorter than two tokens are
left out, as in memory. The first ``val_docs`` documents validate, the next ``test_docs`` are the
test split, the rest train.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.remote import RemotePath, location, read_array
from attnlab.data.sampling import stream_batch_numbers
from attnlab.data.text.masked_lm import Document, make_pair, masked_batch
from attnlab.data.text.shards import (
    SPLITS,
    _counted,
    _pool,
    _progress,
    check_file,
    check_free,
    check_vocab_size,
    file_sha256,
    manifest_file,
    manifest_vocab,
    prepares,
    publish,
    read_manifest,
    source_files,
    start_partial,
    text_chunks,
    token_dtype,
    tokenizer_sha256,
    verify_file,
)
from attnlab.data.text.tokenizers import WordPieceTokenizer, tokenizer_from_json

PARTS = ("tokens", "sentences", "documents")  # the files of a shard, by suffix


# ---- tokenising ---------------------------------------------------------------------------------


def fit_wordpiece(files: Sequence[Path], vocab_size: int, sample_bytes: int) -> WordPieceTokenizer:
    """WordPiece trained on the sentences of the first ``sample_bytes`` of the corpus."""
    check_vocab_size(vocab_size)
    lines, size = [], 0
    for text, n in text_chunks(files, 1 << 22):
        lines += [s for line in text.splitlines() if (s := line.strip())]
        size += n
        if size >= sample_bytes:
            break
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


class DocumentEncoder:
    """Text (whole lines) -> ``Chunk``; picklable, so worker processes each hold one."""

    def __init__(self, tokenizer_json: str, dtype: str) -> None:
        self.tokenizer_json, self.dtype = tokenizer_json, dtype
        self.tokenizer: WordPieceTokenizer | None = None

    def __call__(self, text: str) -> Chunk:
        if self.tokenizer is None:
            self.tokenizer = tokenizer_from_json(self.tokenizer_json)
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


class DocumentWriter:
    """Documents of one split into shards of about ``shard_tokens`` tokens (a document is never
    cut between shards): the token ids and the two offset files, written as they come."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.files: dict[str, Any] = {}

    def write(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """One document: its ids and its sentences' lengths."""
        if not self.files or self.shards[-1]["tokens"] >= self.shard_tokens:
            self._next()
        shard = self.shards[-1]
        ids.astype(self.dtype).tofile(self.files["tokens"])
        (shard["tokens"] + np.cumsum(lengths)).astype(np.int64).tofile(self.files["sentences"])
        np.array([shard["sentences"] + len(lengths)], dtype=np.int64).tofile(self.files["documents"])
        shard["tokens"] += len(ids)
        shard["sentences"] += len(lengths)
        shard["documents"] += 1

    def _next(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):05d}"
        self.files = {p: open(self.folder / f"{name}.{p}", "wb") for p in PARTS}  # noqa: SIM115
        for p in ("sentences", "documents"):
            np.zeros(1, dtype=np.int64).tofile(self.files[p])  # offsets start at 0
        self.shards.append({"name": name, "tokens": 0, "sentences": 0, "documents": 0})

    def close(self) -> None:
        if self.files:
            for f in self.files.values():
                f.close()
            shard = self.shards[-1]
            shard["sha256"] = {p: file_sha256(self.folder / f"{shard['name']}.{p}") for p in PARTS}
            self.files = {}


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
    out_dir: str | os.PathLike,
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
    out = Path(out_dir)
    check_free(out)
    for name, value in (("val_docs", val_docs), ("test_docs", test_docs)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer (a split to score), got {value!r}")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be a positive integer, got {shard_tokens!r}")
    files = source_files(inputs)
    partial = start_partial(out)

    tok = fit_wordpiece(files, vocab_size, sample_bytes)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: DocumentWriter(partial, s, dtype, shard_tokens) for s in SPLITS}
    router = DocumentRouter(writers, val_docs, test_docs)
    encoder = DocumentEncoder(tok.to_json(), dtype)
    with _progress(progress, sum(f.stat().st_size for f in files)) as advance, _pool(workers) as pool:
        for path in files:  # a file ends its last document
            texts = (text for text, _ in _counted(text_chunks([path], chunk_bytes), advance))
            for chunk in pool.imap(encoder, texts) if pool else map(encoder, texts):
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
    manifest = {
        "version": 1,
        "kind": "documents",
        "tokenizer": tok.to_json(),
        "tokenizer_sha256": tokenizer_sha256(tok.to_json()),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "splits": {s: writers[s].shards for s in SPLITS},
        "short_documents": router.short,
        "sources": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
    }
    publish(partial, out, manifest)
    return manifest


# ---- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocumentShard:
    folder: Path | RemotePath
    name: str
    tokens: int
    sentences: int
    documents: int
    sha256: dict[str, str]

    def path(self, part: str) -> Path | RemotePath:
        return self.folder / f"{self.name}.{part}"


class DocumentShards:
    """A folder from ``prepare_documents`` (local, or at an ``s3://``, ``gs://`` or ``https://``
    URL): its tokenizer and each split's shards, checked against the manifest: at opening, the
    files inside the folder and of their sizes; the first time this process reads a shard
    (``verify``), their sha256 and the token ids against the vocabulary."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        self.folder = location(folder)
        manifest = read_manifest(self.folder, "documents")
        try:
            self.dtype = np.dtype(manifest["dtype"])
            if self.dtype not in (np.uint16, np.uint32):
                raise ValueError(f"dtype {manifest['dtype']!r}, not uint16 or uint32")
            self.tokenizer_json: str = manifest["tokenizer"]
            entries = manifest["splits"]
            self.splits = {s: [self._shard(s, i, e) for i, e in enumerate(entries[s])] for s in SPLITS}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(
                f"{self.folder / 'manifest.json'}: not a readable manifest ({type(e).__name__}: {e})"
            ) from None
        self.vocab_size = manifest_vocab(self.folder, self.tokenizer_json)
        self.verified: set[str] = set()  # shards whose files this process checked
        for split in SPLITS:
            for shard in self.splits[split]:
                for part, (size, what) in self._sizes(shard).items():
                    check_file(shard.path(part), size, what)
                if shard.documents == 0:
                    raise DataError(f"{shard.path('documents')}: an empty shard (no documents)")

    def _shard(self, split: str, i: int, e: dict[str, Any]) -> DocumentShard:
        for part in PARTS:  # each of its files inside the folder
            manifest_file(self.folder, f"{e['name']}.{part}", f"splits.{split}[{i}].name")
        sha256 = {part: e["sha256"][part] for part in PARTS}
        counts = (int(e["tokens"]), int(e["sentences"]), int(e["documents"]))
        return DocumentShard(self.folder, e["name"], *counts, sha256)

    def _sizes(self, shard: DocumentShard) -> dict[str, tuple[int, str]]:
        return {
            "tokens": (shard.tokens * self.dtype.itemsize, f"{shard.tokens} tokens of {self.dtype}"),
            "sentences": ((shard.sentences + 1) * 8, f"{shard.sentences} sentence offsets"),
            "documents": ((shard.documents + 1) * 8, f"{shard.documents} document offsets"),
        }

    def verify(self, shard: DocumentShard) -> None:
        """Check the files of ``shard`` (sha256; ids in the vocabulary) unless this process did."""
        if shard.name in self.verified:
            return
        for part in PARTS:
            dtype = self.dtype if part == "tokens" else None
            verify_file(shard.path(part), shard.sha256[part], dtype, self.vocab_size)
        self.verified.add(shard.name)

    def tokenizer(self) -> WordPieceTokenizer:
        return tokenizer_from_json(self.tokenizer_json)

    def documents(self, split: str) -> int:
        return sum(s.documents for s in self.splits[split])

    def read(self, shard: DocumentShard, first: int, n: int) -> list[Document]:
        """Documents ``first .. first + n - 1`` of a shard."""
        self.verify(shard)  # a set lookup once checked
        offsets = np.dtype(np.int64)
        docs = read_array(shard.path("documents"), offsets, n + 1, 8 * first)
        sents = read_array(shard.path("sentences"), offsets, int(docs[-1] - docs[0]) + 1, 8 * int(docs[0]))
        ids = read_array(
            shard.path("tokens"), self.dtype, int(sents[-1] - sents[0]), self.dtype.itemsize * int(sents[0])
        ).tolist()
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
        k = int(np.searchsorted(self.ends, i, side="right"))
        first = i - (int(self.ends[k - 1]) if k else 0)
        return self.shards.read(self.parts[k], first, 1)[0]


class PairStream(IterableDataset):
    """Endless MLM + NSP batches from ``docs`` (a list, or ``ShardDocuments``), built as the
    in-memory path builds them (``make_pair``, ``masked_batch``): batch ``n`` draws documents
    uniformly, with replacement, and its cuts, partners and masks from generators seeded by
    ``(seed, n)``, as many pairs as ``max_tokens`` holds with padding. A resumed run (``start``)
    sees the batches the uninterrupted one would have, and ranks and loader workers interleave
    the batch numbers (``stream_batch_numbers``)."""

    def __init__(
        self,
        docs: Sequence[Document],
        max_len: int,
        max_tokens: int,
        vocab_size: int,
        mask_prob: float,
        seed: int,
    ) -> None:
        self.docs, self.max_len, self.max_tokens = docs, max_len, max_tokens
        self.vocab_size, self.mask_prob, self.seed = vocab_size, mask_prob, seed
        self.start = 0

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        seed = self.seed * 1_000_003 + index
        rng, items, longest = random.Random(seed), [], 0
        while True:
            pair = make_pair(self.docs, rng.randrange(len(self.docs)), rng, self.max_len)
            longest_if_added = max(longest, len(pair[0]))
            if items and longest_if_added * (len(items) + 1) > self.max_tokens:
                break
            items.append(pair)
            longest = longest_if_added
        return masked_batch(items, self.vocab_size, self.mask_prob, torch.Generator().manual_seed(seed))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for index in stream_batch_numbers(self.start):
            yield self.batch(index)

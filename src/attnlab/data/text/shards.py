"""Text shards, written once by ``attnlab-prepare`` and read a piece at a time as training goes
(plain reads: a memory map's pages would count towards the process's memory). Three kinds:
``tokens`` (nanoGPT's ``train.bin`` cut), ``documents`` (BERT's corpus) and ``pairs`` (translation)."""

from __future__ import annotations

import codecs
import functools
import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice, zip_longest
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.run_record import sha256_file
from attnlab.data.remote import RemotePath, read_arrays
from attnlab.data.sampling import BatchStream
from attnlab.data.shards.folder import MANIFEST, SPLITS, Location, Shard, ShardFolder, check_file
from attnlab.data.shards.writer import ShardWriter, check_count, counted, parallel, prepares, progress_bar
from attnlab.data.text.tokenizers import (
    BPETokenizer,
    CharTokenizer,
    SubwordTokenizer,
    WordPieceTokenizer,
    tokenizer_from_json,
)

__all__ = ["MANIFEST", "SPLITS"]
Tokenizer = CharTokenizer | BPETokenizer
T = TypeVar("T")


def source_files(patterns: Sequence[str]) -> list[Path]:
    """The files named by ``patterns`` (paths or globs), in order, each once."""
    files: list[Path] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not found:
            raise DataError(f"{pattern}: no file matches")
        for path in map(Path, found):
            if not path.is_file():
                raise DataError(f"{path}: not a file")
            files.append(path)
    return list(dict.fromkeys(files))


def text_chunks(files: Sequence[Path], chunk_bytes: int) -> Iterator[tuple[str, int]]:
    """The text of ``files`` in pieces of about ``chunk_bytes``, each cut after a newline where
    there is one, with the bytes read for each piece."""
    for path in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset, rest = 0, ""
        with open(path, "rb") as f:
            try:
                while block := f.read(chunk_bytes):
                    text = rest + decoder.decode(block)
                    cut = text.rfind("\n") + 1 or len(text)
                    rest = text[cut:]
                    offset += len(block)
                    yield text[:cut], len(block)
                rest += decoder.decode(b"", final=True)
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text near byte {offset + e.start} ({e.reason})") from None
        if rest:
            yield rest, 0


def head(items: Iterable[tuple[T, int]], nbytes: int) -> Iterator[T]:
    """The items of ``(item, bytes read for it)`` until ``nbytes`` were read (tokenizers' merges
    settle long before a large corpus ends)."""
    size = 0
    for item, n in items:
        yield item
        size += n
        if size >= nbytes:
            return


def fit_tokenizer(files: Sequence[Path], kind: str, vocab_size: int, sample_bytes: int) -> Tokenizer:
    """A character vocabulary (one pass over every file), or byte-level BPE of the first ``sample_bytes``."""
    if kind == "char":
        chars: set[str] = set()
        for text, _ in text_chunks(files, 1 << 24):
            chars.update(text)
        return CharTokenizer("".join(sorted(chars)))
    if kind == "bpe":
        check_vocab_size(vocab_size)
        return BPETokenizer.fit("".join(head(text_chunks(files, 1 << 22), sample_bytes)), vocab_size)
    raise ConfigError(f"tokenizer must be 'char' or 'bpe', got {kind!r}")


class Encoder:
    """Text -> ids with the tokenizer ``tokenizer_json`` names, loaded on first use: picklable, so
    worker processes each hold one."""

    def __init__(self, tokenizer_json: str, dtype: str) -> None:
        self.tokenizer_json, self.dtype = tokenizer_json, dtype

    @functools.cached_property
    def tokenizer(self) -> Any:
        return tokenizer_from_json(self.tokenizer_json)


class ChunkEncoder(Encoder):
    """Text -> token ids as a numpy array (characters through one table lookup)."""

    table: np.ndarray | None = None

    def __call__(self, text: str) -> np.ndarray:
        tok = self.tokenizer
        if not isinstance(tok, CharTokenizer):
            return np.asarray(tok.encode(text), dtype=self.dtype)
        if self.table is None:  # code point -> id
            points = np.array([ord(c) for c in tok.chars], dtype=np.int64)
            self.table = np.full(points.max() + 1, -1, dtype=np.int64)
            self.table[points] = np.arange(len(points))
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self.table[np.minimum(points, len(self.table) - 1)]
        if (ids < 0).any() or (points >= len(self.table)).any():
            tok.encode(text)  # raises, naming the characters
        return ids.astype(self.dtype)


def encode_files(
    files: Sequence[Path],
    encoder: Callable[[str], T],
    take: Callable[[T], Any],
    chunk_bytes: int,
    workers: int,
    progress: bool,
    end_file: Callable[[], Any] = lambda: None,
) -> None:
    """Each chunk of ``files`` through ``encoder`` (in ``workers`` processes) into ``take``, in
    order, ``end_file()`` after each file; the progress in source bytes."""
    with progress_bar(progress, sum(f.stat().st_size for f in files)) as advance, parallel(workers) as imap:
        for path in files:
            for item in imap(encoder, counted(text_chunks([path], chunk_bytes), advance)):
                take(item)
            end_file()


def locate(ends: np.ndarray, i: int) -> tuple[int, int]:
    """Item ``i`` of shards whose items end (cumulatively) at ``ends``: its shard and its index there."""
    k = int(np.searchsorted(ends, i, side="right"))
    return k, i - (int(ends[k - 1]) if k else 0)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# Four times the largest vocabularies in use; the trainers allocate for the size asked before they
# read any text (a billion: a 70 GB allocation, and the process aborts).
MAX_VOCAB_SIZE = 1 << 20


def check_vocab_size(n: int) -> None:
    """A vocabulary size a tokenizer can be trained to."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_VOCAB_SIZE:
        raise ConfigError(f"vocab_size must be an integer from 1 to {MAX_VOCAB_SIZE}, got {n!r}")


def split_shares(source: Any) -> tuple[float, float]:
    """The validation and test shares of the text a source holds (its ``val_size``, ``test_size``;
    null: 5% each), refused unless each is between 0 and 1 with room left for training."""
    shares = (getattr(source, f"{s}_size", None) for s in ("val", "test"))
    val_size, test_size = (0.05 if share is None else share for share in shares)
    if not (0.0 < val_size < 1.0 and 0.0 < test_size < 1.0 and val_size + test_size < 1.0):
        raise ConfigError(
            f"data.source.val_size ({val_size}) and data.source.test_size ({test_size}) must be "
            "shares between 0 and 1, with room left for training"
        )
    return val_size, test_size


def text_manifest(kind: str, tok: Any, dtype: str, splits: dict, files: Sequence[Path], **extra: Any) -> dict:
    """The manifest of a text kind: its own keys, the tokenizer (and hash), dtype, splits, sources."""
    tokenizer = tok.to_json()
    return {
        "version": 1,
        "kind": kind,
        **extra,
        "tokenizer": tokenizer,
        "tokenizer_sha256": hashlib.sha256(tokenizer.encode()).hexdigest(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "splits": splits,
        "sources": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
    }


class TextShards(ShardFolder):
    """A prepared folder of a text kind: its tokenizer and the dtype of its ids."""

    def __init__(self, folder: str | os.PathLike | RemotePath, kind: str) -> None:
        super().__init__(folder, kind)
        with self.reading():
            self.dtype = np.dtype(self.manifest["dtype"])
            if self.dtype not in (np.uint16, np.uint32):  # a signed type's negative ids would pass a max
                raise ValueError(f"dtype {self.manifest['dtype']!r}, not uint16 or uint32")
            self.tokenizer_json: str = self.manifest["tokenizer"]
        try:
            self.vocab_size = tokenizer_from_json(self.tokenizer_json).vocab_size
        except Exception as e:  # noqa: BLE001 (json, KeyError, the tokenizers library's own errors)
            why = f"its tokenizer: {type(e).__name__}: {e}"
            raise DataError(f"{self.manifest_path}: not a readable manifest ({why})") from None

    def tokenizer(self) -> Any:
        return tokenizer_from_json(self.tokenizer_json)

    def own_tokenizer(self, current: Any, **asked: Any) -> Any:
        """The shards' tokenizer: a checkpoint's (``current``) must be it, and each data key
        ``asked`` (``vocab_size=8000``) null or what the shards have (their manifest's)."""
        if current is not None:  # a checkpoint's run: its tokenizer is the shards', whatever the keys
            if current.to_json() != self.tokenizer_json:
                raise DataError(
                    f"{self.folder}: its shards were made with another tokenizer than the checkpoint's "
                    "(the manifest's tokenizer differs); prepare them with the run's tokenizer"
                )
            return current
        tok = self.tokenizer()
        has = {"tokenizer": tok.kind, "vocab_size": tok.vocab_size}
        for key, value in asked.items():
            if value is not None and value != has[key]:
                raise ConfigError(
                    f"data.{key}={value!r}: the shards at {self.folder} have {key} {has[key]!r} "
                    "(their manifest's); set it to that, or null"
                )
        return tok

    def verify_part(self, shard: Any, part: str, keep: bool = False) -> bytes:
        """Check the file ``part`` of a shard (sha256; ids below the vocabulary) unless this process did."""
        ids = self.dtype if part.endswith("tokens") else None
        return self.verify_once(shard.paths[part], shard.sha256[part], ids, self.vocab_size, keep)

    def check_tokens(self, path: Location, tokens: int) -> None:
        check_file(path, tokens * self.dtype.itemsize, f"{tokens} tokens of {self.dtype}")

    def check_offsets(self, path: Location, n: int, what: str) -> None:
        check_file(path, (n + 1) * 8, f"{n} {what} offsets")

    def ids(self, path: Location, start: int, n: int) -> np.ndarray:
        return read_arrays([(path, start * self.dtype.itemsize, n)], self.dtype)[0]

    def offsets(self, path: Location, start: int, n: int) -> np.ndarray:
        return read_arrays([(path, start * 8, n)], np.dtype(np.int64))[0]


@dataclass(frozen=True)
class PartShard:
    """A shard of files ``<name>.<part>`` (documents, pairs): its manifest ``entry`` (name and
    counts), each part's file and sha256."""

    entry: dict[str, Any]
    paths: dict[str, Location]
    sha256: dict[str, str]

    def path(self, *part: str) -> Location:
        return self.paths[".".join(part)]

    def count(self, key: str) -> int:
        return int(self.entry[key])


# ---- tokens (language modelling) -----------------------------------------------------------------


class SplitWriter(ShardWriter):
    """Token ids of one split into files of at most ``shard_tokens`` tokens each."""

    def __init__(self, folder: Path, split: str, shard_tokens: int) -> None:
        super().__init__(folder, split, ["bin"])
        self.shard_tokens = shard_tokens

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if not self.files or self.shards[-1]["tokens"] == self.shard_tokens:
                self.open(tokens=0)
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            super().write("bin", part)
            self.shards[-1]["tokens"] += len(part)


@prepares
def prepare(
    inputs: Sequence[str],
    partial: Path,
    tokenizer: str = "char",
    vocab_size: int = 1024,
    val_tokens: int = 100_000,
    test_tokens: int = 100_000,
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    chunk_bytes: int = 1 << 22,
    bpe_sample_bytes: int = 100 << 20,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise the files ``inputs`` name into token shards in ``out_dir``; return the manifest. The
    first ``val_tokens`` validate, the next ``test_tokens`` test (a stream's end is not known
    before it comes), the rest trains."""
    check_count("val_tokens", val_tokens, 0)
    check_count("test_tokens", test_tokens, 0)
    check_count("shard_tokens", shard_tokens)
    files = source_files(inputs)

    tok = fit_tokenizer(files, tokenizer, vocab_size, bpe_sample_bytes)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: SplitWriter(partial, s, shard_tokens) for s in SPLITS}
    held_out = {"val": val_tokens, "test": test_tokens}

    def route(ids: np.ndarray) -> None:
        for split in held_out:
            take = min(held_out[split], len(ids))
            writers[split].write(ids[:take])
            held_out[split] -= take
            ids = ids[take:]
        writers["train"].write(ids)

    encode_files(files, ChunkEncoder(tok.to_json(), dtype), route, chunk_bytes, workers, progress)
    for w in writers.values():
        w.close()
    tokens = {s: sum(x["tokens"] for x in writers[s].shards) for s in SPLITS}
    if not tokens["train"]:  # an empty corpus, or one the held-out splits took
        if not sum(tokens.values()):
            raise DataError(f"{', '.join(inputs)}: no text (0 tokens); nothing to prepare")
        raise DataError(
            f"{', '.join(inputs)}: {sum(tokens.values())} tokens, none left for training after "
            f"{tokens['val']} validation and {tokens['test']} test tokens; lower --val-tokens / --test-tokens"
        )
    return text_manifest("tokens", tok, dtype, {s: writers[s].shards for s in SPLITS}, files)


class TokenShards(TextShards):
    """A folder of token shards, each checked (sha256, ids) the first time this process reads it."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        super().__init__(folder, "tokens")
        with self.reading():
            self.splits = {
                s: [Shard(p[""], int(e["tokens"]), h[""]) for e, p, h in self.shards(s)] for s in SPLITS
            }
        for shard in (shard for split in SPLITS for shard in self.splits[split]):
            self.check_tokens(shard.path, shard.count)

    def verify(self, shard: Shard, keep: bool = False) -> bytes:
        """Check ``shard`` (sha256, ids) unless this process did; with ``keep``, its bytes (read
        in the same pass: the whole of a small split costs one read)."""
        return self.verify_once(shard.path, shard.sha256, self.dtype, self.vocab_size, keep)

    def tokens(self, split: str) -> int:
        return sum(s.count for s in self.splits[split])

    def read_windows(self, windows: list[tuple[Shard, int]], n: int) -> list[np.ndarray]:
        """``n`` tokens from each ``(shard, start)``: from object storage, one round trip for all."""
        for shard, _ in windows:
            self.verify(shard)
        size = self.dtype.itemsize
        return read_arrays([(shard.path, start * size, n) for shard, start in windows], self.dtype)

    def read_split(self, split: str) -> Tensor:
        """A whole (small) split in memory: validation and test."""
        parts = [np.frombuffer(self.verify(s, keep=True), dtype=self.dtype) for s in self.splits[split]]
        return torch.from_numpy(np.concatenate([np.zeros(0, self.dtype), *parts]).astype(np.int64))


class ShardWindows(BatchStream):
    """Endless batches of random windows from the training shards, as ``RandomWindows`` draws them
    from a tensor: a window lies inside one shard, each chosen in proportion to its windows."""

    def __init__(self, shards: TokenShards, max_len: int, batch_size: int, seed: int) -> None:
        self.shards, self.max_len, self.batch_size, self.seed = shards, max_len, batch_size, seed
        self.usable = [s for s in shards.splits["train"] if s.count > max_len + 1]
        if not self.usable:
            raise DataError(
                f"{shards.folder}: no training shard holds more than data.max_len + 1 = {max_len + 1} tokens"
            )
        for shard in self.usable:  # here, before the loader's workers start: each checks none again
            shards.verify(shard)
        self.weights = torch.tensor([float(s.count - max_len - 1) for s in self.usable])

    def batch(self, index: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        which = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=g)
        fractions = torch.rand(self.batch_size, generator=g, dtype=torch.float64)
        picks = [self.usable[i] for i in which.tolist()]
        starts = [
            int(u * (s.count - self.max_len - 1)) for s, u in zip(picks, fractions.tolist(), strict=True)
        ]
        rows = self.shards.read_windows(list(zip(picks, starts, strict=True)), self.max_len + 1)
        chunk = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        return chunk[:, :-1], chunk[:, 1:]


# ---- documents (BERT pre-training) ---------------------------------------------------------------

PARTS = ("tokens", "sentences", "documents")  # the files of a shard, by suffix
Document = list[list[int]]  # its sentences' token ids


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
        lines = [line.strip() for line in text.splitlines()]
        encoded = iter(self.tokenizer.encode_batch([s for s in lines if s]))
        ids, lengths, starts, blank = [], [], [], False
        for line in lines:
            seq = next(encoded) if line else []
            if not seq:  # a blank line, or a sentence of nothing the vocabulary knows: dropped, as in memory
                blank = blank or not line
                continue
            ids += seq
            lengths.append(len(seq))
            starts.append(blank)
            blank = False
        return Chunk(
            np.asarray(ids, self.dtype), np.asarray(lengths, np.int64), np.asarray(starts, bool), blank
        )


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
        self.sentences: list[np.ndarray] = []  # the open document's
        self.new_document = True
        self.short = 0  # documents of fewer than two tokens, left out

    def add(self, chunk: Chunk) -> None:
        ends = [0, *np.cumsum(chunk.lengths).tolist()]
        for k, start in enumerate(chunk.starts.tolist()):
            if start or self.new_document:
                self.end_document()
            self.new_document = False
            self.sentences.append(chunk.ids[ends[k] : ends[k + 1]])
        self.new_document |= chunk.blank_after

    def end_file(self) -> None:
        """A file ends its last document."""
        self.end_document()
        self.new_document = True

    def end_document(self) -> None:
        if not self.sentences:
            return
        ids = np.concatenate(self.sentences)
        lengths = np.array([len(s) for s in self.sentences])
        self.sentences = []
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
    """Tokenise the documents of the files ``inputs`` name with WordPiece into document shards in
    ``out_dir``; return the manifest. The first ``val_docs`` validate, the next ``test_docs`` test."""
    check_count("val_docs", val_docs, why=" (a split to score)")
    check_count("test_docs", test_docs, why=" (a split to score)")
    check_count("shard_tokens", shard_tokens)
    files = source_files(inputs)

    tok = fit_wordpiece(files, vocab_size, sample_bytes)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: DocumentWriter(partial, s, dtype, shard_tokens) for s in SPLITS}
    router = DocumentRouter(writers, val_docs, test_docs)
    encoder = DocumentEncoder(tok.to_json(), dtype)
    encode_files(files, encoder, router.add, chunk_bytes, workers, progress, router.end_file)
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


class DocumentShards(TextShards):
    """A folder of document shards, each checked (sha256, ids) the first time this process reads it."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        super().__init__(folder, "documents")
        with self.reading():
            self.splits = {s: [PartShard(*shard) for shard in self.shards(s, PARTS)] for s in SPLITS}
            for shard in (shard for split in SPLITS for shard in self.splits[split]):
                self.check_tokens(shard.path("tokens"), shard.count("tokens"))
                self.check_offsets(shard.path("sentences"), shard.count("sentences"), "sentence")
                self.check_offsets(shard.path("documents"), shard.count("documents"), "document")
                if shard.count("documents") == 0:
                    raise DataError(f"{shard.path('documents')}: an empty shard (no documents)")

    def verify(self, shard: PartShard) -> None:
        """Check the files of ``shard`` (sha256; ids in the vocabulary) unless this process did."""
        for part in PARTS:
            self.verify_part(shard, part)

    def read(self, shard: PartShard, first: int, n: int) -> list[Document]:
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
        return [d for s in self.splits[split] for d in self.read(s, 0, s.count("documents"))]


class ShardDocuments(Sequence):
    """The training documents of all shards as one sequence, each read from disk when indexed:
    what ``make_pair`` takes (it draws a document, and another one for a random next segment)."""

    def __init__(self, shards: DocumentShards) -> None:
        self.shards, self.parts = shards, shards.splits["train"]
        for shard in self.parts:  # here, before the loader's workers start: each checks none again
            shards.verify(shard)
        self.ends = np.cumsum([s.count("documents") for s in self.parts])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, i: int) -> Document:
        k, first = locate(self.ends, i)
        return self.shards.read(self.parts[k], first, 1)[0]


# ---- pairs (translation) -------------------------------------------------------------------------

Pair = tuple[str, str]
PairSource = tuple[list[Path], Callable[[], Iterator[tuple[Pair, int]]]]  # files, (pair, bytes read)


def lines(path: Path) -> Iterator[tuple[int, int, str]]:
    """Each line of a UTF-8 file (without its line end), with its number and size in bytes."""
    with open(path, "rb") as f:
        offset = 0
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: not UTF-8 text near byte {offset + e.start} (line {n}: {e.reason})"
                ) from None
            offset += len(raw)
            yield n, len(raw), text.rstrip("\r\n")


def tsv_pairs(path: Path) -> Iterator[tuple[Pair, int]]:
    for n, size, line in lines(path):
        cells = line.split("\t")
        if len(cells) < 2:
            raise DataError(f"{path}:{n}: no tab; expected source<TAB>target")
        yield (cells[0], cells[1]), size


def jsonl_pairs(path: Path, src: str, tgt: str) -> Iterator[tuple[Pair, int]]:
    for n, size, line in lines(path):
        try:
            row = json.loads(line)
            pair = (row[src], row[tgt])
        except (ValueError, KeyError, TypeError):
            raise DataError(
                f'{path}:{n}: expected a JSON object {{"{src}": "...", "{tgt}": "..."}}'
            ) from None
        if not all(isinstance(s, str) for s in pair):
            raise DataError(f"{path}:{n}: the {src!r} and {tgt!r} values must be strings")
        yield pair, size


def aligned_pairs(src_path: Path, tgt_path: Path) -> Iterator[tuple[Pair, int]]:
    """Line ``i`` of one file with line ``i`` of the other; files of different line counts refused."""
    n_a = n_b = 0
    for a, b in zip_longest(lines(src_path), lines(tgt_path)):  # zip would drop a line of the longer
        n_a, n_b = n_a + (a is not None), n_b + (b is not None)
        if a is not None and b is not None:
            yield (a[2], b[2]), a[1] + b[1]
    check_aligned(src_path, n_a, tgt_path, n_b)


def check_aligned(src_path: Location, n_src: int, tgt_path: Location, n_tgt: int) -> None:
    if n_src != n_tgt:
        raise DataError(
            f"parallel files differ in length: {src_path} has {n_src} lines, {tgt_path} has "
            f"{n_tgt}; line i of one must translate line i of the other"
        )


def pair_sources(inputs: Sequence[str], src: str, tgt: str) -> list[PairSource]:
    """Each input as (files, their reader): a ``.tsv`` or ``.jsonl`` file (or glob), else a prefix
    of two aligned files."""
    out: list[PairSource] = []
    for name in inputs:
        if name.endswith(".tsv"):
            out += [([f], functools.partial(tsv_pairs, f)) for f in source_files([name])]
        elif name.endswith(".jsonl"):
            out += [([f], functools.partial(jsonl_pairs, f, src, tgt)) for f in source_files([name])]
        else:
            files = [Path(f"{name}.{src}"), Path(f"{name}.{tgt}")]
            for f in files:
                if not f.is_file():
                    raise DataError(
                        f"{f}: no such file ({name!r} is neither a .tsv nor a .jsonl file, so it is read "
                        f"as the prefix of {files[0].name} and {files[1].name})"
                    )
            out.append((files, functools.partial(aligned_pairs, *files)))
    return out


class PairEncoder(Encoder):
    """A block of pairs -> per side, the ids end to end and each sentence's length."""

    def __call__(self, pairs: list[Pair]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for side in zip(*pairs, strict=True):
            ids = self.tokenizer.encode_batch(list(side))
            flat = np.fromiter((t for s in ids for t in s), dtype=self.dtype)
            out.append((flat, np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))))
        return out


class PairWriter(ShardWriter):
    """Tokenised blocks of training pairs into shards of about ``shard_tokens`` tokens."""

    def __init__(self, folder: Path, langs: tuple[str, str], shard_tokens: int) -> None:
        super().__init__(folder, "train", [f"{lang}.{p}" for lang in langs for p in ("tokens", "offsets")])
        self.langs, self.shard_tokens = langs, shard_tokens

    def write(self, sides: list[tuple[np.ndarray, np.ndarray]]) -> None:
        if not self.files or sum(self.shards[-1]["tokens"].values()) >= self.shard_tokens:
            self.open(pairs=0, tokens=dict.fromkeys(self.langs, 0))
            for lang in self.langs:
                super().write(f"{lang}.offsets", np.zeros(1, dtype=np.int64))
        shard = self.shards[-1]
        for lang, (ids, lengths) in zip(self.langs, sides, strict=True):
            super().write(f"{lang}.tokens", ids)
            super().write(f"{lang}.offsets", (shard["tokens"][lang] + np.cumsum(lengths)).astype(np.int64))
            shard["tokens"][lang] += len(ids)
        shard["pairs"] += len(sides[0][1])


@prepares
def prepare_pairs(
    inputs: Sequence[str],
    partial: Path,
    src_lang: str,
    tgt_lang: str,
    vocab_size: int = 8000,
    val_pairs: int = 1000,
    test_pairs: int = 1000,
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    block_pairs: int = 10_000,
    sample_bytes: int = 100 << 20,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise the parallel corpus ``inputs`` name into pair shards in ``out_dir``; return the
    manifest. The first ``val_pairs`` and ``test_pairs`` are kept as text (BLEU scores the
    references as written)."""
    if not (src_lang and tgt_lang) or src_lang == tgt_lang:
        raise ConfigError(
            f"--src-lang and --tgt-lang must name two languages, got {src_lang!r}, {tgt_lang!r}"
        )
    check_count("val_pairs", val_pairs, why=" (a split to score)")
    check_count("test_pairs", test_pairs, why=" (a split to score)")
    check_count("shard_tokens", shard_tokens)
    langs = (src_lang, tgt_lang)
    sources = pair_sources(inputs, *langs)
    files = [f for fs, _ in sources for f in fs]

    def read_pairs() -> Iterator[tuple[Pair, int]]:
        return chain.from_iterable(read() for _, read in sources)

    held = {"val": val_pairs, "test": test_pairs}
    check_vocab_size(vocab_size)
    sample = head(islice(read_pairs(), val_pairs + test_pairs, None), sample_bytes)  # training pairs
    tok = SubwordTokenizer.fit([s for pair in sample for s in pair], vocab_size)  # joint: both languages
    dtype = token_dtype(tok.vocab_size)
    writer = PairWriter(partial, langs, shard_tokens)
    with progress_bar(progress, sum(f.stat().st_size for f in files)) as advance, parallel(workers) as imap:
        stream = read_pairs()
        held_out = {split: write_text(partial, split, langs, stream, n, advance) for split, n in held.items()}
        pairs = counted(stream, advance)
        blocks = iter(lambda: list(islice(pairs, block_pairs)), [])  # lists of block_pairs, until none
        for sides in imap(PairEncoder(tok.to_json(), dtype), blocks):
            writer.write(sides)
    writer.close()
    if any(held_out[split]["pairs"] < n for split, n in held.items()):
        raise DataError(
            f"{', '.join(inputs)}: too few pairs for {val_pairs} validation and {test_pairs} test pairs"
        )
    if not writer.shards:
        raise DataError(
            f"{', '.join(inputs)}: no pairs left for training after {val_pairs} validation and "
            f"{test_pairs} test pairs"
        )
    splits = {"train": writer.shards, **held_out}
    return text_manifest("pairs", tok, dtype, splits, files, langs=list(langs))


def write_text(
    folder: Path, split: str, langs: tuple[str, str], stream: Iterator, n: int, advance: Callable
) -> dict[str, Any]:
    """The next ``n`` pairs as two line-aligned text files ``<split>.<lang>`` (a line break inside
    a JSONL sentence becomes a space)."""
    files = {lang: folder / f"{split}.{lang}" for lang in langs}
    count = 0
    with (
        open(files[langs[0]], "w", encoding="utf-8") as fa,
        open(files[langs[1]], "w", encoding="utf-8") as fb,
    ):
        for x, y in islice(counted(stream, advance), n):
            fa.write(" ".join(x.splitlines()) + "\n")
            fb.write(" ".join(y.splitlines()) + "\n")
            count += 1
    return {
        "pairs": count,
        "bytes": {lang: p.stat().st_size for lang, p in files.items()},
        "sha256": {lang: sha256_file(p) for lang, p in files.items()},
    }


class PairShards(TextShards):
    """A folder of pair shards (training) and held-out text, each file checked (sha256, ids) the
    first time this process reads it."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        super().__init__(folder, "pairs")
        with self.reading():
            self.langs: tuple[str, str] = tuple(self.manifest["langs"])
            parts = tuple(f"{lang}.{p}" for lang in self.langs for p in ("tokens", "offsets"))
            self.train = [PartShard(*shard) for shard in self.shards("train", parts)]
            self.text: dict[tuple[str, str], tuple[Location, str]] = {}  # (split, lang) -> file, sha256
            for s, lang in ((s, lang) for s in ("val", "test") for lang in self.langs):
                entry = self.manifest["splits"][s]
                path = self.file(f"{s}.{lang}", f"langs ({lang!r})")
                check_file(path, int(entry["bytes"][lang]), f"{entry['pairs']} lines of text")
                self.text[s, lang] = path, entry["sha256"][lang]
            for shard in self.train:
                if shard.count("pairs") == 0:
                    raise DataError(f"{shard.path(self.langs[0], 'offsets')}: an empty shard (no pairs)")
                for lang in self.langs:
                    self.check_tokens(shard.path(lang, "tokens"), int(shard.entry["tokens"][lang]))
                    self.check_offsets(shard.path(lang, "offsets"), shard.count("pairs"), "sentence")
        self.ends = np.cumsum([s.count("pairs") for s in self.train])

    def text_files(self, split: str, src: str, tgt: str) -> tuple[Location, Location]:
        """The held-out text of ``split`` in both languages, checked (sha256) for the caller."""
        for lang in (src, tgt):
            self.verify_once(*self.text[split, lang])
        return self.text[split, src][0], self.text[split, tgt][0]

    def lengths(self, lang: str) -> np.ndarray:
        """Each training sentence's length in tokens, in ``lang`` (int32, one per pair)."""
        offsets = [
            np.frombuffer(self.verify_part(s, f"{lang}.offsets", keep=True), np.int64) for s in self.train
        ]
        return np.concatenate([np.diff(o).astype(np.int32) for o in offsets])

    def sentence(self, lang: str, i: int) -> list[int]:
        """Training sentence ``i`` (over all shards) in ``lang``."""
        k, j = locate(self.ends, i)
        shard = self.train[k]
        self.verify_part(shard, f"{lang}.tokens")
        a, b = self.offsets(shard.path(lang, "offsets"), j, 2).tolist()
        return self.ids(shard.path(lang, "tokens"), a, b - a).tolist()


class ShardSide(Sequence):
    """One language's training sentences, the ``keep``-th pairs of the shards, read when indexed:
    what ``Collate`` takes as a split's ``src`` or ``tgt``."""

    def __init__(self, shards: PairShards, lang: str, keep: np.ndarray) -> None:
        self.shards, self.lang, self.keep = shards, lang, keep
        for shard in shards.train:  # here, before the loader's workers start: each checks none again
            for part in ("tokens", "offsets"):
                shards.verify_part(shard, f"{lang}.{part}")

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int) -> list[int]:
        return self.shards.sentence(self.lang, int(self.keep[i]))

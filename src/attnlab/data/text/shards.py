"""Token shards (``attnlab-prepare --mode lm``, kind ``tokens``): nanoGPT's ``train.bin`` cut into
flat arrays of ids (uint16 while the vocabulary fits), read a window at a time with plain reads
(a memory map's pages would count towards the process's memory). Also what the three text kinds
share: reading the sources, sampling text to fit a tokenizer, ``Encoder``, ``TextShards``.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.remote import RemotePath, read_array, read_arrays
from attnlab.data.sampling import stream_batch_numbers
from attnlab.data.shards.folder import MANIFEST, SPLITS, Location, ShardFolder, check_file
from attnlab.data.shards.writer import (
    ShardWriter,
    check_count,
    counted,
    parallel,
    prepares,
    progress_bar,
)
from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer, tokenizer_from_json

__all__ = ["MANIFEST", "SPLITS"]
Tokenizer = CharTokenizer | BPETokenizer
T = TypeVar("T")


# ---- reading the sources ------------------------------------------------------------------------


def source_files(patterns: Sequence[str]) -> list[Path]:
    """The files named by ``patterns`` (paths or globs), in order, each once."""
    files: list[Path] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not found:
            raise DataError(f"{pattern}: no file matches")
        for name in found:
            path = Path(name)
            if not path.is_file():
                raise DataError(f"{path}: not a file")
            if path not in files:
                files.append(path)
    return files


def text_chunks(files: Sequence[Path], chunk_bytes: int) -> Iterator[tuple[str, int]]:
    """The text of ``files`` in pieces of about ``chunk_bytes``, each cut after a newline where
    there is one (a character split between reads is joined by the incremental decoder), with
    the bytes read for each piece."""
    for path in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        with open(path, "rb") as f:
            offset, rest = 0, ""
            while block := f.read(chunk_bytes):
                text = rest + _decode(decoder, block, path, offset)
                cut = text.rfind("\n") + 1 or len(text)
                rest = text[cut:]
                offset += len(block)
                yield text[:cut], len(block)
            rest += _decode(decoder, b"", path, offset, final=True)
            if rest:
                yield rest, 0


def _decode(
    decoder: codecs.IncrementalDecoder, data: bytes, path: Path, offset: int, final: bool = False
) -> str:
    try:
        return decoder.decode(data, final=final)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text near byte {offset + e.start} ({e.reason})") from None


# ---- tokenising ---------------------------------------------------------------------------------


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
    """A character vocabulary from every file (one pass), or byte-level BPE trained on the first
    ``sample_bytes`` of text."""
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
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = tokenizer_from_json(self.tokenizer_json)
        return self._tokenizer


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
    val_size, test_size = (getattr(source, f"{s}_size", None) for s in ("val", "test"))
    val_size, test_size = 0.05 if val_size is None else val_size, 0.05 if test_size is None else test_size
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
            self.dtype = self.token_dtype()
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
        if current is not None and current.to_json() != self.tokenizer_json:
            raise DataError(
                f"{self.folder}: its shards were made with another tokenizer than the checkpoint's "
                "(the manifest's tokenizer differs); prepare them with the run's tokenizer"
            )
        if current is not None:  # a checkpoint's run: its tokenizer is the shards', whatever the keys
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

    def _verify(self, path: Location, sha256: str, ids: bool = False, keep: bool = False) -> bytes:
        return self.verify_once(path, sha256, self.dtype if ids else None, self.vocab_size, keep)

    def check_tokens(self, path: Location, tokens: int) -> None:
        check_file(path, tokens * self.dtype.itemsize, f"{tokens} tokens of {self.dtype}")

    def check_offsets(self, path: Location, n: int, what: str) -> None:
        check_file(path, (n + 1) * 8, f"{n} {what} offsets")

    def ids(self, path: Location, start: int, n: int) -> np.ndarray:
        return read_array(path, self.dtype, n, start * self.dtype.itemsize)

    def offsets(self, path: Location, start: int, n: int) -> np.ndarray:
        return read_array(path, np.dtype(np.int64), n, start * 8)


# ---- token shards: writing ----------------------------------------------------------------------


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
    encoder = ChunkEncoder(tok.to_json(), dtype)
    with progress_bar(progress, sum(f.stat().st_size for f in files)) as advance, parallel(workers) as imap:
        for ids in imap(encoder, counted(text_chunks(files, chunk_bytes), advance)):
            for split in ("val", "test"):
                take = min(held_out[split], len(ids))
                writers[split].write(ids[:take])
                held_out[split] -= take
                ids = ids[take:]
            writers["train"].write(ids)
    for w in writers.values():
        w.close()
    check_trains(inputs, {s: sum(x["tokens"] for x in writers[s].shards) for s in SPLITS})
    return text_manifest("tokens", tok, dtype, {s: writers[s].shards for s in SPLITS}, files)


def check_trains(inputs: Sequence[str], tokens: dict[str, int]) -> None:
    """Refuse shards with nothing to train on: an empty corpus, or one the held-out splits took."""
    if tokens["train"]:
        return
    if not sum(tokens.values()):
        raise DataError(f"{', '.join(inputs)}: no text (0 tokens); nothing to prepare")
    raise DataError(
        f"{', '.join(inputs)}: {sum(tokens.values())} tokens, none left for training after "
        f"{tokens['val']} validation and {tokens['test']} test tokens; lower --val-tokens / --test-tokens"
    )


# ---- token shards: reading ----------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    path: Location
    tokens: int
    sha256: str


class TokenShards(TextShards):
    """A folder of token shards: each split's shards, each file inside the folder and of the size
    its manifest says; checked (sha256, ids) the first time this process reads it (``verify``)."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        super().__init__(folder, "tokens")
        with self.reading():
            self.splits = {
                s: [Shard(p[""], int(e["tokens"]), h[""]) for e, p, h in self.shards(s)] for s in SPLITS
            }
        for shard in (shard for split in SPLITS for shard in self.splits[split]):
            self.check_tokens(shard.path, shard.tokens)

    def verify(self, shard: Shard, keep: bool = False) -> bytes:
        """Check ``shard`` (sha256, ids) unless this process did; with ``keep``, its bytes (read
        in the same pass: the whole of a small split costs one read)."""
        return self._verify(shard.path, shard.sha256, ids=True, keep=keep)

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits[split])

    def read(self, shard: Shard, start: int, n: int) -> np.ndarray:
        self.verify(shard)  # a set lookup once checked
        return self.ids(shard.path, start, n)

    def read_windows(self, windows: list[tuple[Shard, int]], n: int) -> list[np.ndarray]:
        """``n`` tokens from each ``(shard, start)``: from object storage, one round trip for all."""
        for shard, _ in windows:
            self.verify(shard)
        size = self.dtype.itemsize
        return read_arrays([(shard.path, start * size, n) for shard, start in windows], self.dtype)

    def read_split(self, split: str) -> Tensor:
        """A whole (small) split in memory: validation and test."""
        parts = [np.frombuffer(self.verify(s, keep=True), dtype=self.dtype) for s in self.splits[split]]
        return (
            torch.from_numpy(np.concatenate(parts).astype(np.int64))
            if parts
            else torch.zeros(0, dtype=torch.long)
        )


class ShardWindows(IterableDataset):
    """Endless batches of random windows from the training shards, as ``RandomWindows`` draws
    them from a tensor: batch ``n`` from a generator seeded by ``(seed, n)``, so a resumed run
    sees the batches the uninterrupted one would have, and ranks and workers interleave the
    stream. A window lies inside one shard, each shard chosen in proportion to its windows."""

    def __init__(self, shards: TokenShards, max_len: int, batch_size: int, seed: int) -> None:
        self.shards, self.max_len, self.batch_size, self.seed = shards, max_len, batch_size, seed
        self.usable = [s for s in shards.splits["train"] if s.tokens > max_len + 1]
        if not self.usable:
            raise DataError(
                f"{shards.folder}: no training shard holds more than data.max_len + 1 = {max_len + 1} tokens"
            )
        for shard in self.usable:  # here, before the loader's workers start: each checks none again
            shards.verify(shard)
        self.weights = torch.tensor([float(s.tokens - max_len - 1) for s in self.usable])
        self.start = 0

    def batch(self, index: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        which = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=g)
        fractions = torch.rand(self.batch_size, generator=g, dtype=torch.float64)
        picks = [self.usable[i] for i in which.tolist()]
        starts = [
            int(u * (s.tokens - self.max_len - 1)) for s, u in zip(picks, fractions.tolist(), strict=True)
        ]
        rows = self.shards.read_windows(list(zip(picks, starts, strict=True)), self.max_len + 1)
        chunk = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        return chunk[:, :-1], chunk[:, 1:]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for index in stream_batch_numbers(self.start):
            yield self.batch(index)

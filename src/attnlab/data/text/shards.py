"""Token shards on disk: a corpus of any size tokenised once (``attnlab-prepare``) and read a
window at a time, so training holds neither the text nor its tokens in memory.

nanoGPT's ``train.bin`` is the model: flat arrays of token ids (uint16 while the vocabulary fits,
else uint32), here cut into shards of a bounded size and described by a manifest (the tokenizer
and its hash, each shard's token count and sha256, the source files). Windows are read with
``np.fromfile`` at an offset rather than through a memory map: a map's pages count towards the
training process's resident memory as random windows touch them, plain reads leave them in the
page cache.
"""

from __future__ import annotations

import codecs
import errno
import functools
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.remote import RemotePath, file_size, location, read_array, read_arrays
from attnlab.data.sampling import stream_batch_numbers
from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer, tokenizer_from_json

MANIFEST = "manifest.json"
SPLITS = ("train", "val", "test")
Tokenizer = CharTokenizer | BPETokenizer


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


def fit_tokenizer(files: Sequence[Path], kind: str, vocab_size: int, sample_bytes: int) -> Tokenizer:
    """A character vocabulary from every file (one pass), or byte-level BPE trained on the first
    ``sample_bytes`` of text (BPE's merges settle long before a large corpus ends)."""
    if kind == "char":
        chars: set[str] = set()
        for text, _ in text_chunks(files, 1 << 24):
            chars.update(text)
        return CharTokenizer("".join(sorted(chars)))
    if kind == "bpe":
        check_vocab_size(vocab_size)
        sample, size = [], 0
        for text, n in text_chunks(files, 1 << 22):
            sample.append(text)
            size += n
            if size >= sample_bytes:
                break
        return BPETokenizer.fit("".join(sample), vocab_size)
    raise ConfigError(f"tokenizer must be 'char' or 'bpe', got {kind!r}")


class ChunkEncoder:
    """Text -> token ids as a numpy array; picklable, so worker processes each hold one."""

    def __init__(self, tokenizer_json: str, dtype: str) -> None:
        self.tokenizer_json, self.dtype = tokenizer_json, dtype
        self.tokenizer: Tokenizer | None = None
        self.table: np.ndarray | None = None

    def __call__(self, text: str) -> np.ndarray:
        if self.tokenizer is None:
            self.tokenizer = tokenizer_from_json(self.tokenizer_json)
            if isinstance(self.tokenizer, CharTokenizer):  # code point -> id, one lookup per char
                points = np.array([ord(c) for c in self.tokenizer.chars], dtype=np.int64)
                self.table = np.full(points.max() + 1, -1, dtype=np.int64)
                self.table[points] = np.arange(len(points))
        if self.table is None:
            return np.asarray(self.tokenizer.encode(text), dtype=self.dtype)
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self.table[np.minimum(points, len(self.table) - 1)]
        if (ids < 0).any() or (points >= len(self.table)).any():
            self.tokenizer.encode(text)  # raises, naming the characters
        return ids.astype(self.dtype)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# Four times the largest vocabularies in use; the trainers allocate for the size asked before they
# read any text (a billion: a 70 GB allocation, and the process aborts).
MAX_VOCAB_SIZE = 1 << 20


def check_vocab_size(vocab_size: int, name: str = "vocab_size") -> None:
    """A vocabulary size a tokenizer can be trained to (``name``: what the user called it)."""
    if (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, int)
        or not 1 <= vocab_size <= MAX_VOCAB_SIZE
    ):
        raise ConfigError(f"{name} must be an integer from 1 to {MAX_VOCAB_SIZE}, got {vocab_size!r}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


# ---- writing ------------------------------------------------------------------------------------


class SplitWriter:
    """Token ids of one split into files of at most ``shard_tokens`` tokens each."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.file = None

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self.file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            part.tofile(self.file)
            self.shards[-1]["tokens"] += len(part)

    def _next(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self.file = open(self.folder / name, "wb")  # noqa: SIM115 (closed in close())
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            shard = self.shards[-1]
            path = self.folder / shard["file"]
            check_written(path, shard["tokens"] * np.dtype(self.dtype).itemsize)
            shard["sha256"] = file_sha256(path)


def check_written(path: Path, size: int) -> None:
    """``path`` holds the ``size`` bytes written to it: numpy's ``tofile`` can lose a short write
    to a full disk without an error."""
    if (found := path.stat().st_size) != size:
        raise OSError(errno.ENOSPC, f"{found} of {size} bytes written", str(path))


def prepares(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``fn(inputs, out_dir, ...)`` run while it holds ``out_dir`` (see ``writing``)."""

    @functools.wraps(fn)
    def run(inputs: Sequence[str], out_dir: str | os.PathLike, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with writing(Path(out_dir)):
            return fn(inputs, out_dir, *args, **kwargs)

    return run


@contextmanager
def writing(out: Path) -> Iterator[None]:
    """Held while a prepare writes ``out``: another prepare into the same folder is refused in one
    line, and whatever ends this one early (an error, a full disk, Ctrl-C) removes its
    ``<out>.partial``; a failure to write is one ``DataError`` naming the file."""
    with _lock(out):
        try:
            yield
        except BaseException as e:
            shutil.rmtree(_beside(out, ".partial"), ignore_errors=True)
            if isinstance(e, OSError):
                raise DataError(_write_error(e, out)) from None
            raise


def _write_error(e: OSError, out: Path) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT) or e.errno is None:  # numpy's short write has none
        what = f" {e.filename}" if e.filename else ""
        return (
            f"{out}: could not write{what} ({e.strerror or e}); is the disk full? Nothing was kept: "
            "free some space or choose another --out"
        )
    return f"{e.filename or out}: {e.strerror or e}"


@contextmanager
def _lock(out: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<out>.lock`` (the kernel releases it when its holder dies, so a
    killed prepare blocks no one), removed by its holder at the end."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one prepare at a time is up to the user
        yield
        return
    path = _beside(out, ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DataError(
                    f"{out}: another attnlab-prepare is writing it; wait for its end or choose another --out"
                ) from None
            if _same_file(fd, path):  # not the file of a holder that removed it as we opened it
                break
            os.close(fd)
    except OSError as e:
        why = (
            f"{e.filename} is not a folder"
            if isinstance(e, FileExistsError | NotADirectoryError)
            else e.strerror
        )
        raise DataError(f"{out}: cannot write there ({why}); choose another --out") from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: a waiting opener retries (_same_file)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _beside(out: Path, suffix: str) -> Path:
    """``<out><suffix>`` in ``out``'s parent (``out`` made absolute where it has no name: ``.``)."""
    if out.name in ("", ".", ".."):
        out = out.resolve()
    return out.with_name(out.name + suffix)


@prepares
def prepare(
    inputs: Sequence[str],
    out_dir: str | os.PathLike,
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
    """Tokenise the files ``inputs`` name into token shards in ``out_dir``; return the manifest.

    The first ``val_tokens`` tokens validate and the next ``test_tokens`` are the test split
    (held out from the start: a stream's length is not known before its end); the rest trains.
    Everything is written to ``<out_dir>.partial`` and moved into place with its manifest at the
    end, so an interrupted prepare leaves no half-written shards behind: the next one starts clean.
    A prepare that fails removes it; another prepare into ``out_dir`` meanwhile is refused.
    """
    out = Path(out_dir)
    check_free(out)
    for name, value in (("val_tokens", val_tokens), ("test_tokens", test_tokens)):
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be a positive integer, got {shard_tokens!r}")
    files = source_files(inputs)
    partial = start_partial(out)

    tok = fit_tokenizer(files, tokenizer, vocab_size, bpe_sample_bytes)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: SplitWriter(partial, s, dtype, shard_tokens) for s in SPLITS}
    held_out = {"val": val_tokens, "test": test_tokens}
    encoder = ChunkEncoder(tok.to_json(), dtype)
    total_bytes = sum(f.stat().st_size for f in files)
    with _progress(progress, total_bytes) as advance, _pool(workers) as pool:
        chunks = text_chunks(files, chunk_bytes)
        texts = (text for text, n in _counted(chunks, advance))
        for ids in pool.imap(encoder, texts) if pool else map(encoder, texts):
            for split in ("val", "test"):
                take = min(held_out[split], len(ids))
                writers[split].write(ids[:take])
                held_out[split] -= take
                ids = ids[take:]
            writers["train"].write(ids)
    for w in writers.values():
        w.close()
    check_trains(inputs, {s: sum(x["tokens"] for x in writers[s].shards) for s in SPLITS})
    manifest = {
        "version": 1,
        "kind": "tokens",
        "tokenizer": tok.to_json(),
        "tokenizer_sha256": tokenizer_sha256(tok.to_json()),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "splits": {s: writers[s].shards for s in SPLITS},
        "sources": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
    }
    publish(partial, out, manifest)
    return manifest


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


def check_free(out: Path) -> None:
    """``out`` may become a prepared folder: absent, or an empty folder."""
    if (out / MANIFEST).exists():
        raise DataError(f"{out}: already holds prepared shards; choose another folder or remove it")
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out}: exists and is not empty; choose another folder")


def start_partial(out: Path) -> Path:
    """A clean ``<out>.partial`` folder (what an interrupted prepare or export left there removed;
    a link is unlinked, never followed), which ``publish`` moves into place once everything is
    written."""
    partial = _beside(out, ".partial")
    if partial.is_symlink() or partial.is_file():
        partial.unlink()
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish(partial: Path, out: Path, manifest: dict[str, Any]) -> None:
    """The manifest written last, then the folder renamed: a folder with a manifest is whole."""
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        out.rmdir()  # empty, checked by check_free
    os.replace(partial, out)


def tokenizer_sha256(tokenizer_json: str) -> str:
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()


def read_manifest(folder: Path | RemotePath, kind: str) -> dict[str, Any]:
    """The manifest of a prepared folder of ``kind`` ("tokens", "documents", "pairs")."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_text(folder, "attnlab-prepare"))
        found = manifest.get("kind", "tokens")  # version 1 token shards did not say
    except (ValueError, AttributeError) as e:
        raise DataError(f"{path}: not a readable manifest ({type(e).__name__}: {e})") from None
    if found != kind:
        raise DataError(
            f"{folder}: holds {str(found).rstrip('s')} shards (attnlab-prepare --mode "
            f"{MODES.get(found, found)}), not {kind.rstrip('s')} shards (--mode {MODES.get(kind, kind)})"
        )
    return manifest


def manifest_text(folder: Path | RemotePath, prepared_by: str) -> str:
    """The text of ``folder``'s manifest (a remote folder's: its listing read too, so that each
    shard's size comes from it); ``DataError`` if there is none."""
    path = folder / MANIFEST
    if file_size(path) is None:
        copy = f", and copy the folder to {folder}" if isinstance(folder, RemotePath) else ""
        raise DataError(f"{folder}: no {MANIFEST}; prepare it with {prepared_by}{copy}")
    if isinstance(folder, RemotePath):
        folder.list_folder()
    return path.read_text()


def check_file(path: Path | RemotePath, size: int, what: str, sha256: str | None = None) -> None:
    """A file a manifest lists: there, of the size it says (``what`` says in what units), and of
    its sha256 when given."""
    found = file_size(path)
    if found is None:
        raise DataError(f"{path}: a shard the manifest lists is missing")
    if found != size:
        raise DataError(
            f"{path}: {found} bytes, but the manifest says {what} ({size} bytes); truncated or replaced?"
        )
    if sha256 is not None:
        verify_file(path, sha256)


SHA256_DIFFERS = "its sha256 differs from the manifest's; corrupt or changed since it was prepared"


def manifest_file(folder: Path | RemotePath, name: Any, entry: str) -> Path | RemotePath:
    """``folder / name`` for a file the manifest of ``folder`` lists (``entry``: where in it),
    refused unless it stays inside ``folder``: an absolute path, a ``..`` or a link out of the
    folder would have training read any file of the machine (at a URL: only a plain relative name
    under the folder's URL, no scheme, no ``..``, no absolute path)."""
    if isinstance(folder, RemotePath):
        if folder.inside(name):
            return folder / name
        raise DataError(
            f"{folder / MANIFEST}: {entry} names {str(name)!r}, which leads outside {folder}; "
            "a manifest may name only files under its own URL (a relative name: no scheme, "
            "absolute path or '..')"
        )
    path = folder / str(name)
    try:
        inside = isinstance(name, str) and path.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte
        inside = False
    if not inside:
        raise DataError(
            f"{folder / MANIFEST}: {entry} names {str(name)!r}, which leads outside {folder}; "
            "a manifest may name only files in its own folder (no absolute path, '..' or link out)"
        )
    return path


def manifest_vocab(folder: Path | RemotePath, tokenizer_json: Any) -> int:
    """The vocabulary size of the tokenizer a manifest holds: every token id must be below it."""
    try:
        return tokenizer_from_json(tokenizer_json).vocab_size
    except Exception as e:  # noqa: BLE001 (json, KeyError, the tokenizers library's own errors)
        raise DataError(
            f"{folder / MANIFEST}: not a readable manifest (its tokenizer: {type(e).__name__}: {e})"
        ) from None


def verify_file(
    path: Path | RemotePath,
    sha256: str,
    dtype: np.dtype | None = None,
    vocab: int = 0,
    keep: bool = False,
) -> bytes:
    """One pass over a file a manifest lists (a remote one streamed once): its sha256 must be the
    manifest's and, when it holds token ids (``dtype``), each id must be below ``vocab`` (an id
    past the embedding table would end training in an ``IndexError``). Returns the bytes with
    ``keep`` (a small file read whole)."""
    top, h, kept = -1, hashlib.sha256(), []
    with path.open("rb") as f:
        while block := f.read(-1 if keep else 1 << 24):
            h.update(block)
            if dtype is not None:
                ids = np.frombuffer(block, dtype=dtype, count=len(block) // dtype.itemsize)
                top = max(top, int(ids.max())) if len(ids) else top
            if keep:
                kept.append(block)
    if h.hexdigest() != sha256:
        raise DataError(f"{path}: {SHA256_DIFFERS}")
    if dtype is not None and top >= vocab:
        raise DataError(
            f"{path}: token id {top} is outside the vocabulary of {vocab} (ids 0..{vocab - 1}) of "
            "the manifest's tokenizer; corrupt, or prepared with another tokenizer"
        )
    return b"".join(kept)


MODES = {"tokens": "lm", "documents": "bert", "pairs": "translation"}  # manifest kind -> prepare mode


def _counted(chunks: Iterator[tuple[str, int]], advance) -> Iterator[tuple[str, int]]:
    for text, n in chunks:
        advance(n)
        yield text, n


class _pool:
    """A pool of ``workers`` processes, or none for 1. Forked where the platform can (nothing
    here has started torch's threads; a spawned worker would spend seconds importing torch),
    with the tokenizers library's own threads off in them, as it asks after a fork."""

    def __init__(self, workers: int) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers must be a positive integer, got {workers!r}")
        self.workers, self.pool = workers, None

    def __enter__(self):
        if self.workers > 1:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            method = "fork" if "fork" in get_all_start_methods() else "spawn"
            self.pool = get_context(method).Pool(self.workers)
        return self.pool

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()


class _progress:
    """A rich progress bar over the source bytes, on stderr; ``enabled=False``: nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self.bar = enabled, total, None

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.bar = Progress(
            "tokenising",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.bar.start()
        task = self.bar.add_task("tokenising", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


# ---- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    path: Path | RemotePath
    tokens: int
    sha256: str


class TokenShards:
    """A prepared folder (a local path, or an ``s3://``, ``gs://`` or ``https://`` URL: see
    ``attnlab.data.remote``): its tokenizer and each split's shards, checked against the manifest:
    at opening each file it names is inside the folder and of the size it says; the first time
    this process reads a shard (``verify``, at most once each), its sha256 and that every id is in
    the vocabulary."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        self.folder = location(folder)
        path = self.folder / MANIFEST
        manifest = read_manifest(self.folder, "tokens")
        try:
            self.dtype = np.dtype(manifest["dtype"])
            if self.dtype not in (np.uint16, np.uint32):
                raise ValueError(f"dtype {manifest['dtype']!r}, not uint16 or uint32")
            self.tokenizer_json: str = manifest["tokenizer"]
            self.tokenizer_sha256: str = manifest["tokenizer_sha256"]
            entries = manifest["splits"]
            self.splits = {
                s: [
                    Shard(
                        manifest_file(self.folder, e["file"], f"splits.{s}[{i}].file"),
                        int(e["tokens"]),
                        e["sha256"],
                    )
                    for i, e in enumerate(entries[s])
                ]
                for s in SPLITS
            }
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: not a readable manifest ({type(e).__name__}: {e})") from None
        self.vocab_size = manifest_vocab(self.folder, self.tokenizer_json)
        self.verified: set[Path | RemotePath] = set()  # shards whose sha256 and ids this process checked
        for split in SPLITS:
            for shard in self.splits[split]:
                what = f"{shard.tokens} tokens of {self.dtype}"
                check_file(shard.path, shard.tokens * self.dtype.itemsize, what)

    def verify(self, shard: Shard, keep: bool = False) -> bytes:
        """Check ``shard`` (sha256, ids) unless this process did; with ``keep``, its bytes (read
        in the same pass: the whole of a small split costs one read)."""
        if shard.path in self.verified:
            return shard.path.read_bytes() if keep else b""
        data = verify_file(shard.path, shard.sha256, self.dtype, self.vocab_size, keep)
        self.verified.add(shard.path)
        return data

    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_json(self.tokenizer_json)

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits[split])

    def read(self, shard: Shard, start: int, n: int) -> np.ndarray:
        self.verify(shard)  # a set lookup once checked
        return read_array(shard.path, self.dtype, n, start * self.dtype.itemsize)

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

    def __init__(self, shards: TokenShards, block_size: int, batch_size: int, seed: int) -> None:
        self.shards, self.block_size, self.batch_size, self.seed = shards, block_size, batch_size, seed
        self.usable = [s for s in shards.splits["train"] if s.tokens > block_size + 1]
        if not self.usable:
            raise DataError(
                f"{shards.folder}: no training shard holds more than data.block_size + 1 = "
                f"{block_size + 1} tokens"
            )
        for shard in self.usable:  # here, before the loader's workers start: each checks none again
            shards.verify(shard)
        self.weights = torch.tensor([float(s.tokens - block_size - 1) for s in self.usable])
        self.start = 0

    def batch(self, index: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        which = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=g)
        fractions = torch.rand(self.batch_size, generator=g, dtype=torch.float64)
        picks = [self.usable[i] for i in which.tolist()]
        starts = [
            int(u * (s.tokens - self.block_size - 1)) for s, u in zip(picks, fractions.tolist(), strict=True)
        ]
        rows = self.shards.read_windows(list(zip(picks, starts, strict=True)), self.block_size + 1)
        chunk = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        return chunk[:, :-1], chunk[:, 1:]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for index in stream_batch_numbers(self.start):
            yield self.batch(index)

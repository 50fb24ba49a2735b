"""Parallel corpora of any size (``attnlab-prepare --mode translation``, ``data=translation_shards``):
pairs tokenised once with a joint BPE into flat arrays on disk, read a sentence at a time.

A source is a TSV file (``source<TAB>target`` per line, further columns ignored), a JSONL file (one
object per line, keyed by the two languages: ``{"de": "...", "en": "..."}``) or a prefix naming two
line-aligned files ``<prefix>.<src>`` and ``<prefix>.<tgt>`` (fairseq's and Moses' convention).
The first ``val_pairs`` pairs validate and the next ``test_pairs`` are the test split: they are
kept as text (``val.<lang>``, ``test.<lang>``, read whole at setup: they are small, and BLEU needs
the references as written). The rest train: each shard holds, per language, ``<name>.<lang>.tokens``
(the token ids of its sentences end to end) and ``<name>.<lang>.offsets`` (int64: sentence ``k`` is
``tokens[o[k]:o[k + 1]]``). Training holds only a length per pair (for the token-budget batches),
no sentence as a Python object.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice, zip_longest
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.remote import RemotePath, location, read_array
from attnlab.data.text.shards import (
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
    start_partial,
    token_dtype,
    tokenizer_sha256,
    verify_file,
)
from attnlab.data.text.tokenizers import SubwordTokenizer, tokenizer_from_json

Pair = tuple[str, str]
HELD_OUT = ("val", "test")


# ---- reading the sources ------------------------------------------------------------------------


def lines(path: Path) -> Iterator[tuple[int, int, str]]:
    """Each line of a UTF-8 file (without its line end), with its number and size in bytes; a
    byte sequence that is not UTF-8 is named by the file and its byte offset."""
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
    """Line ``i`` of one file with line ``i`` of the other; files of different line counts are
    refused, naming both and their counts (counted to the end of the longer)."""
    n_a = n_b = 0
    for a, b in zip_longest(lines(src_path), lines(tgt_path)):  # zip would drop a line of the longer
        n_a, n_b = n_a + (a is not None), n_b + (b is not None)
        if a is not None and b is not None:
            yield (a[2], b[2]), a[1] + b[1]
    if n_a != n_b:
        raise DataError(
            f"parallel files differ in length: {src_path} has {n_a} lines, {tgt_path} has "
            f"{n_b}; line i of one must translate line i of the other"
        )


def pair_sources(inputs: Sequence[str], src: str, tgt: str) -> list[tuple[str, list[Path]]]:
    """Each input as (format, files): a ``.tsv`` or ``.jsonl`` file (or glob), else a prefix of
    two aligned files."""
    out: list[tuple[str, list[Path]]] = []
    for name in inputs:
        if name.endswith((".tsv", ".jsonl")):
            found = sorted(glob.glob(name, recursive=True)) if glob.has_magic(name) else [name]
            if not found:
                raise DataError(f"{name}: no file matches")
            for f in map(Path, found):
                if not f.is_file():
                    raise DataError(f"{f}: not a file")
                out.append(("tsv" if f.suffix == ".tsv" else "jsonl", [f]))
        else:
            files = [Path(f"{name}.{src}"), Path(f"{name}.{tgt}")]
            for f in files:
                if not f.is_file():
                    raise DataError(
                        f"{f}: no such file ({name!r} is neither a .tsv nor a .jsonl file, so it is read "
                        f"as the prefix of {files[0].name} and {files[1].name})"
                    )
            out.append(("aligned", files))
    return out


def read_pairs(sources: list[tuple[str, list[Path]]], src: str, tgt: str) -> Iterator[tuple[Pair, int]]:
    """Every pair of the sources in order, with the bytes it was read from."""
    for kind, files in sources:
        if kind == "tsv":
            yield from tsv_pairs(files[0])
        elif kind == "jsonl":
            yield from jsonl_pairs(files[0], src, tgt)
        else:
            yield from aligned_pairs(*files)


# ---- tokenising and writing ---------------------------------------------------------------------


class PairEncoder:
    """A block of pairs -> per side, the ids end to end and each sentence's length; picklable."""

    def __init__(self, tokenizer_json: str, dtype: str) -> None:
        self.tokenizer_json, self.dtype = tokenizer_json, dtype
        self.tokenizer: SubwordTokenizer | None = None

    def __call__(self, pairs: list[Pair]) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.tokenizer is None:
            self.tokenizer = tokenizer_from_json(self.tokenizer_json)
        out = []
        for side in zip(*pairs, strict=True):
            ids = self.tokenizer.encode_batch(list(side))
            flat = np.fromiter((t for s in ids for t in s), dtype=self.dtype)
            out.append((flat, np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))))
        return out


class PairWriter:
    """Tokenised blocks of training pairs into shards of about ``shard_tokens`` tokens."""

    def __init__(self, folder: Path, langs: tuple[str, str], dtype: str, shard_tokens: int) -> None:
        self.folder, self.langs, self.dtype, self.shard_tokens = folder, langs, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.files: dict[str, Any] = {}

    def write(self, sides: list[tuple[np.ndarray, np.ndarray]]) -> None:
        if not self.files or sum(self.shards[-1]["tokens"].values()) >= self.shard_tokens:
            self._next()
        shard = self.shards[-1]
        for lang, (ids, lengths) in zip(self.langs, sides, strict=True):
            ids.tofile(self.files[f"{lang}.tokens"])
            (shard["tokens"][lang] + np.cumsum(lengths)).astype(np.int64).tofile(
                self.files[f"{lang}.offsets"]
            )
            shard["tokens"][lang] += len(ids)
        shard["pairs"] += len(sides[0][1])

    def _next(self) -> None:
        self.close()
        name = f"train_{len(self.shards):05d}"
        parts = [f"{lang}.{p}" for lang in self.langs for p in ("tokens", "offsets")]
        self.files = {p: open(self.folder / f"{name}.{p}", "wb") for p in parts}  # noqa: SIM115
        for lang in self.langs:
            np.zeros(1, dtype=np.int64).tofile(self.files[f"{lang}.offsets"])
        self.shards.append({"name": name, "pairs": 0, "tokens": dict.fromkeys(self.langs, 0)})

    def close(self) -> None:
        if self.files:
            for f in self.files.values():
                f.close()
            shard = self.shards[-1]
            shard["sha256"] = {p: file_sha256(self.folder / f"{shard['name']}.{p}") for p in self.files}
            self.files = {}


def fit_joint_bpe(pairs: Iterator[tuple[Pair, int]], vocab_size: int, sample_bytes: int) -> SubwordTokenizer:
    """The joint BPE of both languages, trained on the first ``sample_bytes`` of training pairs."""
    check_vocab_size(vocab_size)
    sentences, size = [], 0
    for (x, y), n in pairs:
        sentences += [x, y]
        size += n
        if size >= sample_bytes:
            break
    return SubwordTokenizer.fit(sentences, vocab_size)


@prepares
def prepare_pairs(
    inputs: Sequence[str],
    out_dir: str | os.PathLike,
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
    manifest. Written into ``<out_dir>.partial`` and moved into place at the end."""
    out = Path(out_dir)
    check_free(out)
    if not (src_lang and tgt_lang) or src_lang == tgt_lang:
        raise ConfigError(
            f"--src-lang and --tgt-lang must name two languages, got {src_lang!r}, {tgt_lang!r}"
        )
    for name, value in (("val_pairs", val_pairs), ("test_pairs", test_pairs)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer (a split to score), got {value!r}")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be a positive integer, got {shard_tokens!r}")
    langs = (src_lang, tgt_lang)
    sources = pair_sources(inputs, *langs)
    partial = start_partial(out)

    tok = fit_joint_bpe(
        islice(read_pairs(sources, *langs), val_pairs + test_pairs, None), vocab_size, sample_bytes
    )
    dtype = token_dtype(tok.vocab_size)
    writer = PairWriter(partial, langs, dtype, shard_tokens)
    held_out: dict[str, Any] = {}
    total = sum(f.stat().st_size for _, files in sources for f in files)
    with _progress(progress, total) as advance, _pool(workers) as pool:
        stream = read_pairs(sources, *langs)
        for split, n in (("val", val_pairs), ("test", test_pairs)):
            held_out[split] = write_text(partial, split, langs, stream, n, advance)
        blocks = _blocks(stream, block_pairs, advance)
        encoder = PairEncoder(tok.to_json(), dtype)
        for sides in pool.imap(encoder, blocks) if pool else map(encoder, blocks):
            writer.write(sides)
    writer.close()
    for split, n in (("val", val_pairs), ("test", test_pairs)):
        if held_out[split]["pairs"] < n:
            raise DataError(
                f"{', '.join(inputs)}: too few pairs for {val_pairs} validation and {test_pairs} test pairs"
            )
    if not writer.shards:
        raise DataError(
            f"{', '.join(inputs)}: no pairs left for training after {val_pairs} validation and "
            f"{test_pairs} test pairs"
        )
    manifest = {
        "version": 1,
        "kind": "pairs",
        "langs": list(langs),
        "tokenizer": tok.to_json(),
        "tokenizer_sha256": tokenizer_sha256(tok.to_json()),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "splits": {"train": writer.shards, **held_out},
        "sources": [{"path": str(f), "bytes": f.stat().st_size} for _, files in sources for f in files],
    }
    publish(partial, out, manifest)
    return manifest


def write_text(
    folder: Path, split: str, langs: tuple[str, str], stream: Iterator[tuple[Pair, int]], n: int, advance
) -> dict[str, Any]:
    """The next ``n`` pairs as two line-aligned text files ``<split>.<lang>`` (a line break inside
    a JSONL sentence becomes a space)."""
    files = {lang: folder / f"{split}.{lang}" for lang in langs}
    count = 0
    with (
        open(files[langs[0]], "w", encoding="utf-8") as fa,
        open(files[langs[1]], "w", encoding="utf-8") as fb,
    ):
        for (x, y), size in islice(stream, n):
            fa.write(" ".join(x.splitlines()) + "\n")
            fb.write(" ".join(y.splitlines()) + "\n")
            advance(size)
            count += 1
    return {
        "pairs": count,
        "bytes": {lang: p.stat().st_size for lang, p in files.items()},
        "sha256": {lang: file_sha256(p) for lang, p in files.items()},
    }


def _blocks(stream: Iterator[tuple[Pair, int]], size: int, advance) -> Iterator[list[Pair]]:
    while block := list(islice(stream, size)):
        advance(sum(n for _, n in block))
        yield [p for p, _ in block]


# ---- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairShard:
    folder: Path | RemotePath
    name: str
    pairs: int
    tokens: dict[str, int]
    sha256: dict[str, str]

    def path(self, lang: str, part: str) -> Path | RemotePath:
        return self.folder / f"{self.name}.{lang}.{part}"


class PairShards:
    """A folder from ``prepare_pairs`` (local, or at an ``s3://``, ``gs://`` or ``https://`` URL):
    its languages, tokenizer, training shards and held-out text, checked against the manifest: at
    opening, every file inside the folder and of its size; the first time this process reads a
    file (``verify``), its sha256 and the token ids against the vocabulary."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        self.folder = location(folder)
        manifest = read_manifest(self.folder, "pairs")
        try:
            self.langs: tuple[str, str] = tuple(manifest["langs"])
            self.dtype = np.dtype(manifest["dtype"])
            if self.dtype not in (np.uint16, np.uint32):
                raise ValueError(f"dtype {manifest['dtype']!r}, not uint16 or uint32")
            self.tokenizer_json: str = manifest["tokenizer"]
            entries = manifest["splits"]["train"]
            self.train = [self._shard(i, e) for i, e in enumerate(entries)]
            self.held_out = {s: manifest["splits"][s] for s in HELD_OUT}
            self.text_sha256 = {
                (s, lang): self.held_out[s]["sha256"][lang] for s in HELD_OUT for lang in self.langs
            }
            for s, lang in self.text_sha256:
                manifest_file(self.folder, f"{s}.{lang}", f"langs ({lang!r})")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(
                f"{self.folder / 'manifest.json'}: not a readable manifest ({type(e).__name__}: {e})"
            ) from None
        self.vocab_size = manifest_vocab(self.folder, self.tokenizer_json)
        self.verified: set[Path | RemotePath] = set()  # files whose sha256 (and ids) this process checked
        for shard in self.train:
            if shard.pairs == 0:
                raise DataError(f"{shard.path(self.langs[0], 'offsets')}: an empty shard (no pairs)")
            for lang in self.langs:
                n = int(shard.tokens[lang])
                check_file(shard.path(lang, "tokens"), n * self.dtype.itemsize, f"{n} tokens of {self.dtype}")
                check_file(
                    shard.path(lang, "offsets"), (shard.pairs + 1) * 8, f"{shard.pairs} sentence offsets"
                )
        for split, entry in self.held_out.items():
            for lang in self.langs:
                what = f"{entry['pairs']} lines of text"
                check_file(self.folder / f"{split}.{lang}", int(entry["bytes"][lang]), what)
        self.ends = np.cumsum([s.pairs for s in self.train])

    def _shard(self, i: int, e: dict[str, Any]) -> PairShard:
        parts = [f"{lang}.{p}" for lang in self.langs for p in ("tokens", "offsets")]
        for part in parts:  # each of its files inside the folder
            manifest_file(self.folder, f"{e['name']}.{part}", f"splits.train[{i}].name")
        sha256 = {part: e["sha256"][part] for part in parts}
        return PairShard(self.folder, e["name"], int(e["pairs"]), e["tokens"], sha256)

    def _verify(self, path: Path | RemotePath, sha256: str, ids: bool = False, keep: bool = False) -> bytes:
        """Check a file (sha256; with ``ids``, its token ids) unless this process did."""
        if path in self.verified:
            return path.read_bytes() if keep else b""
        data = verify_file(path, sha256, self.dtype if ids else None, self.vocab_size, keep)
        self.verified.add(path)
        return data

    def verify(self, lang: str) -> None:
        """Check the training shards of one language (before the loader's workers start, so that
        none of them checks again)."""
        for shard in self.train:
            self._verify(shard.path(lang, "tokens"), shard.sha256[f"{lang}.tokens"], ids=True)
            self._verify(shard.path(lang, "offsets"), shard.sha256[f"{lang}.offsets"])

    def tokenizer(self) -> SubwordTokenizer:
        return tokenizer_from_json(self.tokenizer_json)

    def text_files(self, split: str, src: str, tgt: str) -> tuple[Path | RemotePath, Path | RemotePath]:
        """The held-out text of ``split`` in both languages, checked (sha256) for the caller."""
        for lang in (src, tgt):
            self._verify(self.folder / f"{split}.{lang}", self.text_sha256[split, lang])
        return self.folder / f"{split}.{src}", self.folder / f"{split}.{tgt}"

    def lengths(self, lang: str) -> np.ndarray:
        """Each training sentence's length in tokens, in ``lang`` (int32, one per pair)."""
        offsets = [
            np.frombuffer(
                self._verify(s.path(lang, "offsets"), s.sha256[f"{lang}.offsets"], keep=True), np.int64
            )
            for s in self.train
        ]
        return np.concatenate([np.diff(o).astype(np.int32) for o in offsets])

    def sentence(self, lang: str, i: int) -> list[int]:
        """Training sentence ``i`` (over all shards) in ``lang``."""
        k = int(np.searchsorted(self.ends, i, side="right"))
        shard, j = self.train[k], i - (int(self.ends[k - 1]) if k else 0)
        self._verify(shard.path(lang, "tokens"), shard.sha256[f"{lang}.tokens"], ids=True)
        a, b = read_array(shard.path(lang, "offsets"), np.dtype(np.int64), 2, 8 * j).tolist()
        return read_array(shard.path(lang, "tokens"), self.dtype, b - a, a * self.dtype.itemsize).tolist()


class ShardSide(Sequence):
    """One language's training sentences, the ``keep``-th pairs of the shards, read when indexed:
    what ``Collate`` takes as a split's ``src`` or ``tgt``."""

    def __init__(self, shards: PairShards, lang: str, keep: np.ndarray) -> None:
        self.shards, self.lang, self.keep = shards, lang, keep
        shards.verify(lang)

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int) -> list[int]:
        return self.shards.sentence(self.lang, int(self.keep[i]))

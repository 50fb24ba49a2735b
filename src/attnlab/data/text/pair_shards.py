"""Parallel corpora (``attnlab-prepare --mode translation``, kind ``pairs``) tokenised once with a
joint BPE: from a TSV file (``source<TAB>target``), a JSONL file (``{"de": "...", "en": "..."}``)
or two line-aligned files ``<prefix>.<src>``, ``<prefix>.<tgt>``. The first ``val_pairs`` pairs
validate and the next ``test_pairs`` test, kept as text (BLEU needs the references as written);
the rest train: per shard and language ``<name>.<lang>.tokens`` and ``.offsets`` (int64).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice, zip_longest
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.remote import RemotePath
from attnlab.data.shards.folder import Location, check_file, file_sha256
from attnlab.data.shards.writer import (
    ShardWriter,
    check_count,
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
    text_manifest,
    token_dtype,
)
from attnlab.data.text.tokenizers import SubwordTokenizer

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
            out += [("tsv" if f.suffix == ".tsv" else "jsonl", [f]) for f in source_files([name])]
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


def fit_joint_bpe(pairs: Iterator[tuple[Pair, int]], vocab_size: int, sample_bytes: int) -> SubwordTokenizer:
    """The joint BPE of both languages, trained on the first ``sample_bytes`` of training pairs."""
    check_vocab_size(vocab_size)
    return SubwordTokenizer.fit([s for pair in head(pairs, sample_bytes) for s in pair], vocab_size)


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
    manifest. Written into ``<out_dir>.partial`` and moved into place at the end."""
    if not (src_lang and tgt_lang) or src_lang == tgt_lang:
        raise ConfigError(
            f"--src-lang and --tgt-lang must name two languages, got {src_lang!r}, {tgt_lang!r}"
        )
    check_count("val_pairs", val_pairs, why=" (a split to score)")
    check_count("test_pairs", test_pairs, why=" (a split to score)")
    check_count("shard_tokens", shard_tokens)
    langs = (src_lang, tgt_lang)
    sources = pair_sources(inputs, *langs)

    held = {"val": val_pairs, "test": test_pairs}
    tok = fit_joint_bpe(
        islice(read_pairs(sources, *langs), val_pairs + test_pairs, None), vocab_size, sample_bytes
    )
    dtype = token_dtype(tok.vocab_size)
    writer = PairWriter(partial, langs, shard_tokens)
    files = [f for _, fs in sources for f in fs]
    with progress_bar(progress, sum(f.stat().st_size for f in files)) as advance, parallel(workers) as imap:
        stream = read_pairs(sources, *langs)
        held_out = {split: write_text(partial, split, langs, stream, n, advance) for split, n in held.items()}
        for sides in imap(PairEncoder(tok.to_json(), dtype), _blocks(stream, block_pairs, advance)):
            writer.write(sides)
    writer.close()
    for split, n in held.items():
        if held_out[split]["pairs"] < n:
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


def _blocks(stream: Iterator[tuple[Pair, int]], size: int, advance: Callable) -> Iterator[list[Pair]]:
    while block := list(islice(stream, size)):
        advance(sum(n for _, n in block))
        yield [p for p, _ in block]


# ---- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairShard:
    name: str
    paths: dict[str, Location]
    pairs: int
    tokens: dict[str, int]
    sha256: dict[str, str]

    def path(self, lang: str, part: str) -> Location:
        return self.paths[f"{lang}.{part}"]


class PairShards(TextShards):
    """A folder of pair shards: its languages, tokenizer, training shards and held-out text, every
    file inside the folder and of its size; each checked (sha256, ids) the first time this
    process reads it."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        super().__init__(folder, "pairs")
        with self.reading():
            self.langs: tuple[str, str] = tuple(self.manifest["langs"])
            parts = tuple(f"{lang}.{p}" for lang in self.langs for p in ("tokens", "offsets"))
            self.train = [
                PairShard(e["name"], p, int(e["pairs"]), e["tokens"], h)
                for e, p, h in self.shards("train", parts)
            ]
            self.held_out = {s: self.manifest["splits"][s] for s in HELD_OUT}
            self.text = {
                (s, lang): (
                    self.file(f"{s}.{lang}", f"langs ({lang!r})"),
                    self.held_out[s]["sha256"][lang],
                )
                for s in HELD_OUT
                for lang in self.langs
            }
            for (s, lang), (path, _) in self.text.items():
                entry = self.held_out[s]
                check_file(path, int(entry["bytes"][lang]), f"{entry['pairs']} lines of text")
        for shard in self.train:
            if shard.pairs == 0:
                raise DataError(f"{shard.path(self.langs[0], 'offsets')}: an empty shard (no pairs)")
            for lang in self.langs:
                self.check_tokens(shard.path(lang, "tokens"), int(shard.tokens[lang]))
                self.check_offsets(shard.path(lang, "offsets"), shard.pairs, "sentence")
        self.ends = np.cumsum([s.pairs for s in self.train])

    def verify(self, lang: str) -> None:
        """Check the training shards of one language (before the loader's workers start, so that
        none of them checks again)."""
        for shard in self.train:
            self._verify(shard.path(lang, "tokens"), shard.sha256[f"{lang}.tokens"], ids=True)
            self._verify(shard.path(lang, "offsets"), shard.sha256[f"{lang}.offsets"])

    def text_files(self, split: str, src: str, tgt: str) -> tuple[Location, Location]:
        """The held-out text of ``split`` in both languages, checked (sha256) for the caller."""
        for lang in (src, tgt):
            self._verify(*self.text[split, lang])
        return self.text[split, src][0], self.text[split, tgt][0]

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
        k, j = locate(self.ends, i)
        shard = self.train[k]
        self._verify(shard.path(lang, "tokens"), shard.sha256[f"{lang}.tokens"], ids=True)
        a, b = self.offsets(shard.path(lang, "offsets"), j, 2).tolist()
        return self.ids(shard.path(lang, "tokens"), a, b - a).tolist()


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

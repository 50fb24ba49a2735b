"""Translation data: parallel corpora, a joint BPE vocabulary and token-budget batches."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import PositiveInt
from attnlab.data.base import TokenizerDataModule, log_splits
from attnlab.data.batching import RepeatedBatch, pad
from attnlab.data.download import fetch
from attnlab.data.sources import Builtin, Generated, Shards, Source
from attnlab.data.text.shards import PairShards, ShardSide, check_aligned
from attnlab.data.text.tokenizers import SubwordTokenizer, tokenizer_from_json

log = logging.getLogger(__name__)

MULTI30K_URL = (
    "https://raw.githubusercontent.com/multi30k/dataset/a3d2e0d26b56f3846f66a952536ffed4e401d05a/"
    "data/task1/raw/{name}.gz"
)
# sha256 of the gunzipped files
MULTI30K_SHA256 = {
    "train.en": "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6",
    "train.de": "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72",
    "val.en": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    "val.de": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    "test_2016_flickr.en": "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
    "test_2016_flickr.de": "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
}
SPLITS = {"multi30k": ("train", "val", "test_2016_flickr")}  # its files for train, val, test


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Line-aligned sentences of two files; their line counts must agree."""
    src = src_path.read_text(encoding="utf-8").splitlines()
    tgt = tgt_path.read_text(encoding="utf-8").splitlines()
    check_aligned(src_path, len(src), tgt_path, len(tgt))
    return src, tgt


# A made-up language pair for demos and fast tests: the target says the source's words in
# reverse order, each through a fixed dictionary, so a model must learn to align (attend), not
# copy position by position.
SYNTHETIC_WORDS = [
    tuple(pair.split(":"))
    for pair in "blau:blue rot:red grün:green hund:dog katze:cat mann:man frau:woman kind:child läuft:runs "
    "springt:jumps sitzt:sits schläft:sleeps groß:big klein:small haus:house baum:tree wasser:water "
    "ball:ball straße:street auto:car".split()
]


def synthetic_pairs(n: int, seed: int, min_words: int = 3, max_words: int = 8) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [rng.choice(SYNTHETIC_WORDS) for _ in range(rng.randint(min_words, max_words))]
        src.append(" ".join(w for w, _ in words) + ".")
        tgt.append(" ".join(t for _, t in reversed(words)).capitalize() + ".")
    return src, tgt


def cached_tokenizer(path: Path) -> SubwordTokenizer | None:
    """The BPE vocabulary cached in ``path``; None where the file is damaged or holds another kind
    of tokenizer (it is a cache: trained again, not fatal)."""
    try:
        tok = tokenizer_from_json(path.read_text(encoding="utf-8"))
    except Exception as e:  # OSError, bad JSON, a missing key, or the tokenizers library's own Exception
        log.warning("ignoring unreadable BPE cache %s (%s)", path, " ".join(str(e).split())[:200])
        return None
    if not isinstance(tok, SubwordTokenizer):
        log.warning("ignoring BPE cache %s: it holds a %s, not a BPE vocabulary", path, type(tok).__name__)
        return None
    log.info("BPE vocabulary read from %s", path)
    return tok


@dataclass
class ParallelSplit:
    """Token ids of a split (without <bos>/<eos>) and its raw target sentences (the references)."""

    src: Sequence[list[int]]  # a list, or sentences read from shards (ShardSide)
    tgt: Sequence[list[int]]
    src_text: list[str]
    tgt_text: list[str]

    def __len__(self) -> int:
        return len(self.src)


class Collate:
    """Pad a batch: ``src`` (B, S); ``tgt_in`` = <bos> y and ``tgt_out`` = y <eos> (B, T); ``idx``;
    ``repeat``: whether it is a ``RepeatedBatch`` (evaluation padding, not to be scored)."""

    def __init__(self, split: ParallelSplit, bos: int, eos: int, pad_id: int) -> None:
        self.split, self.bos, self.eos, self.pad_id = split, bos, eos, pad_id

    def __call__(self, idx: list[int]) -> dict[str, Any]:
        src = [self.split.src[i] + [self.eos] for i in idx]
        tgt = [self.split.tgt[i] for i in idx]
        return {
            "src": pad(src, self.pad_id),
            "tgt_in": pad([[self.bos] + t for t in tgt], self.pad_id),
            "tgt_out": pad([t + [self.eos] for t in tgt], self.pad_id),
            "idx": torch.tensor(idx),
            "repeat": isinstance(idx, RepeatedBatch),
        }


class TranslationDataModule(TokenizerDataModule):
    """A parallel corpus, ``src_lang`` -> ``tgt_lang``: ``Builtin("multi30k")`` or
    ``Generated("synthetic")`` (de-en, either way) with a joint BPE fitted on the training split
    (cached in ``cache_dir``); or pair ``Shards`` (``vocab_size`` null, or the shards' own). Training
    pairs over ``max_len`` tokens are dropped, evaluation ones cut."""

    def __init__(
        self,
        source: Source | None = None,
        src_lang: str = "de",
        tgt_lang: str = "en",
        vocab_size: PositiveInt | None = None,
        max_tokens: PositiveInt = 4096,
        eval_max_tokens: PositiveInt = 8192,
        max_len: PositiveInt = 128,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        source = source or Builtin("multi30k")
        if not isinstance(source, Shards):
            if (type(source), source.name) not in ((Builtin, "multi30k"), (Generated, "synthetic")):
                raise ConfigError(
                    "data.source must be Builtin('multi30k'), Generated('synthetic') or Shards(path), "
                    f"got {type(source).__name__}({source.name!r})"
                )
            if {src_lang, tgt_lang} != {"de", "en"}:
                raise ConfigError(
                    "data.src_lang/data.tgt_lang must be 'de' and 'en' in either order "
                    f"for source {source.name!r}, got {src_lang!r} -> {tgt_lang!r}"
                )
        if max_tokens < max_len + 2:
            raise ConfigError(
                f"data.max_tokens ({max_tokens}) must be at least data.max_len + 2 ({max_len + 2})"
            )
        self.source, self.src_lang, self.tgt_lang = source, src_lang, tgt_lang
        self.vocab_size_wanted = vocab_size if isinstance(source, Shards) else vocab_size or 8000
        self.max_tokens, self.eval_max_tokens = max_tokens, eval_max_tokens
        self.max_len = max_len
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer: SubwordTokenizer | None = None
        self.splits: dict[str, ParallelSplit] = {}
        self.train_lengths: np.ndarray | None = None  # from shards: the training pairs' lengths

    # -- what the model and the entry points need -------------------------------------------
    def model_kwargs(self) -> dict[str, int]:
        assert self.tokenizer is not None, "call setup() first"
        return {"vocab_size": self.tokenizer.vocab_size, "pad_id": self.tokenizer.pad_id}

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """Use a saved tokenizer (from a checkpoint) instead of fitting one."""
        super().load_artifacts(artifacts)
        if not isinstance(self.tokenizer, SubwordTokenizer):
            kind = type(self.tokenizer).__name__
            raise DataError(f"the checkpoint's tokenizer is a {kind}, not a translation vocabulary")

    def references(self, stage: str) -> list[str]:
        """The raw target sentences of "train", "val" or "test"."""
        return self.splits[stage].tgt_text

    def sources(self, stage: str) -> list[str]:
        return self.splits[stage].src_text

    # -- loading -----------------------------------------------------------------------------
    def _files(self, split: str) -> tuple[Path, Path]:
        return self._file(f"{split}.{self.src_lang}"), self._file(f"{split}.{self.tgt_lang}")

    def _file(self, name: str) -> Path:
        url = MULTI30K_URL.format(name=name)
        cache = Path(self.source.cache_dir) / "multi30k"
        return fetch(name, url, MULTI30K_SHA256[name], self.source.data_dir, cache, gunzip=True)

    def _read(self, stage: str) -> tuple[list[str], list[str]]:
        if isinstance(self.source, Generated):
            size = self.source.train_size
            n = size if stage == "train" else max(1, size // 10)
            src, tgt = synthetic_pairs(n, seed={"train": 0, "val": 1, "test": 2}[stage])
            return (src, tgt) if self.src_lang == "de" else (tgt, src)
        split = dict(zip(("train", "val", "test"), SPLITS["multi30k"], strict=True))[stage]
        src_path, tgt_path = self._files(split)
        src, tgt = read_parallel(src_path, tgt_path)
        if not src:
            raise DataError(f"parallel files {src_path} and {tgt_path} are empty")
        return src, tgt

    def prepare_data(self) -> None:
        if isinstance(self.source, Builtin):
            for split in SPLITS["multi30k"]:
                self._files(split)

    def _bpe_cache_path(self, src: list[str], tgt: list[str]) -> Path:
        """The joint BPE's file in ``cache_dir`` (never the user's ``data_dir``), keyed by the
        training text (the same for both directions)."""
        digest = hashlib.sha256("".join(f"{line}\n" for line in sorted([*src, *tgt])).encode()).hexdigest()
        name = f"bpe_{self.source.name}_{self.vocab_size_wanted}_{digest[:12]}.json"
        return Path(self.source.cache_dir).expanduser() / name

    def _fit_tokenizer(self, src: list[str], tgt: list[str]) -> SubwordTokenizer:
        path = self._bpe_cache_path(src, tgt)
        if path.is_file() and (tok := cached_tokenizer(path)) is not None:
            return tok
        tok = SubwordTokenizer.fit([*src, *tgt], self.vocab_size_wanted)
        with contextlib.suppress(OSError):  # a cache: not saved, not fatal
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".part")
            tmp.write_text(tok.to_json())
            tmp.replace(path)
            log.info("BPE vocabulary (%d) trained and saved to %s", tok.vocab_size, path)
        return tok

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        if isinstance(self.source, Shards):
            return self._setup_shards()
        raw = {s: self._read(s) for s in ("train", "val", "test")}
        if self.tokenizer is None:
            self.tokenizer = self._fit_tokenizer(*raw["train"])
        for s, (src_text, tgt_text) in raw.items():
            self.splits[s] = self._encode(s, src_text, tgt_text)
        tr = self.splits["train"]
        self._log(self.source.name, len(tr), sum(map(len, tr.tgt)) / len(tr))

    def _setup_shards(self) -> None:
        """Validation and test from the folder's text, encoded whole; training pairs read from its
        shards when a batch needs them (``ShardSide``)."""
        shards = PairShards(self.source.path)
        if {self.src_lang, self.tgt_lang} != set(shards.langs):
            raise DataError(
                f"{shards.folder}: holds {shards.langs[0]}-{shards.langs[1]} pairs; data.src_lang and "
                f"data.tgt_lang must be those two, got {self.src_lang!r} -> {self.tgt_lang!r}"
            )
        self.tokenizer = shards.own_tokenizer(self.tokenizer, vocab_size=self.vocab_size_wanted)
        for s in ("val", "test"):
            self.splits[s] = self._encode(
                s, *read_parallel(*shards.text_files(s, self.src_lang, self.tgt_lang))
            )
        src_len, tgt_len = shards.lengths(self.src_lang), shards.lengths(self.tgt_lang)
        keep = self._short(src_len, tgt_len)
        self.train_lengths = np.maximum(src_len, tgt_len)[keep] + 1
        side = {lang: ShardSide(shards, lang, keep) for lang in shards.langs}
        self.splits["train"] = ParallelSplit(side[self.src_lang], side[self.tgt_lang], [], [])
        self._log(str(shards.folder), len(keep), float(tgt_len[keep].mean()))

    def _log(self, corpus: str, n_train: int, tgt_tokens: float) -> None:
        sizes = (n_train, len(self.splits["val"]), len(self.splits["test"]))
        vocab = self.tokenizer.vocab_size
        what = f"pairs, joint BPE vocabulary {vocab}, {tgt_tokens:.1f} target tokens per sentence"
        log_splits(f"{corpus} {self.src_lang}->{self.tgt_lang}", sizes, what)

    def _short(self, src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
        """The training pairs that fit ``max_len`` with <bos>/<eos>; the others dropped (warned)."""
        limit = self.max_len - 1
        keep = np.flatnonzero((src_len <= limit) & (tgt_len <= limit))
        if len(keep) < len(src_len):
            n, total = len(src_len) - len(keep), len(src_len)
            log.warning(
                "dropped %d of %d training pairs longer than data.max_len=%d tokens", n, total, self.max_len
            )
        if not len(keep):
            raise DataError(f"no training pair is shorter than data.max_len={self.max_len} tokens")
        return keep

    def _encode(self, stage: str, src_text: list[str], tgt_text: list[str]) -> ParallelSplit:
        src, tgt = self.tokenizer.encode_batch(src_text), self.tokenizer.encode_batch(tgt_text)
        limit = self.max_len - 1  # room for <bos>/<eos>
        if stage == "train":
            keep = self._short(np.array([len(s) for s in src]), np.array([len(t) for t in tgt])).tolist()
            return ParallelSplit(*([side[i] for i in keep] for side in (src, tgt, src_text, tgt_text)))
        long = [i for i in range(len(src)) if len(src[i]) > limit or len(tgt[i]) > limit]
        if long:  # every reference must be scored: truncate the inputs instead
            n = (len(long), len(src), stage, self.max_len)
            log.warning("truncated %d of %d %s pairs to data.max_len=%d tokens", *n)
            src, tgt = [s[:limit] for s in src], [t[:limit] for t in tgt]
        return ParallelSplit(src, tgt, src_text, tgt_text)

    # -- loaders -----------------------------------------------------------------------------
    def split_loader(self, stage: str) -> DataLoader:
        """Token-budget batches of a split (``TokenBatchSampler``: under DDP each process its share,
        every evaluation pair scored once, a repeated batch marked ``repeat``)."""
        split, tok = self.splits[stage], self.tokenizer
        if stage == "train" and self.train_lengths is not None:
            lengths = self.train_lengths
        else:
            lengths = [max(len(s), len(t)) + 1 for s, t in zip(split.src, split.tgt, strict=True)]
        collate = Collate(split, tok.bos_id, tok.eos_id, tok.pad_id)
        max_tokens = self.max_tokens if stage == "train" else self.eval_max_tokens
        return self.token_loader(collate, lengths, max_tokens, stage)

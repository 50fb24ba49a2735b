"""Tokenizers that turn text into ids and back, and serialise into checkpoints as JSON; and
transformers' and open_clip's saved tokenizers (GPT-2's byte-level BPE, BERT's WordPiece, CLIP's BPE)
imported as ours."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from attnlab.core.errors import AttnlabError, DataError

CLIP_SOT, CLIP_EOT = "<|startoftext|>", "<|endoftext|>"  # OpenAI CLIP's, as transformers saves it
# OpenAI CLIP's (open_clip's SimpleTokenizer's) words: 's 't 're 've 'm 'll 'd, letters, one digit,
# other non-space runs
CLIP_WORDS = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
# a caption's words: letters and digits (joined by inner hyphens or apostrophes: "t-shirt",
# "dog's"), or one other non-space character ("," "." ";")
CAPTION_WORDS = r"""[\p{L}\p{N}]+(?:['-][\p{L}\p{N}]+)*|[^\s\p{L}\p{N}]"""


class CharTokenizer:
    """One id per character of the training text (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)

    @classmethod
    def fit(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unknown = sorted({c for c in text if c not in self.stoi})
            raise AttnlabError(
                f"text contains characters outside the model's vocabulary: {unknown!r} "
                f"(the vocabulary is {self.chars!r})"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "chars": self.chars})


class HFTokenizer:
    """A trained HF ``tokenizers`` model behind ``encode``/``decode``/``to_json``; subclasses say
    how it is trained (``fit``) and which ``kind`` a checkpoint records."""

    kind = ""
    skip_special_tokens = False
    specials: tuple[str, ...] = ()

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, lines: list[str], model: Any, trainer: Any, options: dict, **parts: Any) -> Any:
        """``model`` trained on ``lines`` by a ``trainer(**options)`` (the class's specials first),
        with the ``parts`` given (``normalizer``, ``pre_tokenizer``, ``decoder``)."""
        tok = Tokenizer(model)
        for name, part in parts.items():
            setattr(tok, name, part)
        trainer = trainer(**options, special_tokens=list(cls.specials), show_progress=False)
        tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` alone: the specials an imported tokenizer's post-processor would add
        (BERT's ``[CLS]``/``[SEP]``) are the data's to place."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "tokenizer": self.tokenizer.to_str()})

    def frame(
        self, captions: list[str], max_len: int, start: int, end: int, width: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """(N, width) ids (None: the longest), each caption ``start ... end`` then padding; one over
        ``max_len`` tokens loses its last words (``end`` is kept). The ids and how many were cut."""
        rows, cut = [], 0
        for ids in self.encode_batch(captions):
            if len(ids) > max_len - 2:
                ids, cut = ids[: max_len - 2], cut + 1
            rows.append([start, *ids, end])
        out = torch.full((len(rows), width or max(map(len, rows), default=2)), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row)
        return out, cut


class BPETokenizer(HFTokenizer):
    """Byte-level BPE (GPT-2 style); any text encodes."""

    kind = "bpe"

    @classmethod
    def fit(cls, text: str, vocab_size: int) -> BPETokenizer:
        options = {"vocab_size": vocab_size, "initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
        pre, decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        lines = text.splitlines(keepends=True)
        return cls.train(
            lines, models.BPE(), trainers.BpeTrainer, options, pre_tokenizer=pre, decoder=decoder
        )


class SubwordTokenizer(HFTokenizer):
    """Joint BPE over both languages of a parallel corpus: words split at spaces and punctuation,
    a space kept as "▁" on the next piece (SentencePiece's), so ``decode`` gives detokenised text
    (as sacreBLEU wants); ids 0-3 ``<pad> <unk> <bos> <eos>``, which ``decode`` drops."""

    kind = "subword"
    skip_special_tokens = True
    specials = ("<pad>", "<unk>", "<bos>", "<eos>")
    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    @classmethod
    def fit(cls, lines: list[str], vocab_size: int) -> SubwordTokenizer:
        pre = pre_tokenizers.Sequence(
            [pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation(behavior="isolated")]
        )
        model = models.BPE(unk_token="<unk>")
        parts = {"normalizer": normalizers.NFC(), "pre_tokenizer": pre, "decoder": decoders.Metaspace()}
        return cls.train(lines, model, trainers.BpeTrainer, {"vocab_size": vocab_size}, **parts)


class WordPieceTokenizer(HFTokenizer):
    """BERT's WordPiece (lower-cased, "##" continuations) with ``[PAD] [UNK] [CLS] [SEP] [MASK]``,
    which ``encode`` never adds and ``decode`` drops: ids 0-4 in one trained here, where its file
    puts them in an imported one (BERT's: 0, 100-103; the instance's ids say)."""

    kind = "wordpiece"
    skip_special_tokens = True
    specials = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    pad_id, unk_id, cls_id, sep_id, mask_id = 0, 1, 2, 3, 4

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        ids = {t: tokenizer.token_to_id(t) for t in self.specials}
        if missing := [t for t, i in ids.items() if i is None]:
            raise DataError(
                f"the WordPiece vocabulary has no {', '.join(missing)} "
                f"(BERT needs {', '.join(self.specials)})"
            )
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = ids.values()

    @classmethod
    def fit(cls, lines: list[str], vocab_size: int) -> WordPieceTokenizer:
        model = models.WordPiece(unk_token="[UNK]")
        parts = {
            "normalizer": normalizers.BertNormalizer(lowercase=True),
            "pre_tokenizer": pre_tokenizers.BertPreTokenizer(),
            "decoder": decoders.WordPiece(),
        }
        return cls.train(lines, model, trainers.WordPieceTrainer, {"vocab_size": vocab_size}, **parts)

    def token(self, i: int) -> str:
        return self.tokenizer.id_to_token(i)


class CaptionTokenizer(HFTokenizer):
    """CLIP's text encoding: lower-cased byte-level BPE, each caption ``<sot> ... <eot>`` cut to a
    context length; ids 0-2 ``<pad> <sot> <eot>`` in one trained here, OpenAI CLIP's
    ``<|startoftext|>`` 49406 and ``<|endoftext|>`` 49407 (padding 0) in an imported one."""

    kind = "caption"
    skip_special_tokens = True
    specials = ("<pad>", "<sot>", "<eot>")
    pad_id, sot_id, eot_id = 0, 1, 2

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        if tokenizer.token_to_id("<sot>") is not None:
            return
        sot, eot = tokenizer.token_to_id(CLIP_SOT), tokenizer.token_to_id(CLIP_EOT)
        if sot is None or eot is None:
            raise DataError(
                f"a caption vocabulary needs <sot> and <eot>, or CLIP's {CLIP_SOT} and {CLIP_EOT}"
            )
        self.pad_id, self.sot_id, self.eot_id = 0, sot, eot

    @classmethod
    def fit(cls, lines: list[str], vocab_size: int) -> CaptionTokenizer:
        options = {"vocab_size": vocab_size, "initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
        norm = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
        pre, decoder = pre_tokenizers.ByteLevel(add_prefix_space=True), decoders.ByteLevel()
        parts = {"normalizer": norm, "pre_tokenizer": pre, "decoder": decoder}
        return cls.train(lines, models.BPE(), trainers.BpeTrainer, options, **parts)

    def encode_captions(self, captions: list[str], context_length: int) -> tuple[torch.Tensor, int]:
        """(N, context_length) ids, each caption ``<sot> ... <eot>`` (``frame``)."""
        return self.frame(captions, context_length, self.sot_id, self.eot_id, context_length)


class WordTokenizer(HFTokenizer):
    """One id per lower-cased word (``CAPTION_WORDS``) of the training captions, as Show, Attend and
    Tell's vocabulary: ids 0-3 ``<pad> <bos> <eos> <unk>``, then the words, most frequent first."""

    kind = "word"
    skip_special_tokens = True
    specials = ("<pad>", "<bos>", "<eos>", "<unk>")
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    @classmethod
    def fit(cls, lines: list[str], vocab_size: int | None = None, min_frequency: int = 1) -> WordTokenizer:
        """The words of ``lines`` seen at least ``min_frequency`` times, the ``vocab_size`` (specials
        included) most frequent of them if given."""
        options = {"vocab_size": vocab_size or 1 << 30, "min_frequency": min_frequency}
        norm = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
        pre = pre_tokenizers.Split(Regex(CAPTION_WORDS), behavior="removed", invert=True)
        model = models.WordLevel(unk_token="<unk>")
        return cls.train(lines, model, trainers.WordLevelTrainer, options, normalizer=norm, pre_tokenizer=pre)

    def encode_captions(self, captions: list[str], max_len: int) -> tuple[torch.Tensor, int]:
        """(N, T) ids, each caption ``<bos> words <eos>``, T the longest of them (``frame``)."""
        return self.frame(captions, max_len, self.bos_id, self.eos_id)


def tokenizer_from_json(s: str) -> CharTokenizer | HFTokenizer:
    state = json.loads(s)
    if state["kind"] == "char":
        return CharTokenizer(state["chars"])
    for cls in (BPETokenizer, SubwordTokenizer, WordPieceTokenizer, CaptionTokenizer, WordTokenizer):
        if state["kind"] == cls.kind:
            return cls(Tokenizer.from_str(state["tokenizer"]))
    raise ValueError(f"unknown tokenizer kind {state['kind']!r}")


def import_tokenizer(folder: Path) -> BPETokenizer | WordPieceTokenizer | CaptionTokenizer | None:
    """transformers' or open_clip's saved tokenizer in ``folder`` (``tokenizer.json``, GPT-2's or
    CLIP's ``vocab.json`` + ``merges.txt``, BERT's ``vocab.txt``) as ours, with the file's ids;
    ``None`` when the folder has none of them."""
    folder = folder if folder.is_dir() else folder.parent
    try:
        if (folder / "tokenizer.json").is_file():
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            tok = _bpe_from_files(folder / "vocab.json", folder / "merges.txt")
        elif (folder / "vocab.txt").is_file():
            tok = Tokenizer(models.WordPiece.from_file(str(folder / "vocab.txt"), unk_token="[UNK]"))
            tok.normalizer = normalizers.BertNormalizer(lowercase=_lower_case(folder))
            tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
            tok.decoder = decoders.WordPiece()
        else:
            return None
    except Exception as e:  # tokenizers raises its own Exception subclass for a malformed file
        reason = (str(e).strip().splitlines() or ["no details"])[0][:200]
        raise DataError(f"model.init_from={folder}: its tokenizer files are unreadable ({reason})") from e
    tok.no_padding()
    tok.no_truncation()
    kind = type(tok.model).__name__
    # CLIP's, or ours fitted on a CLIP run's captions (its <sot>), as attnlab-export writes it
    if kind == "BPE" and (tok.model.end_of_word_suffix == "</w>" or tok.token_to_id("<sot>") is not None):
        return CaptionTokenizer(tok)
    if kind == "BPE":
        return BPETokenizer(tok)
    if kind == "WordPiece":
        return WordPieceTokenizer(tok)
    raise DataError(
        f"model.init_from={folder}: a {kind} tokenizer (GPT-2's and CLIP's BPE and BERT's WordPiece import)"
    )


def _bpe_from_files(vocab: Path, merges: Path) -> Tokenizer:
    """GPT-2's byte-level BPE, or CLIP's when the vocabulary has its ``<|startoftext|>``: words
    end in ``</w>``, text is lower-cased with whitespace runs made one space and split into CLIP's
    words (transformers' ``CLIPConverter``, which gives open_clip's ``SimpleTokenizer`` ids)."""
    if CLIP_SOT not in json.loads(vocab.read_text(encoding="utf-8")):
        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    bpe = models.BPE.from_file(
        str(vocab), str(merges), continuing_subword_prefix="", end_of_word_suffix="</w>", unk_token=CLIP_EOT
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CLIP_WORDS), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([CLIP_SOT, CLIP_EOT])
    return tok


def _lower_case(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return True
    return bool(json.loads(config.read_text(encoding="utf-8")).get("do_lower_case", True))

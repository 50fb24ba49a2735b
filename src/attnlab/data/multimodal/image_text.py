"""Image-caption pairs for CLIP: (image path, caption) rows of a CSV or JSONL file, their shards, or
Fashion-MNIST / MNIST with generated captions."""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import DropRate, PositiveInt
from attnlab.data.base import TokenizerDataModule
from attnlab.data.multimodal import captions as cap
from attnlab.data.sampling import Key, carve, example_seed
from attnlab.data.shards.tar import BadRecords, Record, read_shard
from attnlab.data.shards.writer import check_free
from attnlab.data.sources import Builtin, Captions, CaptionShards, Pairs
from attnlab.data.text.tokenizers import CaptionTokenizer
from attnlab.data.vision.classification import ImagesDataModule, random_crop_flip
from attnlab.data.vision.datasets import decode_image, load_builtin, read_image, square
from attnlab.data.vision.shards import carved_items, image_bytes, image_items, write_shards

log = logging.getLogger(__name__)


class GeneratedCaptions(Dataset):
    """(uint8 image, caption, label) of labelled images; with a ``seed`` (training) each draw phrases
    its image with a random template, else (evaluation) always with the same, fullest one."""

    eval_template = "this {c} is {brightness}, {size} and {width}"

    def __init__(
        self, images: Tensor, labels: Tensor, levels: Tensor, phrases: list[str], seed: int | None = None
    ) -> None:
        self.images, self.labels, self.levels = images, labels, levels
        self.phrases, self.seed = phrases, seed

    def __len__(self) -> int:
        return len(self.labels)

    def caption(self, key: int | Key) -> str:
        i = key if isinstance(key, int) else key[1]
        template = self.eval_template
        if self.seed is not None:  # seeded by the sampler's (epoch, index): a resumed run draws the same
            seed = example_seed(self.seed, key)
            g = torch.Generator().manual_seed(seed) if seed is not None else None
            template = cap.TRAIN_TEMPLATES[int(torch.randint(len(cap.TRAIN_TEMPLATES), (), generator=g))]
        return cap.caption(self.phrases[self.labels[i]], self.levels[i].tolist(), template)

    def __getitem__(self, key: int | Key) -> tuple[Tensor, str, int]:
        i = key if isinstance(key, int) else key[1]
        return self.images[i], self.caption(key), int(self.labels[i])


class CaptionedFiles(Dataset):
    """(uint8 image (C, S, S), caption or references, its index or -1) from image files, decoded
    and resized when read; nothing random (a training draw's ``(epoch, index)`` key is the index)."""

    def __init__(
        self, paths: list[Path], captions: list, img_size: int, in_chans: int, indexed: bool = False
    ) -> None:
        self.paths, self.captions, self.indexed = paths, captions, indexed
        self.img_size, self.in_chans = img_size, in_chans

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: int | Key) -> tuple[Tensor, str | list[str], int]:
        i = key if isinstance(key, int) else key[1]
        image = square(read_image(self.paths[i], self.in_chans), self.img_size)
        return image, self.captions[i], i if self.indexed else -1


def read_pairs(path: Path, image_key: str, caption_key: str) -> list[tuple[str, str]]:
    """(image, caption) rows of a CSV (with a header) or JSONL file."""
    if not path.is_file():
        raise DataError(f"data.source.path={path}: no such file")
    rows = []
    with path.open(encoding="utf-8", newline="") as f:
        if path.suffix == ".jsonl":
            for line, text in enumerate(f, 1):
                if text.strip():
                    try:
                        row = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{line}: not a JSON object ({e.msg})") from None
                    rows.append((row, line))
        else:
            reader = csv.DictReader(f)
            rows = [(row, line) for line, row in enumerate(reader, 2)]
    out = []
    for row, line in rows:
        if not isinstance(row, dict) or image_key not in row or caption_key not in row:
            raise DataError(f"{path}:{line}: expected the fields {image_key!r} and {caption_key!r}")
        if not str(row[caption_key] or "").strip():
            raise DataError(f"{path}:{line}: empty caption")
        out.append((str(row[image_key]), str(row[caption_key]).strip()))
    if not out:
        raise DataError(f"{path}: no image-caption rows")
    return out


def prepare_image_text(
    pairs_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    val_size: int = 1000,
    test_file: str | os.PathLike | None = None,
    image_key: str = "image",
    caption_key: str = "caption",
    shard_records: int = 10_000,
    on_bad_record: str = "error",
    seed: int = 1337,
) -> dict[str, Any]:
    """Image-caption rows (CSV or JSONL) into shards of kind ``image_text`` (``key.jpg`` + ``key.txt``,
    as open_clip reads them): ``val_size`` rows carved (seeded), ``test_file``'s the test split."""

    def rows(path: Path) -> tuple[list[Path], list[str]]:
        found = read_pairs(path, image_key, caption_key)
        return [path.parent / image for image, _ in found], [text for _, text in found]

    check_free(Path(out_dir))
    splits = carved_items(*rows(Path(pairs_file)), "txt", val_size, seed)
    if test_file is not None:
        splits["test"] = image_items(*rows(Path(test_file)), "txt")
    meta = {"kind": "image_text", "source": str(pairs_file)}
    return write_shards(splits, out_dir, meta, shard_records, on_bad_record)


class ImageTextDataModule(TokenizerDataModule, ImagesDataModule):
    """CLIP batches (uint8 images (B, C, H, W), caption ids (B, T), labels (B,)) of a ``Builtin`` set
    (captions generated from the label and measured attributes; ``classes``: their phrases, for
    zero-shot), ``Pairs`` or ``CaptionShards``. ``max_len`` counts ``<sot>`` and ``<eot>``; the BPE
    (``vocab_size``) is fitted on the training captions."""

    HELD_OUT = ("val",)  # the splits carved out of the source

    def __init__(
        self,
        source: Builtin | Pairs | Captions | CaptionShards | None = None,
        img_size: PositiveInt = 64,
        in_chans: PositiveInt = 3,
        batch_size: PositiveInt = 128,
        max_len: PositiveInt = 24,
        vocab_size: PositiveInt = 512,
        crop_padding: int = 0,
        hflip: DropRate = 0.0,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        source = source or Builtin("fashion_mnist", val_size=5000)
        if isinstance(source, Builtin):
            source.one_of(cap.CLASS_PHRASES)
        if max_len < 3:
            raise ConfigError(f"data.max_len must be >= 3 (<sot>, a token, <eot>), got {max_len}")
        self.sizes = [] if isinstance(source, CaptionShards) else [source.size(s) for s in self.HELD_OUT]
        self.source, self.img_size, self.in_chans = source, img_size, in_chans
        self.bad = BadRecords(getattr(source, "on_bad_record", "error"))  # Pairs' and shards'
        self.max_len, self.vocab_size = max_len, vocab_size
        self.crop_padding, self.hflip = crop_padding, hflip
        self.tokenizer: CaptionTokenizer | None = None
        self.templates: list[str] = list(cap.ZEROSHOT_TEMPLATES)

    def model_kwargs(self) -> dict[str, Any]:
        tok = self.tokenizer
        text = {"vocab_size": tok.vocab_size, "max_len": self.max_len, "pad_id": tok.pad_id}
        return {"image": {"img_size": self.img_size, "in_chans": self.in_chans}, "text": text}

    def artifacts(self) -> dict[str, Any]:
        return {
            "context_length": self.max_len,  # the artifacts' name (saved runs, exports, open_clip)
            "templates": self.templates,
            **super().artifacts(),
        }

    def build(self) -> str:
        setups = {Pairs: self._setup_pairs, CaptionShards: self._setup_shards}
        corpus = setups.get(type(self.source), self._setup_generated)()
        if self.tokenizer is None:
            self.tokenizer = CaptionTokenizer.fit(corpus, self.vocab_size)
        _, truncated = self.tokenizer.encode_captions(corpus, self.max_len)
        if truncated:
            n = (truncated, len(corpus), self.max_len)
            log.warning("%d of %d training captions are longer than data.max_len=%d tokens: cut", *n)
        return f"pairs, a {self.tokenizer.vocab_size}-token caption vocabulary"

    def _setup_generated(self) -> list[str]:
        data = load_builtin(self.source)
        self.in_chans, self.img_size = data.train_images.size(1), data.train_images.size(-1)  # as stored
        val, train = carve(len(data.train_labels), self.sizes, self.seed)
        self.classes = list(cap.CLASS_PHRASES[self.source.name])
        values = cap.measure(data.train_images)
        cuts = cap.tertile_cuts(values[train], data.train_labels[train], len(self.classes))
        levels = cap.attribute_levels(values, data.train_labels, cuts)
        test_levels = cap.attribute_levels(cap.measure(data.test_images), data.test_labels, cuts)
        images, labels = data.train_images, data.train_labels
        self.splits = {
            "train": GeneratedCaptions(images[train], labels[train], levels[train], self.classes, self.seed),
            "val": GeneratedCaptions(images[val], labels[val], levels[val], self.classes),
            "test": GeneratedCaptions(data.test_images, data.test_labels, test_levels, self.classes),
        }
        self.measure(images[train])
        return cap.caption_corpus(self.classes)

    def _readable(self, path: Path) -> tuple[list[Path], list[str]]:
        """The pairs file's readable images and their captions (the rest: ``on_bad_record``)."""
        rows = read_pairs(path, self.source.image_key, self.source.caption_key)
        paths, texts, bad = [], [], []
        for image, text in rows:
            try:
                with Image.open(path.parent / image) as im:
                    im.verify()
                paths.append(path.parent / image)
                texts.append(text)
            except (OSError, UnidentifiedImageError):
                bad.append(path.parent / image)
        if bad:
            what = f"{path}: {len(bad)} of {len(rows)} listed images are missing or unreadable"
            what += f" (first: {bad[0]})"
            if self.bad.policy == "error":
                raise DataError(f"{what}; set data.source.on_bad_record=skip to leave them out")
            log.warning("%s: skipped", what)
        if not paths:
            raise DataError(f"{path}: none of the listed images can be read")
        return paths, texts

    def _setup_pairs(self) -> list[str]:
        paths, texts = self._readable(Path(self.source.path))
        val, train = carve(len(paths), self.sizes, self.seed)
        pick = lambda idx: ([paths[i] for i in idx], [texts[i] for i in idx])  # noqa: E731
        files = {"train": pick(train), "val": pick(val)}
        if self.source.test_file is not None:
            files["test"] = self._readable(Path(self.source.test_file))
        self.splits = {s: CaptionedFiles(*f, self.img_size, self.in_chans) for s, f in files.items()}
        self.measure(self.splits["train"])
        return self.splits["train"].captions

    def _setup_shards(self) -> list[str]:
        self.open_shards("image_text", "image-caption shards (key.jpg + key.txt)")
        self.read_shards(self.decode_record)
        self.measure(self.splits["val"])
        return self._shard_captions()

    def _shard_captions(self) -> list[str]:
        """The first ``fit_captions`` training captions (read past the images, not decoded)."""
        out: list[str] = []
        for shard in self.shards.splits["train"]:
            for record in read_shard(shard, 0, self.bad):
                if "txt" in record:
                    out.append(record["txt"].decode("utf-8", errors="replace").strip())
                if len(out) >= self.source.fit_captions:
                    return out
        if not out:
            raise DataError(f"{self.source.path}: no training captions")
        return out

    def decode_record(self, record: Record, where: str, seed: int | None = None) -> tuple[Tensor, str, int]:
        """A shard record -> (uint8 (C, S, S) image, caption, -1); nothing random."""
        try:
            text = record["txt"].decode("utf-8").strip()
        except (KeyError, UnicodeDecodeError):
            raise DataError(f"{where}: no UTF-8 caption (.txt)") from None
        if not text:
            raise DataError(f"{where}: empty caption")
        img = decode_image(image_bytes(record), where, "L" if self.in_chans == 1 else "RGB")
        return square(TF.pil_to_tensor(img), self.img_size), text, -1

    def collate(self, items: list[tuple[Tensor, str, int] | None]) -> tuple[Tensor, Tensor, Tensor]:
        images, texts, labels = zip(*[x for x in items if x is not None], strict=True)  # None: skipped
        tokens, _ = self.tokenizer.encode_captions(list(texts), self.max_len)
        return torch.stack(images), tokens, torch.tensor(labels)

    def augment(self, images: Tensor) -> Tensor:
        return random_crop_flip(images, self.crop_padding, self.hflip)

    decode_train = decode_record

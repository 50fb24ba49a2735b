"""Image-caption pairs for CLIP: from a CSV or JSONL file of (image path, caption) rows, as
Flickr8k/COCO-style sets come, or built from Fashion-MNIST / MNIST with generated captions."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import DropRate, PositiveInt
from attnlab.data.base import SplitsDataModule, log_splits
from attnlab.data.multimodal import captions as cap
from attnlab.data.sampling import Key, carve, example_seed
from attnlab.data.shards.tar import BadRecords, Record, ShardRecords, TarShards, read_shard, stream_loader
from attnlab.data.sources import Builtin, Captions, CaptionShards, Pairs
from attnlab.data.text.tokenizers import CaptionTokenizer, tokenizer_from_json
from attnlab.data.vision.classification import channel_stats, normalize, random_crop_flip, sample_stats
from attnlab.data.vision.datasets import BuiltinImages, load_builtin, square, unreadable_image
from attnlab.data.vision.shards import decode_image, image_bytes

log = logging.getLogger(__name__)


class GeneratedCaptions(Dataset):
    """(uint8 image, caption, label) of labelled images; a training draw phrases each image with
    a random template, evaluation always with the same, fullest one."""

    eval_template = "this {c} is {brightness}, {size} and {width}"

    def __init__(
        self, images: Tensor, labels: Tensor, levels: Tensor, phrases: list[str], train: bool, seed: int = 0
    ) -> None:
        self.images, self.labels, self.levels, self.phrases = images, labels, levels, phrases
        self.train, self.seed = train, seed

    def __len__(self) -> int:
        return len(self.labels)

    def caption(self, key: int | Key) -> str:
        i = key if isinstance(key, int) else key[1]
        seed = example_seed(self.seed, key)
        if self.train:  # seeded by the sampler's (epoch, index): a resumed run draws the same
            g = torch.Generator().manual_seed(seed) if seed is not None else None
            template = cap.TRAIN_TEMPLATES[int(torch.randint(len(cap.TRAIN_TEMPLATES), (), generator=g))]
        else:
            template = self.eval_template
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
        self.paths, self.captions, self.img_size, self.in_chans = paths, captions, img_size, in_chans
        self.indexed = indexed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: int | Key) -> tuple[Tensor, str | list[str], int]:
        i = key if isinstance(key, int) else key[1]
        try:
            with Image.open(self.paths[i]) as im:
                image = TF.pil_to_tensor(im.convert("L" if self.in_chans == 1 else "RGB"))
        except (OSError, UnidentifiedImageError, ValueError) as e:
            raise unreadable_image(self.paths[i], e) from None
        return square(image, self.img_size), self.captions[i], i if self.indexed else -1


def read_pairs(path: Path, image_key: str, caption_key: str) -> list[tuple[str, str, int]]:
    """(image, caption, line) rows of a CSV (with a header) or JSONL file."""
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
        out.append((str(row[image_key]), str(row[caption_key]).strip(), line))
    if not out:
        raise DataError(f"{path}: no image-caption rows")
    return out


class ImageTextDataModule(BuiltinImages, SplitsDataModule):
    """Batches of (uint8 images (B, C, H, W), caption ids (B, T), labels (B,)) for CLIP, from a
    ``Builtin`` set (captions generated from the label and measured attributes; zero-shot prompts),
    ``Pairs`` or ``CaptionShards`` (images made ``img_size``, ``in_chans``). ``max_len`` counts
    ``<sot>`` and ``<eot>``; ``vocab_size``: the BPE fitted on the training captions."""

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
        super().__init__()
        source = source or Builtin("fashion_mnist", val_size=5000)
        if isinstance(source, Builtin):
            source.one_of(cap.CLASS_PHRASES)
        if max_len < 3:
            raise ConfigError(f"data.max_len must be >= 3 (<sot>, a token, <eot>), got {max_len}")
        self.sizes = [] if isinstance(source, CaptionShards) else self.held_out(source)
        self.source, self.img_size, self.in_chans = source, img_size, in_chans
        self.bad = BadRecords(getattr(source, "on_bad_record", "error"))  # Pairs' and shards'
        self.shards: TarShards | None = None
        self.batch_size, self.max_len = batch_size, max_len
        self.vocab_size, self.crop_padding, self.hflip = vocab_size, crop_padding, hflip
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer: CaptionTokenizer | None = None
        self.classes: list[str] | None = None  # caption phrases of the classes (zero-shot), if known
        self.templates: list[str] = list(cap.ZEROSHOT_TEMPLATES)
        self.mean: list[float] | None = None
        self.std: list[float] | None = None
        self.splits: dict[str, Dataset] = {}

    def held_out(self, source: Builtin | Pairs | Captions) -> list[int | float]:
        """The sizes carved out of the source: validation."""
        return [source.size("val")]

    # --- what the model and inference need -------------------------------------------------

    def model_kwargs(self) -> dict[str, Any]:
        return {
            "image": {"img_size": self.img_size, "in_chans": self.in_chans},
            "text": {
                "vocab_size": self.tokenizer.vocab_size,
                "max_len": self.max_len,  # the text tower's position table
                "pad_id": CaptionTokenizer.pad_id,
            },
        }

    def artifacts(self) -> dict[str, Any]:
        return {
            "tokenizer": self.tokenizer.to_json(),
            "context_length": self.max_len,  # the artifacts' name (saved runs, exports, open_clip)
            "classes": self.classes,
            "templates": self.templates,
            "img_size": self.img_size,
            "in_chans": self.in_chans,
            "mean": self.mean,
            "std": self.std,
        }

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """A run's tokenizer and normalisation, or pre-trained weights' tokenizer alone."""
        self.tokenizer = tokenizer_from_json(artifacts["tokenizer"])
        self.mean, self.std = artifacts.get("mean", self.mean), artifacts.get("std", self.std)

    # --- loading ---------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        setups = {Pairs: self._setup_pairs, CaptionShards: self._setup_shards}
        corpus = setups.get(type(self.source), self._setup_generated)()
        if self.tokenizer is None:
            self.tokenizer = CaptionTokenizer.fit(corpus, self.vocab_size)
        _, truncated = self.tokenizer.encode_captions(corpus, self.max_len)
        if truncated:
            n = (truncated, len(corpus), self.max_len)
            log.warning("%d of %d training captions are longer than data.max_len=%d tokens: cut", *n)
        self.log_splits("pairs", f"a {self.tokenizer.vocab_size}-token caption vocabulary")

    def log_splits(self, what: str, vocabulary: str) -> None:
        train = len(self.splits["train"]) if "train" in self.splits else self.shards.count("train")
        log_splits(
            self.source.where,
            (train, len(self.splits["val"]), len(self.splits["test"])),
            f"{what}, {vocabulary}",
        )

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
            "train": GeneratedCaptions(
                images[train], labels[train], levels[train], self.classes, train=True, seed=self.seed
            ),
            "val": GeneratedCaptions(images[val], labels[val], levels[val], self.classes, train=False),
            "test": GeneratedCaptions(
                data.test_images, data.test_labels, test_levels, self.classes, train=False
            ),
        }
        if self.mean is None:
            self.mean, self.std = channel_stats(images[train])
        return cap.caption_corpus(self.classes)

    def _readable(self, path: Path) -> tuple[list[Path], list[str]]:
        """The pairs file's readable images and their captions (the rest: ``on_bad_record``)."""
        src = self.source
        rows = read_pairs(path, src.image_key, src.caption_key)
        paths, texts, bad = [], [], []
        for image, text, _ in rows:
            try:
                with Image.open(path.parent / image) as im:
                    im.verify()
            except (OSError, UnidentifiedImageError):
                bad.append(path.parent / image)
                continue
            paths.append(path.parent / image)
            texts.append(text)
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
        files = [
            CaptionedFiles([paths[i] for i in idx], [texts[i] for i in idx], self.img_size, self.in_chans)
            for idx in (train, val)
        ]
        self.splits = {"train": files[0], "val": files[1], "test": files[1]}
        if self.source.test_file is not None:
            tpaths, ttexts = self._readable(Path(self.source.test_file))
            self.splits["test"] = CaptionedFiles(tpaths, ttexts, self.img_size, self.in_chans)
        if self.mean is None:
            self.mean, self.std = sample_stats(files[0])
        return files[0].captions

    def _setup_shards(self) -> list[str]:
        self.shards = TarShards(self.source.path)
        if self.shards.kind != "image_text":
            raise DataError(
                f"{self.source.path}: not image-caption shards (key.jpg + key.txt); see its manifest"
            )
        if not self.shards.count("val"):
            raise DataError(f"{self.source.path}: no validation records (prepare with --val-size > 0)")
        for split in ("val", "test"):
            if self.shards.count(split):
                self.splits[split] = ShardRecords(self.shards.splits[split], self.decode_record, self.bad)
        self.splits.setdefault("test", self.splits["val"])
        if self.mean is None:
            self.mean, self.std = sample_stats(self.splits["val"])
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

    # --- batches ---------------------------------------------------------------------------

    def collate(self, items: list[tuple[Tensor, str, int] | None]) -> tuple[Tensor, Tensor, Tensor]:
        images, texts, labels = zip(*[x for x in items if x is not None], strict=True)  # None: skipped
        tokens, _ = self.tokenizer.encode_captions(list(texts), self.max_len)
        return torch.stack(images), tokens, torch.tensor(labels)

    def normalize(self, images: Tensor) -> Tensor:
        return normalize(images, self.mean, self.std)

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor, Tensor], dataloader_idx: int) -> tuple:
        images, tokens, labels = batch
        if self.trainer is not None and self.trainer.training and (self.crop_padding or self.hflip):
            images = random_crop_flip(images, self.crop_padding, self.hflip)
        return self.normalize(images), tokens, labels

    def train_dataloader(self) -> DataLoader:
        if isinstance(self.source, CaptionShards):
            return stream_loader(self, self.shards.splits["train"], self.decode_record, self.collate)
        return super().train_dataloader()

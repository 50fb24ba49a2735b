"""A real captioning set for the captioners (``data=captions_folder``): a Flickr8k token file or COCO
``captions_*.json`` and its images, or image-caption tar shards; the scenes' batches without boxes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from attnlab.core.errors import DataError
from attnlab.data.multimodal.image_text import CaptionedFiles, ImageTextDataModule
from attnlab.data.sampling import carve
from attnlab.data.sources import Captions, CaptionShards
from attnlab.data.text.tokenizers import WordTokenizer

Listing = dict[str, tuple[list[str], str]]  # image name -> its captions, where it is first listed


def read_flickr8k(path: Path) -> Listing:
    """``name.jpg#N<TAB>caption`` lines (Flickr8k's and Flickr30k's token files)."""
    out: Listing = {}
    for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        name, tab, caption = text.partition("\t")
        if not tab:
            raise DataError(f"{path}:{line}: expected name.jpg#N<TAB>caption")
        if not caption.strip():
            raise DataError(f"{path}:{line}: empty caption")
        image = name.rsplit("#", 1)[0].strip()
        out.setdefault(image, ([], f"{path}:{line}"))[0].append(caption.strip())
    return out


def read_coco(path: Path) -> Listing:
    """A COCO captions file: ``images`` (id, file_name) and ``annotations`` (image_id, caption)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        names = {im["id"]: im["file_name"] for im in data["images"]}
        notes = [(a["image_id"], a["caption"]) for a in data["annotations"]]
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    except (KeyError, TypeError):
        raise DataError(
            f"{path}: expected COCO captions: images (id, file_name) and annotations (image_id, caption)"
        ) from None
    out: Listing = {}
    for k, (image_id, caption) in enumerate(notes):
        if image_id not in names:
            raise DataError(f"{path}: annotation {k} names image_id {image_id}, not one of its images")
        if not str(caption or "").strip():
            raise DataError(f"{path}: annotation {k} (image {names[image_id]}): empty caption")
        out.setdefault(names[image_id], ([], f"{path}: annotation {k}"))[0].append(str(caption).strip())
    return out


def read_captions(path: Path, images_dir: Path) -> tuple[list[Path], list[list[str]]]:
    """The listed images (checked: present and of an image format) and each one's captions."""
    if not path.is_file():
        raise DataError(f"data.source.path={path}: no such file")
    listing = read_coco(path) if path.suffix == ".json" else read_flickr8k(path)
    if not listing:
        raise DataError(f"{path}: no captions")
    paths = []
    for name, (_, where) in listing.items():
        image = images_dir / name
        if not image.is_file():
            raise DataError(f"{where}: image {name} not found in {images_dir}")
        try:
            with Image.open(image):  # reads the header: what format, what size
                pass
        except (OSError, UnidentifiedImageError):
            raise DataError(f"{image}: not a readable image") from None
        paths.append(image)
    return paths, [captions for captions, _ in listing.values()]


class CaptionsFolderDataModule(ImageTextDataModule):
    """Caption batches (``image``, ``tokens``, ``captions``, ``idx``: ``ScenesDataModule``'s without
    boxes) from ``Captions(path)`` (its ``val_size`` and ``test_size`` images carved, seeded) or
    ``CaptionShards(path)`` (their own splits, one caption per record). A training example is one
    (image, caption) pair, an evaluation example an image with all its captions. The vocabulary
    (``WordTokenizer``: ``vocab_size`` words at most, rarer than ``min_frequency``: ``<unk>``) is
    fitted on the training captions and kept in the checkpoint; ``max_len`` counts ``<bos>``/``<eos>``."""

    HELD_OUT = ("val", "test")

    def __init__(
        self,
        source: Captions | CaptionShards,
        img_size: int = 64,
        in_chans: int = 3,
        batch_size: int = 64,
        max_len: int = 32,
        vocab_size: int = 10_000,
        min_frequency: int = 1,
        num_workers: int = 2,
        seed: int = 1337,
    ) -> None:
        super().__init__(
            source, img_size, in_chans, batch_size, max_len, vocab_size, 0, 0.0, num_workers, seed
        )
        self.min_frequency = min_frequency

    def model_kwargs(self) -> dict[str, Any]:
        towers = super().model_kwargs()  # one model: the text's and the image's arguments together
        return {**towers["text"], **towers["image"]}

    def artifacts(self) -> dict[str, Any]:
        return {**super().artifacts(), "max_len": self.max_len}

    def build(self) -> str:
        corpus = self._setup_shards() if isinstance(self.source, CaptionShards) else self._setup_files()
        if self.tokenizer is None:
            self.tokenizer = WordTokenizer.fit(corpus, self.vocab_size, self.min_frequency)
        return f"examples, a {self.tokenizer.vocab_size}-word vocabulary"

    def _setup_files(self) -> list[str]:
        path = Path(self.source.path)
        images = self.source.images_dir
        paths, captions = read_captions(path, Path(images) if images else path.parent)
        val, test, train = carve(len(paths), self.sizes, self.seed, "data.source.val_size + test_size")
        pairs = [(paths[i], c) for i in train for c in captions[i]]
        self.splits = {"train": self.files([p for p, _ in pairs], [c for _, c in pairs])}
        for split, idx in (("val", val), ("test", test)):
            self.splits[split] = self.files([paths[i] for i in idx], [captions[i] for i in idx])
        self.measure(self.splits["train"])
        return [c for _, c in pairs]

    def files(self, paths: list[Path], captions: list) -> CaptionedFiles:
        return CaptionedFiles(paths, captions, self.img_size, self.in_chans, indexed=True)

    def collate(self, items: list[tuple[Tensor, str | list[str], int] | None]) -> dict[str, Any]:
        """Examples -> a batch; ``tokens`` are the first reference's. Skipped shard records (None)
        are left out; shard records have no index (-1), and the batch then no ``idx``."""
        images, captions, idx = zip(*[x for x in items if x is not None], strict=True)
        first = [c if isinstance(c, str) else c[0] for c in captions]
        tokens, _ = self.tokenizer.encode_captions(first, self.max_len)
        batch = {"image": torch.stack(images), "tokens": tokens, "captions": list(captions)}
        if min(idx) >= 0:
            batch["idx"] = torch.tensor(idx)
        return batch

"""A real captioning set for the captioners (``data=captions_folder``): images and a captions file
as Flickr8k (``Flickr8k.token.txt``: ``name.jpg#0<TAB>caption``) or COCO (``captions_*.json``)
lay them out, or image-caption tar shards (``key.jpg`` + ``key.txt``, read as
``data=image_text_shards`` reads them). Batches are the scenes' caption batches, without boxes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.multimodal.image_text import ImageTextDataModule, square
from attnlab.data.sampling import Key
from attnlab.data.sources import Captions, CaptionShards
from attnlab.data.text.tokenizers import WordTokenizer
from attnlab.data.vision.classification import channel_stats, normalize
from attnlab.data.vision.datasets import unreadable_image

log = logging.getLogger(__name__)

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
    """A COCO captions file: ``images`` (``id``, ``file_name``) and ``annotations`` (``image_id``,
    ``caption``)."""
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


class CaptionExamples(Dataset):
    """(uint8 image (C, S, S), caption or references, index): a caption per example (training),
    or all of an image's captions (evaluation); images decoded when read."""

    def __init__(
        self, paths: list[Path], captions: list[str] | list[list[str]], img_size: int, in_chans: int
    ) -> None:
        self.paths, self.captions, self.img_size, self.in_chans = paths, captions, img_size, in_chans

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: int | Key) -> tuple[Tensor, str | list[str], int]:
        i = key if isinstance(key, int) else key[1]  # a training draw's (epoch, index): nothing random here
        try:
            with Image.open(self.paths[i]) as im:
                image = TF.pil_to_tensor(im.convert("L" if self.in_chans == 1 else "RGB"))
        except (OSError, UnidentifiedImageError, ValueError) as e:
            raise unreadable_image(self.paths[i], e) from None
        return square(image, self.img_size), self.captions[i], i


class CaptionsFolderDataModule(ImageTextDataModule):
    """Caption batches (``image``, ``tokens``, ``captions``, ``idx``; as ``ScenesDataModule``'s,
    without boxes) from a captions file and its images, or from image-caption tar shards.

    A captions file's images are shared out (seeded) into ``val_size`` validation images,
    ``test_size`` test images and the rest for training; each training example is one (image,
    caption) pair, each evaluation example one image with all its captions as references
    (``captions`` is then a list of lists). Shards keep the splits they were written with, one
    caption per record. The vocabulary (``WordTokenizer``) is fitted on the training captions (the
    first ``fit_captions`` of shards) and kept in the checkpoint.

    Args:
        source: ``Captions(path, images_dir)`` (a Flickr8k-style token file or a COCO
            ``captions_*.json``) or ``CaptionShards(path)`` (written by ``attnlab-prepare --mode
            pairs``).
        img_size, in_chans: images are converted, their shorter side resized and the centre cropped.
        val_size, test_size: images held out of a captions file (shards: their own).
        batch_size, num_workers, seed: loaders.
        max_len: the most tokens of a caption, ``<bos>`` and ``<eos>`` included (longer ones are cut).
        vocab_size, min_frequency: the most words in the vocabulary (specials included), and how
            often a word must occur to be in it (the rest are ``<unk>``).
    """

    def __init__(
        self,
        source: Captions | CaptionShards,
        img_size: int = 64,
        in_chans: int = 3,
        val_size: int = 500,
        test_size: int = 500,
        batch_size: int = 64,
        max_len: int = 32,
        vocab_size: int = 10_000,
        min_frequency: int = 1,
        num_workers: int = 2,
        seed: int = 1337,
    ) -> None:
        super().__init__(
            source=source,
            img_size=img_size,
            in_chans=in_chans,
            val_size=val_size,
            batch_size=batch_size,
            max_len=max_len,
            vocab_size=vocab_size,
            num_workers=num_workers,
            seed=seed,
        )
        self.test_size, self.min_frequency = test_size, min_frequency

    def model_kwargs(self) -> dict[str, Any]:
        return {
            "vocab_size": self.tokenizer.vocab_size,
            "max_len": self.max_len,
            "pad_id": self.tokenizer.pad_id,
            "img_size": self.img_size,
            "in_chans": self.in_chans,
        }

    def artifacts(self) -> dict[str, Any]:
        return {**super().artifacts(), "max_len": self.max_len}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        corpus = self._setup_shards() if isinstance(self.source, CaptionShards) else self._setup_files()
        if self.tokenizer is None:
            self.tokenizer = WordTokenizer.fit(corpus, self.vocab_size, self.min_frequency)
        log.info(
            "%s: %d train / %d val / %d test examples, a %d-word vocabulary",
            self.source.where,
            len(self.splits["train"]) if "train" in self.splits else self.shards.count("train"),
            len(self.splits["val"]),
            len(self.splits["test"]),
            self.tokenizer.vocab_size,
        )

    def _setup_files(self) -> list[str]:
        path, images = Path(self.source.path), self.source.images_dir
        paths, captions = read_captions(path, Path(images) if images else path.parent)
        held = self.val_size + self.test_size
        if held >= len(paths):
            raise ConfigError(f"data.val_size + data.test_size ({held}): {path} has only {len(paths)} images")
        order = torch.randperm(len(paths), generator=torch.Generator().manual_seed(self.seed)).tolist()
        val, test, train = order[: self.val_size], order[self.val_size : held], order[held:]
        pairs = [(paths[i], c) for i in train for c in captions[i]]
        self.splits = {
            "train": CaptionExamples(
                [p for p, _ in pairs], [c for _, c in pairs], self.img_size, self.in_chans
            ),
            **{
                split: CaptionExamples(
                    [paths[i] for i in idx], [captions[i] for i in idx], self.img_size, self.in_chans
                )
                for split, idx in (("val", val), ("test", test))
            },
        }
        if self.mean is None:
            train_images = self.splits["train"]
            sample = torch.stack([train_images[i][0] for i in range(min(len(train_images), 512))])
            mean, std = channel_stats(sample)
            self.mean, self.std = mean, [max(s, 1e-3) for s in std]  # a blank sample: no division by 0
        return [c for _, c in pairs]

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

    def on_after_batch_transfer(self, batch: dict[str, Any], dataloader_idx: int) -> dict[str, Any]:
        return {**batch, "image": normalize(batch["image"], self.mean, self.std)}

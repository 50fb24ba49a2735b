"""Image classification from files of any size and count (an ImageFolder tree or tar shards), each
image decoded and augmented (timm's training transform) in a loader worker."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from operator import methodcaller
from pathlib import Path
from typing import Any, Literal

import torchvision.transforms.v2.functional as TF
from PIL import Image
from timm.data import create_transform
from torch import Tensor
from torch.utils.data import default_collate
from torchvision.transforms import v2

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import DropRate, PositiveInt
from attnlab.data.sampling import carve
from attnlab.data.shards.tar import BadRecords, Record, read_shard
from attnlab.data.sources import Folder, StreamedShards
from attnlab.data.vision.classification import (
    LabelledImages,
    LabelledImagesDataModule,
    timm_policy,
    transformed,
)
from attnlab.data.vision.datasets import decode_image, scan_image_folder, square
from attnlab.data.vision.shards import image_bytes

log = logging.getLogger(__name__)


def eval_transform(img_size: int, in_chans: int) -> v2.Compose:
    """PIL image -> (C, S, S) uint8: the shorter side resized to S, the centre cropped."""
    mode = "L" if in_chans == 1 else "RGB"
    return v2.Compose([methodcaller("convert", mode), TF.pil_to_tensor, partial(square, img_size=img_size)])


def train_transform(
    img_size: int, in_chans: int, scale: list[float], hflip: float, auto_augment: str | None, mean: list
) -> v2.Compose:
    """PIL image -> (C, S, S) uint8: timm's training transform (random resized crop, flip), then the
    ``auto_augment`` policy (``timm_policy``), in RGB (timm's fills are RGB means), converted after."""
    size = (3, img_size, img_size)
    primary, _, _ = create_transform(size, is_training=True, scale=tuple(scale), hflip=hflip, separate=True)
    steps = [methodcaller("convert", "RGB"), *primary.transforms]
    if auto_augment:
        rgb_mean = list(mean) * 3 if len(mean) == 1 else list(mean)
        steps.append(timm_policy("data.auto_augment", auto_augment, rgb_mean, int(img_size * 0.45)))
    return v2.Compose([*steps, methodcaller("convert", "L" if in_chans == 1 else "RGB"), TF.pil_to_tensor])


class ImageFiles(LabelledImages):
    """``LabelledImages`` decoded from files when drawn; an unreadable one is ``bad``'s (None: skipped)."""

    def __init__(
        self, files: list[Path], labels: list[int], transform: Callable, bad: BadRecords, seed: int = 0
    ) -> None:
        super().__init__(files, labels, transform, seed)
        self.bad = bad

    def load(self, i: int) -> Image.Image | None:
        try:
            return decode_image(self.images[i], str(self.images[i]), "RGB")
        except DataError as e:
            self.bad(str(e))
        return None


class ImageFilesDataModule(LabelledImagesDataModule):
    """Labelled images from a ``Folder`` or ``StreamedShards``. ``img_size``, ``in_chans``: None, the
    first val image's; ``auto_augment``: a timm policy ("rand-m9-mstd0.5", ``TRIVIAL_AUGMENT``,
    "augmix-m5-w3", "original"); ``normalize``: ``mean`` and ``std`` (None: measured on val)."""

    def __init__(
        self,
        source: Folder | StreamedShards,
        img_size: PositiveInt | None = None,
        in_chans: Literal[1, 3] | None = None,
        batch_size: PositiveInt = 128,
        scale: tuple[float, float] = (0.35, 1.0),
        hflip: DropRate = 0.5,
        auto_augment: str | None = None,
        normalize: dict[str, list[float] | None] | None = None,
        random_erasing: DropRate = 0.0,
        mixup: dict[str, float] | None = None,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
            raise ConfigError(f"data.scale must be [low, high] with 0 < low <= high <= 1, got {list(scale)}")
        super().__init__(batch_size, random_erasing, mixup, num_workers, seed)
        self.source, self.img_size, self.in_chans = source, img_size, in_chans
        self.scale, self.hflip, self.auto_augment = list(scale), hflip, auto_augment
        normalize = normalize or {}
        if normalize.get("mean") is not None and normalize.get("std") is not None:
            self.mean, self.std = normalize["mean"], normalize["std"]
        self.bad = BadRecords(source.on_bad_record)

    def collate(self, items: list[Any]) -> Any:
        """``default_collate`` of the items that could be read (skipped ones are ``None``)."""
        return default_collate([x for x in items if x is not None])

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        super().load_artifacts(artifacts)
        self.img_size, self.in_chans = artifacts["img_size"], artifacts["in_chans"]

    def build(self) -> str:
        train = self._setup_folder() if isinstance(self.source, Folder) else self._setup_shards()
        self.measure(self.splits["val"])
        self.train_transform = train_transform(
            self.img_size, self.in_chans, self.scale, self.hflip, self.auto_augment, self.mean
        )
        if train is not None:
            self.splits["train"] = ImageFiles(*train, self.train_transform, self.bad, self.seed)
        size = f"{self.img_size}x{self.img_size}"
        return f"images at {size}, {self.in_chans} channel(s), {len(self.classes)} classes"

    def _setup_folder(self) -> tuple[list[Path], list[int]]:
        """The val and test splits; returns the training files and labels."""
        found, self.classes = scan_image_folder(self.source.path)
        val, train = carve(len(found["train"][0]), [self.source.val_size], self.seed)
        pick = lambda idx: tuple([x[i] for i in idx] for x in found["train"])  # noqa: E731
        files = {**found, "train": pick(train), "val": pick(val)}
        first = files["val"][0][0]
        self._fix_size(first, str(first))
        transform = eval_transform(self.img_size, self.in_chans)
        self.splits |= {s: ImageFiles(*files[s], transform, self.bad) for s in ("val", "test") if s in files}
        return files["train"]

    def _setup_shards(self) -> None:
        """The val and test splits of the shards (training streams them: ``train_dataloader``)."""
        shards = self.open_shards("images", "classification shards (key.jpg + key.cls)")
        self.classes = shards.classes
        first = next(read_shard(shards.splits["val"][0], 0, self.bad))
        self._fix_size(image_bytes(first), f"{first['__url__']}: record {first['__key__']}")
        self.read_shards(partial(self.decode, eval_transform(self.img_size, self.in_chans)))

    def _fix_size(self, data: bytes | Path | None, where: str) -> None:
        """``img_size`` and ``in_chans`` from the first validation image where not given."""
        img = decode_image(data, where, None)
        if self.img_size is None:
            self.img_size = min(img.size)
            log.info("data.img_size: %d, the shorter side of %s", self.img_size, where)
        if self.in_chans is None:
            self.in_chans = 1 if img.mode in ("L", "LA", "I", "I;16", "1") else 3

    def decode(
        self, transform: Callable[[Image.Image], Tensor], record: Record, where: str, seed: int | None = None
    ) -> tuple[Tensor, int]:
        """A shard record -> (its image ``transform``ed, its class)."""
        if "cls" not in record:
            raise DataError(f"{where}: no class index (.cls)")
        try:
            label = int(record["cls"])
        except ValueError:
            held = record["cls"][:40].decode("utf-8", "replace").strip()
            raise DataError(f"{where}: .cls holds {held!r}, not a class index") from None
        if not 0 <= label < len(self.classes):
            raise DataError(f"{where}: class {label} outside 0..{len(self.classes) - 1}")
        return transformed(transform, decode_image(image_bytes(record), where, "RGB"), seed), label

    def decode_train(self, record: Record, where: str, seed: int | None = None) -> tuple[Tensor, int]:
        return self.decode(self.train_transform, record, where, seed)

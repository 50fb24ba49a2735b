"""Image classification from files of any size and count (an ImageFolder tree or tar shards), each
image decoded in a loader worker and augmented by timm's training transform; normalisation,
erasing and mixup run on the batch, on the device."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import DropRate, PositiveInt
from attnlab.data.base import log_splits
from attnlab.data.sampling import Key, carve, example_seed, seeded_globals
from attnlab.data.shards.tar import BadRecords, Record, ShardRecords, TarShards, read_shard, stream_loader
from attnlab.data.sources import Folder, StreamedShards
from attnlab.data.vision.classification import (
    LabelledImagesDataModule,
    make_mixup,
    sample_stats,
    timm_policy,
)
from attnlab.data.vision.datasets import scan_image_folder, square
from attnlab.data.vision.shards import decode_image, image_bytes

log = logging.getLogger(__name__)


class EvalTransform:
    """PIL image -> (C, S, S) uint8: the shorter side resized to S, the centre cropped."""

    def __init__(self, img_size: int, in_chans: int) -> None:
        self.img_size, self.mode = img_size, "L" if in_chans == 1 else "RGB"

    def __call__(self, img: Image.Image) -> Tensor:
        return square(TF.pil_to_tensor(img.convert(self.mode)), self.img_size)


class TrainTransform:
    """PIL image -> (C, S, S) uint8 through timm's training transform: random resized crop and flip,
    then ``auto_augment`` (RandAugment ``rand-...``, AugMix ``augmix-...``, AutoAugment ``original``),
    in RGB (timm's fills are RGB means), converted after; magnitude capped at 9 as ``RandAugment``."""

    def __init__(
        self,
        img_size: int,
        in_chans: int,
        scale: list[float],
        hflip: float,
        auto_augment: str | None,
        mean: list,
    ) -> None:
        from timm.data import create_transform

        primary, _, _ = create_transform(
            (3, img_size, img_size), is_training=True, scale=tuple(scale), hflip=hflip, separate=True
        )
        self.transforms = list(primary.transforms)
        if auto_augment:
            rgb_mean = list(mean) * 3 if len(mean) == 1 else list(mean)
            self.transforms.append(
                timm_policy("data.auto_augment", auto_augment, rgb_mean, int(img_size * 0.45))
            )
        self.mode = "L" if in_chans == 1 else "RGB"

    def __call__(self, img: Image.Image) -> Tensor:
        img = img.convert("RGB")
        for t in self.transforms:
            img = t(img)
        return TF.pil_to_tensor(img.convert(self.mode))


class ImageFiles(Dataset):
    """(uint8 (C, S, S) image, label) decoded from files when drawn, the transform seeded by the
    ``(epoch, index)`` key; an unreadable file is ``bad``'s to refuse or skip (``None``)."""

    def __init__(
        self, files: list[Path], labels: list[int], transform: Callable, bad: BadRecords, seed: int = 0
    ) -> None:
        self.files, self.labels, self.transform, self.bad, self.seed = files, labels, transform, bad, seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: int | Key) -> tuple[Tensor, int] | None:
        i = key if isinstance(key, int) else key[1]
        try:
            data = self.files[i].read_bytes()
            img = decode_image(data, str(self.files[i]), "RGB")
        except OSError as e:
            self.bad(f"{self.files[i]}: not readable ({e})")
            return None
        except DataError as e:
            self.bad(str(e))
            return None
        seed = example_seed(self.seed, key)
        with seeded_globals(seed) if seed is not None else nullcontext():
            return self.transform(img), self.labels[i]


def collate_readable(items: list[Any]) -> Any:
    """``default_collate`` of the items that could be read (skipped ones are ``None``)."""
    return default_collate([x for x in items if x is not None])


class ImageFilesDataModule(LabelledImagesDataModule):
    """Labelled images of any size and count from a ``Folder`` or ``StreamedShards``, decoded in the
    loader workers. ``img_size``, ``in_chans``: None, the first val image's; ``scale``, ``hflip``:
    timm's random resized crop and flip; ``auto_augment``: a timm policy ("rand-m9-mstd0.5",
    ``TRIVIAL_AUGMENT``, "augmix-m5-w3", "original"); ``normalize``: ``mean`` and ``std`` (None:
    measured on the val images)."""

    collate = staticmethod(collate_readable)

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
        mean, std = (normalize or {}).get("mean"), (normalize or {}).get("std")
        if mean is not None and std is not None:
            self.mean, self.std = mean, std
        self.bad = BadRecords(source.on_bad_record)
        self.shards: TarShards | None = None

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """The checkpoint's image size, channels and normalisation."""
        self.mean, self.std = artifacts["mean"], artifacts["std"]
        self.img_size, self.in_chans = artifacts["img_size"], artifacts["in_chans"]

    # --- loading ---------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        train = self._setup_folder() if isinstance(self.source, Folder) else self._setup_shards()
        if "test" not in self.splits:
            log.warning("%s has no test split: the test stage scores the validation split", self.source.where)
            self.splits["test"] = self.splits["val"]
        if self.mean is None:
            self.mean, self.std = sample_stats(self.splits["val"])
        self.train_transform = TrainTransform(
            self.img_size, self.in_chans, self.scale, self.hflip, self.auto_augment, self.mean
        )
        if train is not None:
            self.splits["train"] = ImageFiles(*train, self.train_transform, self.bad, self.seed)
        self.mixup = make_mixup(self.mixup_args, len(self.classes))
        n_train = len(self.splits["train"]) if train is not None else self.shards.count("train")
        size, classes = f"{self.img_size}x{self.img_size}", len(self.classes)
        what = f"images at {size}, {self.in_chans} channel(s), {classes} classes"
        log_splits(self.source.where, (n_train, len(self.splits["val"]), len(self.splits["test"])), what)

    def _setup_folder(self) -> tuple[list[Path], list[int]]:
        """The val and test splits of the folder; returns the training files and labels."""
        found, self.classes = scan_image_folder(self.source.path)
        val, train = carve(len(found["train"][0]), [self.source.val_size], self.seed)
        pick = lambda idx: tuple([x[i] for i in idx] for x in found["train"])  # noqa: E731
        files = {"train": pick(train), "val": pick(val), **{k: v for k, v in found.items() if k != "train"}}
        first = files["val"][0][0]
        self._fix_size(first.read_bytes(), str(first))
        for split in ("val", "test"):
            if split in files:
                self.splits[split] = ImageFiles(*files[split], self._eval_transform(), self.bad)
        return files["train"]

    def _setup_shards(self) -> None:
        """The val and test splits of the shards (training streams them: ``train_dataloader``)."""
        self.shards = TarShards(self.source.path)
        if self.shards.kind != "images" or not self.shards.classes:
            raise DataError(
                f"{self.source.path}: not classification shards (key.jpg + key.cls); see its manifest"
            )
        self.classes = self.shards.classes
        if not self.shards.count("val"):
            raise DataError(f"{self.source.path}: no validation records (prepare with --val-size > 0)")
        first = next(read_shard(self.shards.splits["val"][0], 0, self.bad))
        self._fix_size(image_bytes(first), f"{first['__url__']}: record {first['__key__']}")
        for split in ("val", "test"):
            if self.shards.count(split):
                decode = self._decode(self._eval_transform())
                self.splits[split] = ShardRecords(self.shards.splits[split], decode, self.bad)

    def _fix_size(self, data: bytes | None, where: str) -> None:
        """``img_size`` and ``in_chans`` from the first validation image where not given."""
        img = decode_image(data, where, None)
        if self.img_size is None:
            self.img_size = min(img.size)
            log.info("data.img_size: %d, the shorter side of %s", self.img_size, where)
        if self.in_chans is None:
            self.in_chans = 1 if img.mode in ("L", "LA", "I", "I;16", "1") else 3

    def _eval_transform(self) -> EvalTransform:
        return EvalTransform(self.img_size, self.in_chans)

    def _decode(self, transform: Callable[[Image.Image], Tensor]) -> Callable[[Record, str], Any]:
        classes = len(self.classes)

        def decode(record: Record, where: str, seed: int | None = None) -> tuple[Tensor, int]:
            if "cls" not in record:
                raise DataError(f"{where}: no class index (.cls)")
            try:
                label = int(record["cls"])
            except ValueError:
                held = record["cls"][:40].decode("utf-8", "replace").strip()
                raise DataError(f"{where}: .cls holds {held!r}, not a class index") from None
            if not 0 <= label < classes:
                raise DataError(f"{where}: class {label} outside 0..{classes - 1}")
            img = decode_image(image_bytes(record), where, "RGB")
            with seeded_globals(seed) if seed is not None else nullcontext():
                return transform(img), label

        return decode

    def train_dataloader(self) -> DataLoader:
        if isinstance(self.source, Folder):
            return super().train_dataloader()
        return stream_loader(
            self, self.shards.splits["train"], self._decode(self.train_transform), self.collate
        )

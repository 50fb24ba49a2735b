"""Image classification from files of any size and count: an ImageFolder tree (paths only held in
memory) or tar shards (``attnlab.data.shards.tar``), each image decoded when a loader worker
draws it and augmented by timm's training transform (random resized crop, flip, AutoAugment /
RandAugment / TrivialAugment); normalisation, random erasing and mixup/cutmix run on whole batches
on the device, as ``ImageClassificationDataModule`` does for the in-memory sets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image
from timm.data import Mixup
from timm.data.random_erasing import RandomErasing
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import DropRate, PositiveInt
from attnlab.data.base import DataModule
from attnlab.data.sampling import Key, example_seed, seeded_globals
from attnlab.data.shards.tar import (
    BadRecords,
    Record,
    ShardRecords,
    ShardStream,
    TarShards,
    read_shard,
    stream_loader,
)
from attnlab.data.sources import Folder, StreamedShards
from attnlab.data.vision.classification import channel_stats, image_loader, make_mixup, mixup_args, normalize
from attnlab.data.vision.datasets import scan_image_folder
from attnlab.data.vision.shards import decode_image, image_bytes

log = logging.getLogger(__name__)


def carve(files: list[Path], labels: list[int], val_size: int, seed: int) -> dict[str, tuple[list, list]]:
    """A seeded validation split of ``val_size`` files out of a training split."""
    if val_size >= len(files):
        raise ConfigError(
            f"data.source.val_size ({val_size}) must be smaller than the training split ({len(files)} images)"
        )
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    pick = lambda idx: ([files[i] for i in idx], [labels[i] for i in idx])  # noqa: E731
    return {"train": pick(order[val_size:]), "val": pick(order[:val_size])}


class EvalTransform:
    """PIL image -> (C, S, S) uint8: the shorter side resized to S, the centre cropped."""

    def __init__(self, img_size: int, in_chans: int) -> None:
        self.img_size, self.mode = img_size, "L" if in_chans == 1 else "RGB"

    def __call__(self, img: Image.Image) -> Tensor:
        image = TF.pil_to_tensor(img.convert(self.mode))
        image = TF.resize(image, self.img_size, antialias=True)
        return TF.center_crop(image, [self.img_size, self.img_size])


# TrivialAugment (Müller & Hutter, 2021) in timm's RandAugment terms: one op per image, always
# applied, its magnitude drawn uniformly (mstd > 100), severity increasing with magnitude
TRIVIAL_AUGMENT = "rand-n1-m9-mstd101-p1-inc1"


class TrainTransform:
    """PIL image -> (C, S, S) uint8 through timm's training transform (``create_transform``'s
    random resized crop and flip, then ``auto_augment``: RandAugment ``rand-...``, AugMix
    ``augmix-...`` or AutoAugment ``original``/``v0``, built as ``create_transform`` builds them);
    normalisation and erasing run later, on the batch. Augmented in RGB (timm's policies fill with
    an RGB mean), converted after. RandAugment's magnitude is capped at 9 (``RandAugment`` in
    classification.py says why)."""

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
        from timm.data.auto_augment import (
            augment_and_mix_transform,
            auto_augment_transform,
            rand_augment_transform,
        )

        primary, _, _ = create_transform(
            (3, img_size, img_size), is_training=True, scale=tuple(scale), hflip=hflip, separate=True
        )
        self.transforms = list(primary.transforms)
        if auto_augment:
            rgb_mean = tuple(mean) * 3 if len(mean) == 1 else tuple(mean)
            hparams = {
                "translate_const": int(img_size * 0.45),
                "img_mean": tuple(round(255 * m) for m in rgb_mean),
                "magnitude_max": 9,
            }
            make = auto_augment_transform
            if auto_augment.startswith("rand"):
                make = rand_augment_transform
            elif auto_augment.startswith("augmix"):
                make = augment_and_mix_transform
            try:
                self.transforms.append(make(auto_augment, hparams))
            except (AssertionError, ValueError, KeyError, IndexError) as e:
                raise ConfigError(
                    f"data.auto_augment={auto_augment!r} is not a timm policy (e.g. 'rand-m9-mstd0.5', "
                    f"TrivialAugment '{TRIVIAL_AUGMENT}', 'original'): {e}"
                ) from e
        self.mode = "L" if in_chans == 1 else "RGB"

    def __call__(self, img: Image.Image) -> Tensor:
        img = img.convert("RGB")
        for t in self.transforms:
            img = t(img)
        return TF.pil_to_tensor(img.convert(self.mode))


class ImageFiles(Dataset):
    """(uint8 (C, S, S) image, label) pairs decoded from files when drawn; a training draw's
    random transform is seeded by the sampler's ``(epoch, index)`` key. An unreadable file is
    ``bad``'s to refuse or skip (``None``: the batch leaves it out)."""

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


class ImageFilesDataModule(DataModule):
    """Labelled images of any size and count, decoded lazily in the loader workers.

    Validation and test are exact under any number of ranks.

    Args:
        source: ``Folder(path)`` (``path/train/<class>/<image>``, optional ``path/test/...``; a
            seeded validation split of its ``val_size`` images carved from train, the training
            order ``ResumableSampler``'s) or ``StreamedShards(path)`` (tar shards written by
            ``attnlab-prepare --mode images``, with their own val and test splits; training
            streams them, ``ShardStream``).
        img_size: the side of the (square) images the model sees; ``None``: the shorter side of
            the first validation image.
        in_chans: 1 (grayscale) or 3 (RGB); ``None``: from the first validation image.
        batch_size: images per batch (per rank).
        scale: the area range of timm's random resized crop.
        hflip: probability of a horizontal flip.
        auto_augment: a timm policy: "rand-m9-mstd0.5" (RandAugment), TrivialAugment
            (``TRIVIAL_AUGMENT``), "augmix-m5-w3", "original" (AutoAugment), or ``None``.
        normalize: per-channel ``mean`` and ``std``; ``None`` (either): measured on the
            validation images.
        random_erasing, mixup: as ``ImageClassificationDataModule`` (per batch, on the device).
        num_workers: loader workers (each decodes; the shards' training stream gives each a lane).
        seed: of the validation split, the training order and the augmentation.
    """

    def __init__(
        self,
        source: Folder | StreamedShards,
        img_size: PositiveInt | None = None,
        in_chans: int | None = None,
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
        super().__init__()
        if in_chans not in (None, 1, 3):
            raise ConfigError(f"data.in_chans must be 1, 3 or null, got {in_chans!r}")
        if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
            raise ConfigError(f"data.scale must be [low, high] with 0 < low <= high <= 1, got {list(scale)}")
        self.mixup_args = mixup_args(mixup, batch_size)
        self.source = source
        self.img_size, self.in_chans, self.batch_size = img_size, in_chans, batch_size
        self.scale, self.hflip, self.auto_augment = list(scale), hflip, auto_augment
        self.mean, self.std = (normalize or {}).get("mean"), (normalize or {}).get("std")
        if self.mean is None or self.std is None:
            self.mean = self.std = None
        self.random_erasing, self.num_workers, self.seed = random_erasing, num_workers, seed
        self.bad = BadRecords(source.on_bad_record)
        self.classes: list[str] | None = None
        self.splits: dict[str, Dataset] = {}
        self.shards: TarShards | None = None
        self.mixup: Mixup | None = None

    # --- what the model and inference need -------------------------------------------------

    def model_kwargs(self) -> dict[str, int]:
        return {"num_classes": len(self.classes), "img_size": self.img_size, "in_chans": self.in_chans}

    def artifacts(self) -> dict[str, Any]:
        return {
            "classes": self.classes,
            "img_size": self.img_size,
            "in_chans": self.in_chans,
            "mean": self.mean,
            "std": self.std,
        }

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """The checkpoint's image size, channels and normalisation (resuming and evaluating see the
        same inputs)."""
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
            val = self.splits["val"]
            sample = collate_readable([val[i] for i in range(min(512, len(val)))])
            mean, std = channel_stats(sample[0])
            self.mean, self.std = mean, [max(s, 1e-3) for s in std]  # a blank sample: no division by 0
        self.train_transform = TrainTransform(
            self.img_size, self.in_chans, self.scale, self.hflip, self.auto_augment, self.mean
        )
        if train is not None:
            self.splits["train"] = ImageFiles(*train, self.train_transform, self.bad, self.seed)
        self.mixup = make_mixup(self.mixup_args, len(self.classes))
        log.info(
            "%s: %d train / %d val / %d test images at %dx%d, %d channel(s), %d classes",
            self.source.where,
            len(self.splits["train"]) if train is not None else self.shards.count("train"),
            len(self.splits["val"]),
            len(self.splits["test"]),
            self.img_size,
            self.img_size,
            self.in_chans,
            len(self.classes),
        )

    def _setup_folder(self) -> tuple[list[Path], list[int]]:
        """The val and test splits of the folder; returns the training files and labels."""
        found, self.classes = scan_image_folder(self.source.path)
        files = {**carve(*found["train"], self.source.val_size, self.seed), **found}
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

    # --- batches ---------------------------------------------------------------------------

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> float, standardised per channel."""
        return normalize(images, self.mean, self.std)

    def on_after_batch_transfer(
        self, batch: tuple[Tensor, Tensor], dataloader_idx: int
    ) -> tuple[Tensor, Tensor]:
        images, labels = batch
        x = self.normalize(images)
        if self.trainer is not None and self.trainer.training:
            if self.random_erasing:
                x = RandomErasing(self.random_erasing, mode="pixel", device=x.device)(x)
            if self.mixup is not None:
                if len(x) % 2:  # a skipped record left an odd batch: mixup mixes pairs
                    x, labels = x[:-1], labels[:-1]
                x, labels = self.mixup(x, labels)  # labels become (B, num_classes) mixtures
        return x, labels

    def train_dataloader(self) -> DataLoader:
        if isinstance(self.source, Folder):
            sampler = self.train_sampler(len(self.splits["train"]), self.batch_size, self.seed)
            return image_loader(
                self.splits["train"], self.batch_size, self.num_workers, sampler, collate_readable
            )
        rank, world = self.rank_world()
        stream = ShardStream(
            self.shards.splits["train"],
            self.batch_size,
            self._decode(self.train_transform),
            collate_readable,
            self.seed,
            lanes=self.num_workers,
            rank=rank,
            world=world,
            shuffle_batches=self.source.shuffle_batches,
            on_bad_record=self.bad.policy,
        )
        stream.start = self.train_batches_consumed
        return stream_loader(stream, self.num_workers, self.seed)

    def val_dataloader(self) -> DataLoader:
        return self.eval_loader(
            self.splits["val"], self.batch_size, "val", collate_readable, self.num_workers
        )

    def test_dataloader(self) -> DataLoader:
        return self.eval_loader(
            self.splits["test"], self.batch_size, "test", collate_readable, self.num_workers
        )

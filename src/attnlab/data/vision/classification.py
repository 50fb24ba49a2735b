"""Image classification data: images decoded once into uint8 tensors, a seeded validation split
carved from the training set, timm's augmentation per image and mixup/cutmix per batch."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image
from timm.data import Mixup
from timm.data.auto_augment import rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from attnlab.core.errors import ConfigError
from attnlab.core.specs import DropRate, PositiveInt
from attnlab.data.base import DataModule
from attnlab.data.sampling import Key, ResumableSampler, example_seed, seeded_globals
from attnlab.data.sources import Builtin
from attnlab.data.vision.datasets import ImageSplits, load_cifar10, load_idx_dataset

log = logging.getLogger(__name__)

DATASETS = ("mnist", "fashion_mnist", "cifar10")
# timm's Mixup per batch (``data.mixup``): both alphas 0 turn it off
NO_MIXUP = {"mixup_alpha": 0.0, "cutmix_alpha": 0.0, "prob": 1.0, "switch_prob": 0.5}


def mixup_args(mixup: dict[str, float] | None, batch_size: int) -> dict[str, float]:
    """``data.mixup`` as timm's ``Mixup`` arguments, checked (``None``: off)."""
    args = {**NO_MIXUP, **(mixup or {})}
    if set(args) != set(NO_MIXUP):
        raise ConfigError(f"data.mixup takes {', '.join(NO_MIXUP)}, got {', '.join(mixup)}")
    if args["mixup_alpha"] < 0 or args["cutmix_alpha"] < 0 or not 0 <= args["prob"] <= 1:
        raise ConfigError(
            "data.mixup.mixup_alpha and data.mixup.cutmix_alpha must be >= 0 and data.mixup.prob in "
            f"[0, 1], got {args['mixup_alpha']}, {args['cutmix_alpha']}, {args['prob']}"
        )
    if (args["mixup_alpha"] or args["cutmix_alpha"]) and batch_size % 2:
        raise ConfigError(
            f"data.batch_size must be even with mixup/cutmix (pairs are mixed), got {batch_size}"
        )
    return args


def make_mixup(args: dict[str, float], num_classes: int) -> Mixup | None:
    on = args["mixup_alpha"] or args["cutmix_alpha"]
    return Mixup(**args, label_smoothing=0.0, num_classes=num_classes) if on else None


class RandAugment:
    """timm's RandAugment (``rand-m9-mstd0.5-inc1``, ...) on a (C, H, W) uint8 tensor."""

    def __init__(self, config: str, mean: list[float]) -> None:
        # magnitude_max 9: at magnitude 10 timm's increasing posterize keeps 0 bits, which Pillow refuses
        hparams = {"img_mean": tuple(round(255 * m) for m in mean), "magnitude_max": 9}
        try:
            self.transform = rand_augment_transform(config, hparams)
        except (AssertionError, ValueError, KeyError, IndexError) as e:
            raise ConfigError(
                f"data.rand_augment={config!r} is not a timm RandAugment string "
                f"(e.g. 'rand-m9-mstd0.5-inc1'): {e}"
            ) from e

    def __call__(self, x: Tensor) -> Tensor:
        array = x.permute(1, 2, 0).numpy()
        img = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
        out = np.asarray(self.transform(img))
        return torch.from_numpy(out.copy()).reshape(x.shape[1], x.shape[2], -1).permute(2, 0, 1)


def channel_stats(images: Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 (N, C, H, W) images scaled to [0, 1]."""
    pixels = images.float().div_(255).transpose(0, 1).flatten(1)  # (C, N * H * W)
    return pixels.mean(1).tolist(), pixels.std(1).tolist()


def normalize(images: Tensor, mean: list[float], std: list[float]) -> Tensor:
    """uint8 (B, C, H, W) -> float, standardised per channel."""
    m = torch.tensor(mean, device=images.device)[:, None, None]
    s = torch.tensor(std, device=images.device)[:, None, None]
    return (images.float() / 255 - m) / s


def image_loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    sampler: ResumableSampler,
    collate_fn: Any = None,
) -> DataLoader:
    """Training batches of a split in ``sampler``'s order, the last partial batch dropped. The
    loader's own generator seeds its workers, so starting one draws nothing from the global
    generator (which a resumed run restores). Evaluation splits: ``DataModule.eval_loader``."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(sampler.seed),
        collate_fn=collate_fn,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


def random_crop_flip(images: Tensor, padding: int, flip: float) -> Tensor:
    """A random ``padding``-pixel shift (a crop of the zero-padded image) and a horizontal flip
    with probability ``flip``, each drawn per image, done on the whole (B, C, H, W) batch at once
    (per image through torchvision it took ~15% of a small ViT's training step)."""
    b, _, h, w = images.shape
    if padding:
        padded = torch.nn.functional.pad(images, (padding,) * 4)
        dy, dx = (torch.randint(0, 2 * padding + 1, (b, 1), device=images.device) for _ in range(2))
        rows = dy + torch.arange(h, device=images.device)  # (B, H)
        cols = dx + torch.arange(w, device=images.device)  # (B, W)
        batch = torch.arange(b, device=images.device)[:, None, None]
        images = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    if flip:
        flipped = torch.rand(b, device=images.device) < flip
        images = torch.where(flipped[:, None, None, None], images.flip(-1), images)
    return images


class LabelledImages(Dataset):
    """(uint8 (C, H, W) image, label) pairs from tensors, with an optional per-image transform,
    whose random draws are seeded by the sampler's ``(epoch, index)`` key (``seed``: the run's)."""

    def __init__(self, images: Tensor, labels: Tensor, transform: Any = None, seed: int = 0) -> None:
        self.images, self.labels, self.transform, self.seed = images, labels, transform, seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: int | Key) -> tuple[Tensor, Tensor]:
        i = key if isinstance(key, int) else key[1]
        x = self.images[i]
        if self.transform is None:
            return x, self.labels[i]
        seed = example_seed(self.seed, key)
        with seeded_globals(seed) if seed is not None else nullcontext():
            return self.transform(x), self.labels[i]


class ImageClassificationDataModule(DataModule):
    """Labelled images for classification.

    Images are kept as uint8 tensors; RandAugment runs per image in the loader; random crops and
    flips, per-channel normalisation (the training split's mean and std), random erasing and
    mixup/cutmix run on whole batches after they reach the device.

    Args:
        source: ``Builtin("mnist" | "fashion_mnist")`` (the IDX files; its ``url`` a base URL
            to download them from) or ``Builtin("cifar10")`` (torchvision). (An image folder:
            ``ImageFilesDataModule``, which reads any size and count.)
        img_size: resize images to this side once, at setup; ``None`` keeps the native size.
        val_size: images carved (seeded) out of the training split to validate and select on.
        batch_size: images per batch.
        crop_padding: random crop after padding by this many pixels (0: none).
        hflip: probability of a horizontal flip (0 for digits).
        rand_augment: a timm RandAugment string, e.g. "rand-m9-mstd0.5-inc1", or ``None``.
        random_erasing: probability of timm's random erasing per image.
        mixup: timm's ``Mixup`` arguments (``mixup_alpha``, ``cutmix_alpha``, ``prob`` of mixing a
            batch, ``switch_prob`` of cutmix instead); ``None`` or both alphas 0: off.
        num_workers: DataLoader workers.
        seed: of the validation split and the shuffling.
    """

    def __init__(
        self,
        source: Builtin | None = None,
        img_size: PositiveInt | None = None,
        val_size: PositiveInt = 5000,
        batch_size: PositiveInt = 128,
        crop_padding: int = 0,
        hflip: DropRate = 0.0,
        rand_augment: str | None = None,
        random_erasing: DropRate = 0.0,
        mixup: dict[str, float] | None = None,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        source = source or Builtin("fashion_mnist")
        if source.name not in DATASETS:
            raise ConfigError(
                f"data.source.name must be one of {', '.join(map(repr, DATASETS))}, got {source.name!r}"
            )
        if crop_padding < 0:
            raise ConfigError(f"data.crop_padding must be >= 0, got {crop_padding}")
        self.mixup_args = mixup_args(mixup, batch_size)
        self.source = source
        self.img_size, self.val_size, self.batch_size = img_size, val_size, batch_size
        self.crop_padding, self.hflip, self.rand_augment = crop_padding, hflip, rand_augment
        self.random_erasing = random_erasing
        self.num_workers, self.seed = num_workers, seed
        self.classes: list[str] | None = None
        self.mean: list[float] | None = None
        self.std: list[float] | None = None
        self.splits: dict[str, LabelledImages] = {}
        self.mixup: Mixup | None = None

    # --- what the model and inference need -------------------------------------------------

    @property
    def in_chans(self) -> int:
        return self.splits["train"].images.size(1)

    @property
    def size(self) -> int:
        return self.splits["train"].images.size(-1)

    def model_kwargs(self) -> dict[str, int]:
        return {"num_classes": len(self.classes), "img_size": self.size, "in_chans": self.in_chans}

    def artifacts(self) -> dict[str, Any]:
        return {
            "classes": self.classes,
            "img_size": self.size,
            "in_chans": self.in_chans,
            "mean": self.mean,
            "std": self.std,
        }

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """Keep the checkpoint's normalisation (resuming and evaluating see the same inputs)."""
        self.mean, self.std = artifacts["mean"], artifacts["std"]

    # --- loading ---------------------------------------------------------------------------

    def _load(self) -> ImageSplits:
        src = self.source
        if src.name == "cifar10":
            return load_cifar10(src.data_dir, src.cache_dir)
        return load_idx_dataset(src.name, src.data_dir, src.cache_dir, src.url)

    def prepare_data(self) -> None:
        if self.source.data_dir is None:  # download once, on one process
            self._load()

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        data = self._load()
        images, labels = self._resize(data.train_images), data.train_labels
        if self.val_size >= len(labels):
            raise ConfigError(
                f"data.val_size ({self.val_size}) must be smaller than the training split "
                f"({len(labels)} images)"
            )
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        val, train = order[: self.val_size], order[self.val_size :]
        self.classes = data.classes
        if self.mean is None:
            self.mean, self.std = channel_stats(images[train])
        self.splits["train"] = LabelledImages(images[train], labels[train])
        self.splits["train"].transform, self.splits["train"].seed = self._train_transform(), self.seed
        self.splits["val"] = LabelledImages(images[val], labels[val])
        if data.test_images is not None:
            self.splits["test"] = LabelledImages(self._resize(data.test_images), data.test_labels)
        else:
            log.warning("%s has no test split: the test stage scores the validation split", self.source.where)
            self.splits["test"] = self.splits["val"]
        self.mixup = make_mixup(self.mixup_args, len(self.classes))
        log.info(
            "%s: %d train / %d val / %d test images of %s, %d classes",
            self.source.where,
            len(train),
            len(val),
            len(self.splits["test"]),
            tuple(images.shape[1:]),
            len(self.classes),
        )

    def _resize(self, images: Tensor) -> Tensor:
        if self.img_size is None or images.shape[-1] == images.shape[-2] == self.img_size:
            return images
        return TF.resize(images, [self.img_size, self.img_size], antialias=True)

    def _train_transform(self) -> Any:
        return RandAugment(self.rand_augment, self.mean) if self.rand_augment else None

    # --- batches ---------------------------------------------------------------------------

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> float, standardised per channel with the training statistics."""
        return normalize(images, self.mean, self.std)

    def on_after_batch_transfer(
        self, batch: tuple[Tensor, Tensor], dataloader_idx: int
    ) -> tuple[Tensor, Tensor]:
        images, labels = batch
        training = self.trainer is not None and self.trainer.training
        if training and (self.crop_padding or self.hflip):
            images = random_crop_flip(images, self.crop_padding, self.hflip)
        x = self.normalize(images)
        if training:
            if self.random_erasing:  # in place, per image; fills with noise made on the batch's device
                x = RandomErasing(self.random_erasing, mode="pixel", device=x.device)(x)
            if self.mixup is not None:
                x, labels = self.mixup(x, labels)  # labels become (B, num_classes) mixtures
        return x, labels

    def train_dataloader(self) -> DataLoader:
        sampler = self.train_sampler(len(self.splits["train"]), self.batch_size, self.seed)
        return image_loader(self.splits["train"], self.batch_size, self.num_workers, sampler)

    def val_dataloader(self) -> DataLoader:
        return self.eval_loader(self.splits["val"], self.batch_size, "val", num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.eval_loader(self.splits["test"], self.batch_size, "test", num_workers=self.num_workers)

"""Image classification data: images decoded once into uint8 tensors, a seeded validation split
carved from the training set, timm's augmentation per image and mixup/cutmix per batch."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image
from timm.data import Mixup
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torch import Tensor
from torch.utils.data import Dataset

from attnlab.core.errors import ConfigError
from attnlab.core.specs import DropRate, NonNegativeInt, PositiveInt
from attnlab.data.base import SplitsDataModule, log_splits
from attnlab.data.sampling import Key, carve, example_seed, seeded_globals
from attnlab.data.sources import Builtin
from attnlab.data.vision.datasets import BuiltinImages, ImageSplits

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


# TrivialAugment (Müller & Hutter, 2021) in timm's RandAugment terms: one op per image, always
# applied, its magnitude drawn uniformly (mstd > 100), severity increasing with magnitude
TRIVIAL_AUGMENT = "rand-n1-m9-mstd101-p1-inc1"


def timm_policy(key: str, policy: str, mean: list[float], translate: int | None = None) -> Any:
    """timm's ``rand-...`` (RandAugment), ``augmix-...`` or AutoAugment (``original``, ``v0``) on PIL
    images (``translate``: pixels of a full-magnitude shift); refused in one line naming ``key``."""
    # magnitude_max 9: at magnitude 10 timm's increasing posterize keeps 0 bits, which Pillow refuses
    hparams = {"img_mean": tuple(round(255 * m) for m in mean), "magnitude_max": 9}
    if translate is not None:
        hparams["translate_const"] = translate
    make = auto_augment_transform
    if policy.startswith("rand"):
        make = rand_augment_transform
    elif policy.startswith("augmix"):
        make = augment_and_mix_transform
    try:
        return make(policy, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as e:
        raise ConfigError(
            f"{key}={policy!r} is not a timm policy (e.g. 'rand-m9-mstd0.5-inc1', TrivialAugment "
            f"'{TRIVIAL_AUGMENT}', 'original'): {e}"
        ) from e


class RandAugment:
    """A timm policy (``timm_policy``) on a (C, H, W) uint8 tensor."""

    def __init__(self, config: str, mean: list[float]) -> None:
        self.transform = timm_policy("data.rand_augment", config, mean)

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


def sample_stats(split: Dataset, n: int = 512) -> tuple[list[float], list[float]]:
    """``channel_stats`` of a split's first ``n`` readable images; a std of at least 1e-3 (a blank
    sample divides by nothing)."""
    items = [x for x in (split[i] for i in range(min(n, len(split)))) if x is not None]
    mean, std = channel_stats(torch.stack([x[0] for x in items]))
    return mean, [max(s, 1e-3) for s in std]


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


def erase_and_mix(x: Tensor, labels: Tensor, erasing: float, mixup: Mixup | None) -> tuple[Tensor, Tensor]:
    """A normalised training batch, on its device: timm's random erasing per image (noise made
    there), then mixup/cutmix (labels become (B, num_classes) mixtures; pairs are mixed, so an odd
    batch left by a skipped record loses its last image)."""
    if erasing:
        x = RandomErasing(erasing, mode="pixel", device=x.device)(x)
    if mixup is not None:
        if len(x) % 2:
            x, labels = x[:-1], labels[:-1]
        x, labels = mixup(x, labels)
    return x, labels


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


class LabelledImagesDataModule(SplitsDataModule):
    """What the image classification DataModules share: ``classes``, ``img_size``, ``in_chans`` and
    the normalisation (``mean``, ``std``), which travel in the checkpoint; on the training batch,
    on its device, ``augment``, then normalisation, random erasing and mixup."""

    img_size: int | None
    in_chans: int | None

    def __init__(
        self, batch_size: int, random_erasing: float, mixup: dict | None, num_workers: int, seed: int
    ) -> None:
        super().__init__()
        self.mixup_args = mixup_args(mixup, batch_size)
        self.batch_size, self.random_erasing = batch_size, random_erasing
        self.num_workers, self.seed = num_workers, seed
        self.classes: list[str] | None = None
        self.mean: list[float] | None = None
        self.std: list[float] | None = None
        self.splits: dict[str, Dataset] = {}
        self.mixup: Mixup | None = None

    def augment(self, images: Tensor) -> Tensor:
        return images

    def on_after_batch_transfer(
        self, batch: tuple[Tensor, Tensor], dataloader_idx: int
    ) -> tuple[Tensor, Tensor]:
        images, labels = batch
        training = self.trainer is not None and self.trainer.training
        x = self.normalize(self.augment(images) if training else images)
        return erase_and_mix(x, labels, self.random_erasing, self.mixup) if training else (x, labels)

    def model_kwargs(self) -> dict[str, int]:
        return {"num_classes": len(self.classes), "img_size": self.img_size, "in_chans": self.in_chans}

    def artifacts(self) -> dict[str, Any]:
        keys = ("classes", "img_size", "in_chans", "mean", "std")
        return {k: getattr(self, k) for k in keys}

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> float, standardised per channel."""
        return normalize(images, self.mean, self.std)


class ImageClassificationDataModule(BuiltinImages, LabelledImagesDataModule):
    """A ``Builtin`` set (its ``val_size`` carved) held as uint8 tensors, resized once to ``img_size``
    (None: native): timm's ``rand_augment`` per image in the loader; a random crop of the image
    padded by ``crop_padding`` and a flip (``hflip``), normalisation (the training split's
    statistics), ``random_erasing`` and ``mixup`` (timm's ``Mixup`` arguments) on the device."""

    def __init__(
        self,
        source: Builtin | None = None,
        img_size: PositiveInt | None = None,
        batch_size: PositiveInt = 128,
        crop_padding: NonNegativeInt = 0,
        hflip: DropRate = 0.0,
        rand_augment: str | None = None,
        random_erasing: DropRate = 0.0,
        mixup: dict[str, float] | None = None,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        source = (source or Builtin("fashion_mnist", val_size=5000)).one_of(DATASETS)
        super().__init__(batch_size, random_erasing, mixup, num_workers, seed)
        self.source, self.val_size = source, source.size("val")
        self.img_size, self.in_chans = img_size, None
        self.crop_padding, self.hflip, self.rand_augment = crop_padding, hflip, rand_augment

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """Keep the checkpoint's normalisation (resuming and evaluating see the same inputs)."""
        self.mean, self.std = artifacts["mean"], artifacts["std"]

    # --- loading ---------------------------------------------------------------------------

    def build(self, data: ImageSplits) -> None:
        images, labels = self._resize(data.train_images), data.train_labels
        val, train = carve(len(labels), [self.val_size], self.seed)
        self.classes = data.classes
        if self.mean is None:
            self.mean, self.std = channel_stats(images[train])
        augment = RandAugment(self.rand_augment, self.mean) if self.rand_augment else None
        self.splits["train"] = LabelledImages(images[train], labels[train], augment, self.seed)
        self.splits["val"] = LabelledImages(images[val], labels[val])
        self.splits["test"] = LabelledImages(self._resize(data.test_images), data.test_labels)
        self.img_size, self.in_chans = images.size(-1), images.size(1)  # as resized
        self.mixup = make_mixup(self.mixup_args, len(self.classes))
        what = f"images of {tuple(images.shape[1:])}, {len(self.classes)} classes"
        log_splits(self.source.where, (len(train), len(val), len(self.splits["test"])), what)

    def _resize(self, images: Tensor) -> Tensor:
        if self.img_size is None or images.shape[-1] == images.shape[-2] == self.img_size:
            return images
        return TF.resize(images, [self.img_size, self.img_size], antialias=True)

    def augment(self, images: Tensor) -> Tensor:
        if self.crop_padding or self.hflip:
            return random_crop_flip(images, self.crop_padding, self.hflip)
        return images

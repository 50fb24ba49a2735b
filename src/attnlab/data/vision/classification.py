"""Image classification data held as uint8 tensors: timm's augmentation per image, mixup/cutmix
per batch; the base of the image DataModules."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from timm.data import Mixup
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.specs import DropRate, NonNegativeInt, PositiveInt
from attnlab.data.base import SplitsDataModule, log_splits
from attnlab.data.sampling import Key, carve, example_seed, seeded_globals
from attnlab.data.shards.tar import BadRecords, Record, ShardRecords, TarShards, stream_loader
from attnlab.data.sources import Builtin
from attnlab.data.vision.datasets import load_builtin

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
    kinds = {"rand": rand_augment_transform, "augmix": augment_and_mix_transform}
    make = next((f for prefix, f in kinds.items() if policy.startswith(prefix)), auto_augment_transform)
    try:
        return make(policy, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as e:
        raise ConfigError(
            f"{key}={policy!r} is not a timm policy (e.g. 'rand-m9-mstd0.5-inc1', TrivialAugment "
            f"'{TRIVIAL_AUGMENT}', 'original'): {e}"
        ) from e


def normalize(images: Tensor, mean: list[float], std: list[float]) -> Tensor:
    """uint8 (B, C, H, W) -> float, standardised per channel."""
    m = torch.tensor(mean, device=images.device)[:, None, None]
    s = torch.tensor(std, device=images.device)[:, None, None]
    return (images.float() / 255 - m) / s


def random_crop_flip(images: Tensor, padding: int, flip: float) -> Tensor:
    """A random ``padding``-pixel shift (a crop of the zero-padded image) and a horizontal flip with
    probability ``flip``, each drawn per image, done on the whole (B, C, H, W) batch at once."""
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


def transformed(transform: Callable | None, x: Any, seed: int | None) -> Any:
    """``transform(x)``, its draws from the global generators seeded by ``seed`` (None: unseeded)."""
    if transform is None:
        return x
    with seeded_globals(seed) if seed is not None else nullcontext():
        return transform(x)


class LabelledImages(Dataset):
    """(uint8 (C, H, W) image, label) pairs, the optional transform's draws seeded by the sampler's
    ``(epoch, index)`` key (``seed``: the run's); ``load`` reads an image (None: skipped)."""

    def __init__(self, images: Any, labels: Any, transform: Any = None, seed: int = 0) -> None:
        self.images, self.labels = images, labels
        self.transform, self.seed = transform, seed

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, i: int) -> Any:
        return self.images[i]

    def __getitem__(self, key: int | Key) -> tuple[Any, Any] | None:
        i = key if isinstance(key, int) else key[1]
        x = self.load(i)
        if x is None:
            return None
        return transformed(self.transform, x, example_seed(self.seed, key)), self.labels[i]


class ImagesDataModule(SplitsDataModule):
    """What the image DataModules share: the splits built once (``build``); uint8 images (a batch's
    first item, or ``batch["image"]``) standardised on the device by ``mean`` and ``std`` (kept in
    the checkpoint), after ``augment`` in training; a shard source's training split streamed."""

    mean: list[float] | None = None
    std: list[float] | None = None
    shards: TarShards | None = None
    bad: BadRecords
    source: Any
    ARTIFACTS = ("classes", "img_size", "in_chans", "mean", "std")

    def __init__(self, batch_size: int, num_workers: int, seed: int) -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.splits: dict[str, Dataset] = {}
        self.classes: list[str] | None = None

    def prepare_data(self) -> None:
        if isinstance(self.source, Builtin) and self.source.data_dir is None:
            load_builtin(self.source)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        what = self.build()
        if "test" not in self.splits:
            log.warning("%s has no test split: the test stage scores the validation split", self.source.where)
            self.splits["test"] = self.splits["val"]
        train = self.shards.count("train") if self.shards else len(self.splits["train"])
        log_splits(self.source.where, (train, len(self.splits["val"]), len(self.splits["test"])), what)

    def build(self) -> str:
        """The splits (and ``mean``, ``std``: ``measure``); returns what the log calls the examples."""
        raise NotImplementedError

    def measure(self, images: Tensor | Dataset) -> None:
        """``mean`` and ``std`` per channel, unless given or restored, of uint8 (N, C, H, W) images or a
        split's first 512 readable ones; a std of at least 1e-3 (a blank sample divides by nothing)."""
        if self.mean is not None:
            return
        if not isinstance(images, Tensor):
            items = [x for x in (images[i] for i in range(min(512, len(images)))) if x is not None]
            images = torch.stack([x[0] for x in items])
        pixels = images.float().div_(255).transpose(0, 1).flatten(1)  # (C, N * H * W)
        self.mean, self.std = pixels.mean(1).tolist(), [max(s, 1e-3) for s in pixels.std(1).tolist()]

    def artifacts(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.ARTIFACTS}

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        """The checkpoint's normalisation (a pre-trained part's run may hand on its tokenizer alone)."""
        self.mean, self.std = artifacts.get("mean", self.mean), artifacts.get("std", self.std)

    def augment(self, images: Tensor) -> Tensor:
        """A training batch of uint8 (B, C, H, W) images, before normalisation."""
        return images

    def normalize(self, images: Tensor) -> Tensor:
        return normalize(images, self.mean, self.std)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, dict):
            return {**batch, "image": self.normalize(batch["image"])}
        images, *rest = batch
        training = self.trainer is not None and self.trainer.training
        return self.normalize(self.augment(images) if training else images), *rest

    def open_shards(self, kind: str, holding: str) -> TarShards:
        """The source's shards, refused unless of ``kind`` (records of ``holding``) with val records."""
        self.shards = shards = TarShards(self.source.path)
        if shards.kind != kind or (kind == "images" and not shards.classes):
            raise DataError(f"{self.source.path}: not {holding}; see its manifest")
        if not shards.count("val"):
            raise DataError(f"{self.source.path}: no validation records (prepare with --val-size > 0)")
        return shards

    def read_shards(self, decode: Callable[[Record, str], Any]) -> None:
        """The shards' val and test splits, records read by index."""
        for split in ("val", "test"):
            if self.shards.count(split):
                self.splits[split] = ShardRecords(self.shards.splits[split], decode, self.bad)

    def decode_train(self, record: Record, where: str, seed: int | None = None) -> Any:
        raise NotImplementedError  # a training shard record -> an example (``seed``: its draws')

    def train_dataloader(self) -> DataLoader:
        if self.shards is None:
            return super().train_dataloader()
        return stream_loader(self, self.shards.splits["train"], self.decode_train, self.collate)


class LabelledImagesDataModule(ImagesDataModule):
    """What the image classification DataModules share: ``classes``, ``img_size`` and ``in_chans``
    travel in the checkpoint; a normalised training batch gets timm's random erasing (its noise made
    on the device), then mixup/cutmix (labels become (B, num_classes) mixtures)."""

    img_size: int | None
    in_chans: int | None

    def __init__(
        self, batch_size: int, random_erasing: float, mixup: dict | None, num_workers: int, seed: int
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        self.mixup_args = mixup_args(mixup, batch_size)
        self.random_erasing = random_erasing
        self.mixup: Mixup | None = None

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.mixup_args["mixup_alpha"] or self.mixup_args["cutmix_alpha"]:
            self.mixup = Mixup(**self.mixup_args, label_smoothing=0.0, num_classes=len(self.classes))

    def on_after_batch_transfer(
        self, batch: tuple[Tensor, Tensor], dataloader_idx: int
    ) -> tuple[Tensor, Tensor]:
        x, labels = super().on_after_batch_transfer(batch, dataloader_idx)
        if self.trainer is None or not self.trainer.training:
            return x, labels
        if self.random_erasing:
            x = RandomErasing(self.random_erasing, mode="pixel", device=x.device)(x)
        if self.mixup is not None:
            if len(x) % 2:  # pairs are mixed: an odd batch left by a skipped record loses an image
                x, labels = x[:-1], labels[:-1]
            x, labels = self.mixup(x, labels)
        return x, labels

    def model_kwargs(self) -> dict[str, int]:
        return {"num_classes": len(self.classes), "img_size": self.img_size, "in_chans": self.in_chans}


class ImageClassificationDataModule(LabelledImagesDataModule):
    """A ``Builtin`` set (its ``val_size`` carved) as uint8 tensors, resized once to ``img_size``
    (None: native): ``rand_augment`` per image in the loader, the rest per batch on the device."""

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

    def build(self) -> str:
        data = load_builtin(self.source)
        images = self._resize(data.train_images)
        labels = data.train_labels
        val, train = carve(len(labels), [self.val_size], self.seed)
        self.classes = data.classes
        self.measure(images[train])
        augment = None
        if self.rand_augment:
            policy = timm_policy("data.rand_augment", self.rand_augment, self.mean)
            augment = v2.Compose([TF.to_pil_image, policy, TF.pil_to_tensor])  # on (C, H, W) uint8
        self.splits["train"] = LabelledImages(images[train], labels[train], augment, self.seed)
        self.splits["val"] = LabelledImages(images[val], labels[val])
        self.splits["test"] = LabelledImages(self._resize(data.test_images), data.test_labels)
        self.img_size, self.in_chans = images.size(-1), images.size(1)  # as resized
        return f"images of {tuple(images.shape[1:])}, {len(self.classes)} classes"

    def _resize(self, images: Tensor) -> Tensor:
        return images if self.img_size is None else TF.resize(images, [self.img_size] * 2, antialias=True)

    def augment(self, images: Tensor) -> Tensor:
        return random_crop_flip(images, self.crop_padding, self.hflip)

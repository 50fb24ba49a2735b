"""Image classification data: images decoded once into uint8 tensors, a seeded validation split
carved from the training set, timm's augmentation per image and mixup/cutmix per batch."""

from __future__ import annotations

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
    kinds = {"rand": rand_augment_transform, "augmix": augment_and_mix_transform}
    make = next((f for prefix, f in kinds.items() if policy.startswith(prefix)), auto_augment_transform)
    try:
        return make(policy, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as e:
        raise ConfigError(
            f"{key}={policy!r} is not a timm policy (e.g. 'rand-m9-mstd0.5-inc1', TrivialAugment "
            f"'{TRIVIAL_AUGMENT}', 'original'): {e}"
        ) from e


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


class ImagesDataModule(SplitsDataModule):
    """What the image DataModules share: the splits built once (``build``), a ``Builtin`` set
    downloaded once, on one process; uint8 images (a batch's first item, or ``batch["image"]``)
    standardised per channel on the device by ``mean`` and ``std`` (kept in the checkpoint), after
    ``augment`` in training; a shard source's splits (``shards``), its training split streamed."""

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
        if not self.splits:
            self.build()

    def build(self) -> None:
        raise NotImplementedError

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
        """The source's shards, refused unless of ``kind`` (``holding``: what its records hold) with
        validation records."""
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
        """A training shard record -> an example (``seed``: its draws')."""
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        if self.shards is None:
            return super().train_dataloader()
        return stream_loader(self, self.shards.splits["train"], self.decode_train, self.collate)

    def log_sizes(self, what: str) -> None:
        train = self.shards.count("train") if self.shards else len(self.splits["train"])
        log_splits(self.source.where, (train, len(self.splits["val"]), len(self.splits["test"])), what)


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
        self.mixup_args, self.random_erasing = mixup_args(mixup, batch_size), random_erasing
        self.mixup: Mixup | None = None

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

    def build(self) -> None:
        data = load_builtin(self.source)
        images, labels = self._resize(data.train_images), data.train_labels
        val, train = carve(len(labels), [self.val_size], self.seed)
        self.classes = data.classes
        if self.mean is None:
            self.mean, self.std = channel_stats(images[train])
        augment = None
        if self.rand_augment:
            policy = timm_policy("data.rand_augment", self.rand_augment, self.mean)
            augment = v2.Compose([TF.to_pil_image, policy, TF.pil_to_tensor])  # on (C, H, W) uint8
        self.splits["train"] = LabelledImages(images[train], labels[train], augment, self.seed)
        self.splits["val"] = LabelledImages(images[val], labels[val])
        self.splits["test"] = LabelledImages(self._resize(data.test_images), data.test_labels)
        self.img_size, self.in_chans = images.size(-1), images.size(1)  # as resized
        self.mixup = make_mixup(self.mixup_args, len(self.classes))
        self.log_sizes(f"images of {tuple(images.shape[1:])}, {len(self.classes)} classes")

    def _resize(self, images: Tensor) -> Tensor:
        return images if self.img_size is None else TF.resize(images, [self.img_size] * 2, antialias=True)

    def augment(self, images: Tensor) -> Tensor:
        return random_crop_flip(images, self.crop_padding, self.hflip)

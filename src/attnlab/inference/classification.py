"""Classifying image files with a trained run: the checkpoint's channels, size and normalisation."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from torch import Tensor, nn

from attnlab.core.errors import DataError
from attnlab.data.vision.classification import normalize
from attnlab.data.vision.datasets import IMAGE_SUFFIXES, read_image

log = logging.getLogger(__name__)


def image_files(path: Path) -> list[Path]:
    """``path`` itself, or the images in the folder ``path`` (sorted)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"image={path}: a folder without images ({', '.join(sorted(IMAGE_SUFFIXES))})")
        return files
    if not path.is_file():
        raise DataError(f"image={path}: no such file or folder")
    return [path]


def load_image(path: Path, artifacts: dict[str, Any]) -> Tensor:
    """(C, H, W) uint8 in the model's channels and size, each change noted on the log."""
    channels, size = artifacts["in_chans"], artifacts["img_size"]
    image = read_image(path)
    if image.size(0) != channels:
        kind = "grayscale" if channels == 1 else "RGB"
        log.info("note: %s has %d channel(s); the model takes %s: converted", path, image.size(0), kind)
        image = read_image(path, channels)
    if image.shape[-2:] != (size, size):
        h, w = image.shape[-2:]
        log.info("note: %s is %dx%d; the model takes %dx%d: resized", path, w, h, size, size)
        image = TF.resize(image, [size, size], antialias=True)
    return image


@torch.no_grad()
def classify(
    net: nn.Module, images: Tensor, artifacts: dict[str, Any], top_k: int
) -> list[list[tuple[str, float]]]:
    """uint8 (B, C, H, W) -> per image the ``top_k`` (class, probability) pairs, most likely first."""
    probs = net(normalize(images, artifacts["mean"], artifacts["std"])).float().softmax(-1)
    p, idx = probs.topk(min(top_k, probs.size(-1)), dim=-1)
    classes = artifacts["classes"]
    return [
        [(classes[i], float(q)) for q, i in zip(row_p.tolist(), row_i.tolist(), strict=True)]
        for row_p, row_i in zip(p, idx, strict=True)
    ]

"""Captions for Fashion-MNIST / MNIST images: the class and three measured attributes (brightness,
size, width) in many phrasings; zero-shot prompt templates, naming the class only, held out."""

from __future__ import annotations

import torch
from torch import Tensor

# what each class is called in captions and prompts
CLASS_PHRASES = {
    "fashion_mnist": [
        "t-shirt",
        "pair of trousers",
        "pullover",
        "dress",
        "coat",
        "sandal",
        "shirt",
        "sneaker",
        "bag",
        "ankle boot",
    ],
    "mnist": ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"],
}
# each attribute in three levels, cut at its per-class tertiles on the training split
ATTRIBUTE_WORDS = {
    "brightness": ("dark", "grey", "bright"),
    "size": ("small", "medium-sized", "large"),
    "width": ("narrow", "regular", "wide"),
}
# {c}: the class phrase; {brightness}, {size}, {width}: attribute words
TRAIN_TEMPLATES = (
    "a {size} {brightness} {c}",
    "a {brightness} {c}",
    "a {size} {c}",
    "a {width} {c}",
    "a {c} that is {size} and {brightness}",
    "a {width}, {brightness} {c}",
    "this {c} is {brightness}, {size} and {width}",
    "a photo of a {size} {c}",
    "a photo of a {brightness}, {width} {c}",
    "an image of a {c}, {width} and {size}",
    "the {c} is {width}",
    "{size}, {brightness}, {width}: a {c}",
    "a {c}",
    "an image of a {brightness} {c} that looks {width}",
)
# held out of training: zero-shot prompts ({} is the class phrase)
ZEROSHOT_TEMPLATES = (
    "a picture of a {}.",
    "a grayscale photo of the {}.",
    "a low resolution image of a {}.",
    "a centered photo of one {}.",
    "there is a {} in this picture.",
    "a close-up of the {}.",
    "a {} on a black background.",
    "a blurry photo of a {}.",
)


def measure(images: Tensor) -> Tensor:
    """Per image (N, C, H, W) uint8: mean brightness of the item's pixels, the share of the image
    it covers, and the width over the height of its bounding box; (N, 3) float."""
    gray = images.float().mean(1) / 255  # (N, H, W)
    item = gray > 0.1
    area = item.flatten(1).float().mean(1)
    brightness = (gray * item).flatten(1).sum(1) / item.flatten(1).sum(1).clamp(min=1)
    cols, rows = item.any(1), item.any(2)  # (N, W), (N, H)
    width = _extent(cols) / _extent(rows).clamp(min=1)
    return torch.stack([brightness, area, width], dim=1)


def _extent(mask: Tensor) -> Tensor:
    """Length of the span from the first to the last True along dim 1, (N,)."""
    idx = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    first = torch.where(mask, idx, mask.size(1)).amin(1)
    last = torch.where(mask, idx, -1).amax(1)
    return (last - first + 1).clamp(min=0).float()


def attribute_levels(values: Tensor, labels: Tensor, cuts: Tensor) -> Tensor:
    """Levels 0-2 of each attribute, (N, 3) long, from the per-class tertile ``cuts`` (K, 3, 2)."""
    per_image = cuts[labels]  # (N, 3, 2)
    return (values[:, :, None] > per_image).sum(-1)


def tertile_cuts(values: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """Per class and attribute, the values splitting the training images into thirds, (K, 3, 2)."""
    q = torch.tensor([1 / 3, 2 / 3])
    cuts = torch.zeros(num_classes, values.size(1), 2)
    for k in range(num_classes):
        mine = values[labels == k]
        if len(mine):
            cuts[k] = torch.quantile(mine, q, dim=0).t()
    return cuts


def caption(phrase: str, levels: list[int], template: str) -> str:
    words = {name: ATTRIBUTE_WORDS[name][lvl] for name, lvl in zip(ATTRIBUTE_WORDS, levels, strict=True)}
    return template.format(c=phrase, **words)


def caption_corpus(phrases: list[str]) -> list[str]:
    """Every training caption there can be (each template, class and attributes): the tokenizer's text."""
    combos = [[b, s, w] for b in range(3) for s in range(3) for w in range(3)]
    return [caption(p, lv, t) for p in phrases for lv in combos for t in TRAIN_TEMPLATES]

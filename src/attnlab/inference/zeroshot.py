"""Zero-shot classification with a trained CLIP: class embeddings from prompt templates (each
class's prompts averaged and re-normalised, as open_clip does), images scored against them."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.data.text.formats import read_lines
from attnlab.errors import ConfigError, DataError


def parse_labels(labels: str | None) -> list[str]:
    """``labels="t-shirt,sneaker,bag"`` -> the class names, refusing an empty list."""
    names = [s.strip() for s in str(labels or "").split(",") if s.strip()]
    if not names:
        raise ConfigError('labels: an empty label list; give the classes, e.g. labels="t-shirt,sneaker,bag"')
    return names


def read_templates(path: str) -> list[str]:
    """Prompt templates, one per line, each with ``{}`` where the class name goes."""
    file = Path(path)
    templates = []
    for number, line in enumerate(read_lines(file, "templates"), 1):
        if not line.strip():
            continue
        if "{}" not in line:
            raise DataError(f"{file}:{number}: a template needs {{}} where the class name goes: {line!r}")
        templates.append(line.strip())
    if not templates:
        raise DataError(f"templates={file} holds no templates; expected one per line, with {{}}")
    return templates


@torch.no_grad()
def zeroshot_probs(net: nn.Module, images: Tensor, classifier: Tensor) -> Tensor:
    """Normalised images (B, C, H, W) -> class probabilities (B, K) at the model's logit scale."""
    return (net.scale() * net.encode_image(images).float() @ classifier.t()).softmax(-1)

"""Zero-shot classification with a trained CLIP: class embeddings from prompt templates, images
scored against them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.text.formats import read_lines
from attnlab.data.text.tokenizers import CaptionTokenizer


def parse_labels(labels: str | None) -> list[str]:
    """``labels="t-shirt,sneaker,bag"`` -> the class names, refusing an empty list and a label
    given twice (it would be scored twice, splitting its probability)."""
    names = [s.strip() for s in str(labels or "").split(",") if s.strip()]
    if not names:
        raise ConfigError('labels: an empty label list; give the classes, e.g. labels="t-shirt,sneaker,bag"')
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"labels: {', '.join(map(repr, twice))} given more than once; give each label once")
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


@torch.no_grad()
def zeroshot_classifier(net: nn.Module, prompt_tokens: Tensor, num_classes: int) -> Tensor:
    """Class embeddings from prompts ordered class by class, (K * M, T) ids for K classes and M
    templates: each class's prompt features averaged and re-normalised, as open_clip does; (K, E)."""
    features = net.encode_text(prompt_tokens).float()  # (K * M, E), unit length
    return F.normalize(features.view(num_classes, -1, features.size(-1)).mean(1), dim=-1)


def zeroshot_accuracy(image_features: Tensor, classifier: Tensor, labels: Tensor) -> dict[int, float]:
    """Top-1 and top-5 accuracy of the nearest class embedding, {1: acc, 5: acc}."""
    scores = image_features @ classifier.t()  # (N, K)
    top = scores.topk(min(5, scores.size(1)), dim=1).indices
    hits = top == labels[:, None]
    return {1: hits[:, 0].float().mean().item(), 5: hits.any(1).float().mean().item()}


@torch.no_grad()
def class_embeddings(
    net: nn.Module, tokenizer: CaptionTokenizer, context_length: int, labels: list[str], templates: list[str]
) -> Tensor:
    """(K, E) unit class embeddings, each the mean over ``templates`` filled with its label."""
    prompts = [t.format(label) for label in labels for t in templates]
    tokens, _ = tokenizer.encode_captions(prompts, context_length)
    device = next(net.parameters()).device
    return zeroshot_classifier(net, tokens.to(device), len(labels))

"""Scenes: 2 to 4 Fashion-MNIST or MNIST items placed apart on a blank canvas, captioned with the
items and their relations ("a sneaker to the left of a bag , which is above a shirt"), each item's
box kept, so captions can be checked word by word and attention against the boxes; seeded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from attnlab.core.errors import ConfigError
from attnlab.core.specs import PositiveInt
from attnlab.data.multimodal.captions import CLASS_PHRASES
from attnlab.data.sources import Builtin
from attnlab.data.text.tokenizers import WordTokenizer, tokenizer_from_json
from attnlab.data.vision.classification import ImagesDataModule
from attnlab.data.vision.datasets import load_builtin

# each relation (as scenes record it) and its phrasings in captions
RELATIONS = {
    "to the left of": ("to the left of", "left of", "on the left of"),
    "to the right of": ("to the right of", "right of", "on the right of"),
    "above": ("above", "over", "on top of"),
    "below": ("below", "under", "beneath"),
}
# the first two items ({a}, {b}: "a bag"), and each further one ({prev}: the item before it)
OPENINGS = ("{a} {rel} {b}", "there is {a} {rel} {b}", "{a} is {rel} {b}")
LINKS = ("and the {prev} is {rel} {b}", ", which is {rel} {b}", "; the {prev} is {rel} {b}")
GAP = 2  # the fewest blank pixels between two items' boxes


@dataclass
class Scenes(Dataset):
    """``n`` scenes; per scene its items in the order the caption names them. As a split, an example
    is a scene's index: the DataModule's collate builds the batch."""

    images: Tensor  # (n, 1, canvas, canvas) uint8
    captions: list[str]  # words separated by single spaces
    boxes: list[Tensor]  # (k, 4) long: x0, y0, x1, y1 in canvas pixels (x1, y1 exclusive)
    labels: list[Tensor]  # (k,) long: the items' classes
    relations: list[list[tuple[str, str, str]]]  # (item, relation, next item), k - 1 of them
    words: list[list[int]]  # per item, the position in caption.split() of the word naming it
    sources: list[Tensor]  # (k,) long: the items' indices in the source images
    pool: Tensor | None = None  # the indices, in the source's split, of the images drawn from

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, key: int | tuple[int, int]) -> int:
        return key if isinstance(key, int) else key[1]  # a training draw's (epoch, index)


def make_scenes(
    images: Tensor,
    labels: Tensor,
    phrases: list[str],
    n: int,
    seed: int,
    canvas: int = 64,
    items: tuple[int, int] = (2, 4),
) -> Scenes:
    """``n`` scenes of ``items[0]``..``items[1]`` items of different classes, drawn from ``images``
    (N, [1,] h, w) uint8 with ``labels`` (N,); ``phrases[c]`` names class ``c``. An item is its
    image cropped to its non-zero pixels, placed uniformly among the free positions."""
    src = images.reshape(len(images), *images.shape[-2:]).numpy()
    by_class = [np.flatnonzero(labels.numpy() == c) for c in range(len(phrases))]
    present = [c for c, idx in enumerate(by_class) if len(idx)]
    lo, hi = items
    if not 1 <= lo <= hi <= len(present):
        raise ConfigError(
            f"data.items={list(items)}: expected 1 <= min <= max <= {len(present)} (the classes)"
        )
    rng = np.random.default_rng(seed)
    out = np.zeros((n, canvas, canvas), np.uint8)
    scenes = Scenes(torch.from_numpy(out[:, None]), [], [], [], [], [], [])
    for s in range(n):
        for _ in range(100):
            classes = rng.choice(present, int(rng.integers(lo, hi + 1)), replace=False)
            sources = np.array([rng.choice(by_class[c]) for c in classes])
            crops = [_crop(src[i]) for i in sources]
            boxes = _place([c.shape for c in crops], canvas, rng)
            if boxes is not None:
                break
        else:
            raise ConfigError(f"data.canvas={canvas}: too small to place {hi} items without overlap")
        for crop, (x0, y0, x1, y1) in zip(crops, boxes, strict=True):
            out[s, y0:y1, x0:x1] = crop
        order = _reading_order(boxes, reverse=bool(rng.integers(2)))
        boxes, classes, sources = boxes[order], classes[order], sources[order]
        names = [phrases[c] for c in classes]
        rels = [_relation(boxes[i], boxes[i + 1]) for i in range(len(boxes) - 1)]
        caption = _caption(names, rels, rng)
        scenes.captions.append(caption)
        scenes.boxes.append(torch.from_numpy(boxes).long())
        scenes.labels.append(torch.from_numpy(classes).long())
        scenes.relations.append([(names[i], r, names[i + 1]) for i, r in enumerate(rels)])
        scenes.words.append([_naming_word(caption.split(), name) for name in names])
        scenes.sources.append(torch.from_numpy(sources).long())
    return scenes


def grid_cells(boxes: Tensor, canvas: int, grid: int) -> Tensor:
    """The cell (row-major in a ``grid`` x ``grid`` tiling of the canvas) of each box's centre:
    ``boxes`` (k, 4) x0, y0, x1, y1 -> (k,) long."""
    centre = (boxes[:, :2] + boxes[:, 2:]).float() / 2  # (k, 2): x, y
    col, row = (centre * grid / canvas).long().clamp(max=grid - 1).unbind(-1)
    return row * grid + col


def grid_label_names(phrases: list[str], grid: int) -> list[str]:
    """The names of the (cell, class) labels, cell-major: the phrases alone for a grid of 1."""
    if grid == 1:
        return list(phrases)
    rows = ("top", "bottom") if grid == 2 else [f"row {r}" for r in range(grid)]
    cols = ("left", "right") if grid == 2 else [f"column {c}" for c in range(grid)]
    return [f"{p} ({r} {c})" for r in rows for c in cols for p in phrases]


def _crop(image: np.ndarray) -> np.ndarray:
    """The image cut to the bounding box of its non-zero pixels."""
    rows, cols = np.flatnonzero(image.any(1)), np.flatnonzero(image.any(0))
    if not len(rows):
        return image
    return image[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]


def _place(sizes: list[tuple[int, int]], canvas: int, rng: np.random.Generator) -> np.ndarray | None:
    """Boxes (k, 4) x0, y0, x1, y1 for items of ``sizes`` (h, w), each at a position drawn
    uniformly among those at least ``GAP`` pixels from the boxes before it; None where one has
    no room left."""
    taken = np.zeros((canvas + 1, canvas + 1), np.int32)  # the blocked pixels' integral image
    boxes = []
    for h, w in sizes:
        if h > canvas or w > canvas:
            return None
        # blocked pixels in the h x w window whose top-left is (y, x), for every y, x at once
        inside = taken[h:, w:] - taken[:-h, w:] - taken[h:, :-w] + taken[:-h, :-w]
        free = np.flatnonzero(inside == 0)
        if not len(free):
            return None
        y, x = divmod(int(rng.choice(free)), inside.shape[1])
        boxes.append((x, y, x + w, y + h))
        blocked = np.zeros((canvas, canvas), np.int32)
        blocked[max(0, y - GAP) : y + h + GAP, max(0, x - GAP) : x + w + GAP] = 1
        taken[1:, 1:] += blocked.cumsum(0).cumsum(1)
    return np.array(boxes)


def _centre(box: np.ndarray) -> tuple[float, float]:
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def _reading_order(boxes: np.ndarray, reverse: bool) -> np.ndarray:
    """Item indices from left to right by centre (top first on a tie), or right to left."""
    order = sorted(range(len(boxes)), key=lambda i: _centre(boxes[i]))
    return np.array(order[::-1] if reverse else order)


def _relation(a: np.ndarray, b: np.ndarray) -> str:
    """Where item ``a`` is relative to item ``b``: the larger offset between centres decides."""
    (ax, ay), (bx, by) = _centre(a), _centre(b)
    if abs(bx - ax) >= abs(by - ay):
        return "to the left of" if ax < bx else "to the right of"
    return "above" if ay < by else "below"


def _a(name: str) -> str:
    return ("an " if name[0] in "aeiou" and not name.startswith("one") else "a ") + name


def _caption(names: list[str], rels: list[str], rng: np.random.Generator) -> str:
    """One caption naming ``names`` in order, item i ``rels[i]`` item i + 1."""
    opening = OPENINGS[rng.integers(len(OPENINGS))]
    link = LINKS[rng.integers(len(LINKS))]

    def say(rel: str) -> str:
        return RELATIONS[rel][rng.integers(len(RELATIONS[rel]))]

    parts = [opening.format(a=_a(names[0]), rel=say(rels[0]), b=_a(names[1]))] if rels else [_a(names[0])]
    for i in range(1, len(rels)):
        parts.append(link.format(prev=names[i], rel=say(rels[i]), b=_a(names[i + 1])))
    return " ".join(parts)


def _naming_word(words: list[str], name: str) -> int:
    """Position in ``words`` of the last word of ``name``'s first mention ("boot" of "ankle boot")."""
    target = name.split()
    for i in range(len(words) - len(target) + 1):
        if words[i : i + len(target)] == target:
            return i + len(target) - 1
    raise ValueError(f"{name!r} is not in the caption")  # a template bug, not the user's


class ScenesDataModule(ImagesDataModule):
    """Scenes (``make_scenes``) of a ``Builtin`` IDX set: train and val scenes from disjoint halves of
    its training images, test scenes from its test images; ``train_size``, ``val_size`` and
    ``test_size`` count the scenes, ``items`` the fewest and most items on a ``canvas``-pixel side.

    ``target="caption"`` batches: ``image``, ``tokens`` (``<bos>`` words ``<eos>``, a ``WordTokenizer``
    kept in the checkpoint), ``captions``, ``idx``, and for scoring ``items``, ``relations``, ``boxes``
    and ``words`` (per item, the index in ``tokens`` of the word naming it). ``target="labels"``:
    ``image`` and ``target`` (B, labels), 1 per class in the scene, or per (cell, class) of a
    ``label_grid`` x ``label_grid`` grid."""

    def __init__(
        self,
        source: Builtin | None = None,
        canvas: PositiveInt = 64,
        items: tuple[int, int] = (2, 4),
        train_size: PositiveInt = 20_000,
        val_size: PositiveInt = 500,
        test_size: PositiveInt = 2000,
        target: Literal["caption", "labels"] = "caption",
        label_grid: PositiveInt = 1,
        batch_size: PositiveInt = 64,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        source = (source or Builtin("fashion_mnist")).one_of(CLASS_PHRASES)
        if source.carved():  # the scenes' sizes are data.train_size, ...
            raise ConfigError(
                "data.source.val_size: scenes are drawn from halves of the source's training images "
                "(data.train_size, data.val_size, data.test_size count them): leave it null"
            )
        self.source, self.img_size, self.in_chans = source, canvas, 1
        self.canvas, self.target = canvas, target
        self.items = (int(items[0]), int(items[1]))
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.phrases = CLASS_PHRASES[source.name]  # what captions call each class
        self.label_grid = label_grid
        self.classes = grid_label_names(self.phrases, label_grid)  # the labels' names
        self.tokenizer: WordTokenizer | None = None
        self.max_len: int | None = None  # the longest caption in tokens, <bos> and <eos> included

    def model_kwargs(self) -> dict[str, Any]:
        image = {"img_size": self.canvas, "in_chans": 1}
        if self.target == "labels":
            return {"num_classes": len(self.classes), **image}
        return {"vocab_size": self.tokenizer.vocab_size, "max_len": self.max_len, "pad_id": 0, **image}

    def artifacts(self) -> dict[str, Any]:
        tokenizer = self.tokenizer.to_json() if self.tokenizer else None
        return {"tokenizer": tokenizer, "max_len": self.max_len, **super().artifacts()}

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        if artifacts.get("tokenizer"):
            self.tokenizer = tokenizer_from_json(artifacts["tokenizer"])
        self.max_len = artifacts.get("max_len", self.max_len)
        super().load_artifacts(artifacts)

    def build(self) -> str:
        data = load_builtin(self.source)
        order = torch.randperm(len(data.train_labels), generator=torch.Generator().manual_seed(self.seed))
        half = len(order) // 2
        sources = {  # (images, labels, the pool's indices in them)
            "train": (data.train_images, data.train_labels, order[:half]),
            "val": (data.train_images, data.train_labels, order[half:]),
            "test": (data.test_images, data.test_labels, torch.arange(len(data.test_labels))),
        }
        for k, (split, (images, labels, pool)) in enumerate(sources.items()):
            n = self.sizes[split]
            scenes = make_scenes(
                images[pool], labels[pool], self.phrases, n, self.seed + k, self.canvas, self.items
            )
            scenes.pool = pool
            self.splits[split] = scenes
        train = self.splits["train"]
        self.measure(train.images)
        if self.target == "caption":
            if self.tokenizer is None:
                self.tokenizer = WordTokenizer.fit(train.captions)
            longest = max(len(c.split()) for s in self.splits.values() for c in s.captions)
            self.max_len = max(self.max_len or 0, longest + 2)
        vocabulary = f", a {self.tokenizer.vocab_size}-word vocabulary" if self.tokenizer else ""
        return f"scenes, {self.items[0]}-{self.items[1]} items on {self.canvas}x{self.canvas}{vocabulary}"

    def caption_texts(self, split: str) -> list[str]:
        """The captions of a split ("train", "val", "test"), in order (a language model's text)."""
        return self.splits[split].captions

    def batch(self, scenes: Scenes, idx: list[int]) -> dict[str, Any]:
        """The batch of ``scenes`` at ``idx`` (uint8 images: normalised on the device)."""
        images = scenes.images[idx]
        if self.target == "labels":
            target = torch.zeros(len(idx), len(self.classes))
            for row, i in enumerate(idx):
                cells = grid_cells(scenes.boxes[i], self.canvas, self.label_grid)
                target[row, cells * len(self.phrases) + scenes.labels[i]] = 1.0
            return {"image": images, "target": target}
        captions = [scenes.captions[i] for i in idx]
        tokens, _ = self.tokenizer.encode_captions(captions, self.max_len)
        return {
            "image": images,
            "tokens": tokens,
            "captions": captions,
            "idx": torch.tensor(idx),
            "items": [[self.phrases[c] for c in scenes.labels[i].tolist()] for i in idx],
            "relations": [scenes.relations[i] for i in idx],
            "boxes": [scenes.boxes[i] for i in idx],
            "words": [[1 + w for w in scenes.words[i]] for i in idx],  # tokens[0] is <bos>
        }

    def collate_of(self, split: str) -> Callable[[list[int]], dict[str, Any]]:
        return partial(self.batch, self.splits[split])  # picklable, for loader workers

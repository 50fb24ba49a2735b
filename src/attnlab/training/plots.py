"""Attention pictures and confusion matrices (matplotlib, no display needed)."""

from __future__ import annotations

from itertools import product
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from torch import Tensor  # noqa: E402


def stretched(x: Tensor) -> Tensor:
    """``x`` mapped linearly onto [0, 1] (a constant onto 0)."""
    x = x.float()
    lo, hi = x.amin(), x.amax()
    return (x - lo) / (hi - lo).clamp_min(1e-12)


def _picture(image: Tensor) -> tuple[Any, str | None]:
    """A (C, H, W) image as imshow takes it and its colour map: (H, W) gray for one channel."""
    img = image.permute(1, 2, 0).numpy()
    return (img[:, :, 0], "gray") if img.shape[2] == 1 else (img, None)


def heat_panels(
    axes: Any, image: Tensor, panels: list[tuple[str, Tensor | None]], fontsize: int, interpolation: str
) -> None:
    """On each axis the (C, H, W) ``image`` (in [0, 1]) titled, under its panel's heat (in [0, 1],
    any grid; None: none)."""
    img, cmap = _picture(image)
    h, w = img.shape[:2]
    over = {"extent": (-0.5, w - 0.5, h - 0.5, -0.5), "interpolation": interpolation}
    for ax, (title, heat) in zip(axes, panels, strict=False):
        ax.imshow(img, cmap=cmap, vmin=0.0, vmax=1.0)
        if heat is not None:
            ax.imshow(heat.numpy(), cmap="inferno", alpha=0.6, vmin=0.0, vmax=1.0, **over)
        ax.set_title(title, fontsize=fontsize)
    for ax in axes:
        ax.axis("off")


def alignment_figure(maps: dict[str, Tensor], src_tokens: list[str], out_tokens: list[str]) -> Figure:
    """Heatmaps of (H, T, S) attention ``maps``: one row per map, one column per head."""
    n_rows, n_cols = len(maps), max(w.size(0) for w in maps.values())
    t, s = len(out_tokens), len(src_tokens)
    cell = 0.18 + 0.02 * max(t, s)
    size = (1.2 + cell * s * n_cols / 6 + 2 * n_cols, 1.0 + cell * t * n_rows / 6 + 2 * n_rows)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=size, squeeze=False)
    for r, (name, weights) in enumerate(maps.items()):
        for c in range(n_cols):
            ax = axes[r][c]
            if c >= weights.size(0):
                ax.axis("off")
                continue
            ax.imshow(weights[c, :t, :s].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_xticks(range(s), src_tokens if r == n_rows - 1 else [""] * s, rotation=90, fontsize=7)
            ax.set_yticks(range(t), out_tokens if c == 0 else [""] * t, fontsize=7)
            ax.set_title(name if weights.size(0) == 1 else f"{name}, head {c}", fontsize=8)
    fig.tight_layout()
    return fig


def attention_overlay_figure(images: Tensor, maps: dict[str, Tensor], captions: list[str]) -> Figure:
    """One row per image ((B, C, H, W) in [0, 1]): the image, then each (B, h, w) map laid over it."""
    n, cols = images.size(0), 1 + len(maps)
    fig, axes = plt.subplots(n, cols, figsize=(2.2 * cols, 2.3 * n), squeeze=False)
    for i in range(n):
        # stretched per image: rollout sits on a large constant
        panels = [(captions[i], None), *((name, stretched(m[i])) for name, m in maps.items())]
        heat_panels(axes[i], images[i], panels, fontsize=7, interpolation="nearest")
    fig.tight_layout()
    return fig


def confusion_matrix_figure(matrix: Tensor, classes: list[str]) -> Figure:
    """Counts of (true class, predicted class), rows true, columns predicted."""
    k = len(classes)
    fig, ax = plt.subplots(figsize=(1.5 + 0.5 * k, 1.2 + 0.5 * k))
    ax.imshow(matrix.numpy(), cmap="Blues")
    for r, c in product(range(k), repeat=2):
        ax.text(c, r, str(int(matrix[r, c])), ha="center", va="center", fontsize=6)
    ax.set_xticks(range(k), classes, rotation=90, fontsize=7)
    ax.set_yticks(range(k), classes, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    fig.tight_layout()
    return fig


def cls_attention_figure(weights: Tensor, tokens: list[str]) -> Figure:
    """[CLS]'s attention to each token (columns) in each layer (rows), mean over heads: (layers, T)."""
    n_layers, t = weights.shape
    fig, ax = plt.subplots(figsize=(max(3.5, 1.5 + 0.3 * t), 0.8 + 0.35 * n_layers))  # room for the title
    ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, aspect="auto")
    ax.set_xticks(range(t), tokens, rotation=90, fontsize=8)
    ax.set_yticks(range(n_layers), [f"layer {i}" for i in range(n_layers)], fontsize=8)
    ax.set_title("[CLS] attention over the tokens (mean over heads)", fontsize=9)
    fig.tight_layout()
    return fig


def similarity_figure(images: Tensor, captions: list[str], sim: Tensor) -> Figure:
    """CLIP's cosine similarities (n captions x n images, ``sim`` is images x captions), with the
    images above their columns; ``images`` (n, C, H, W) in [0, 1]. The diagonal holds the pairs."""
    n = len(captions)
    fig = plt.figure(figsize=(2.5 + 0.9 * n, 1.5 + 0.45 * n))
    grid = fig.add_gridspec(2, n, height_ratios=[1, 0.5 * n], hspace=0.05, wspace=0.05)
    for j in range(n):
        ax = fig.add_subplot(grid[0, j])
        ax.imshow(*_picture(images[j]))
        ax.axis("off")
    ax = fig.add_subplot(grid[1, :])
    ax.imshow(sim.t().numpy(), cmap="viridis", aspect="auto")
    for r, c in product(range(n), repeat=2):
        ax.text(c, r, f"{sim[c, r]:.2f}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(n), captions, fontsize=8)
    ax.set_xticks([])
    ax.set_title("cosine similarity: captions (rows) x images (columns)", fontsize=9)
    fig.subplots_adjust(left=0.35, right=0.98, top=0.95, bottom=0.08)
    return fig


def curves_figure(
    series: dict[str, list[tuple[float, float, float]]], metric: str, xlabel: str = "step", logx: bool = False
) -> Figure:
    """One line per run (or group): ``metric``'s mean against the step (or ``xlabel``, log2 with ``logx``),
    in a band of ± its standard deviation."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5 + 0.22 * len(series)))  # room for the legend below
    for label, points in series.items():
        steps, means, stds = zip(*points, strict=True)
        (line,) = ax.plot(steps, means, marker="o" if len(points) < 30 else None, markersize=3, label=label)
        if any(stds):
            low = [m - s for m, s in zip(means, stds, strict=True)]
            high = [m + s for m, s in zip(means, stds, strict=True)]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel(xlabel)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_ylabel(metric)
    ax.set_title(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.15), ncol=1, frameon=False)
    fig.tight_layout()
    return fig


def caption_attention_figure(image: Tensor, words: list[str], attn: Tensor, grid: tuple[int, int]) -> Figure:
    """Show, Attend and Tell's figure: the image, then each word's (L, S) attention over ``grid``."""
    cols = min(6, len(words) + 1)
    rows = -(-(len(words) + 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.9 * cols, 2.0 * rows), squeeze=False)
    heats = [(w, a.reshape(grid) / a.max().clamp_min(1e-12)) for w, a in zip(words, attn, strict=False)]
    heat_panels(axes.ravel(), image, [("", None), *heats], fontsize=9, interpolation="bilinear")
    fig.tight_layout()
    return fig


DPI = 90  # every picture a run saves


def publish_figure(
    task: Any,
    key: str,
    figures: Figure | list[Figure],
    paths: Path | list[Path | None] | None = None,
    step: bool = True,
) -> None:
    """Save ``figures`` (each to its path, where one is given), show them to every logger that
    takes images (W&B) under ``key``, at the task's step unless ``step`` is False, and close them."""
    figures = figures if isinstance(figures, list) else [figures]
    paths = paths if isinstance(paths, list) else [paths] * len(figures)
    for fig, path in zip(figures, paths, strict=True):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=DPI)
    at = {"step": task.global_step} if step else {}
    # a figure saved to its own file goes to the loggers as that file: drawing it again costs more
    images = [
        str(p) if p is not None and paths.count(p) == 1 else f for f, p in zip(figures, paths, strict=True)
    ]
    for lg in task.loggers if figures else []:
        if hasattr(lg, "log_image"):
            lg.log_image(key=key, images=images, **at)
    for fig in figures:
        plt.close(fig)

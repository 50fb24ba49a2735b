"""Attention pictures (matplotlib, no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from torch import Tensor  # noqa: E402


def alignment_figure(maps: dict[str, Tensor], src_tokens: list[str], out_tokens: list[str]) -> Figure:
    """Heatmaps of attention weights: one row per map (e.g. decoder layer), one column per head.

    ``maps`` holds (H, T, S) weights: output tokens (rows) attending over source tokens (columns).
    """
    n_rows, n_cols = len(maps), max(w.size(0) for w in maps.values())
    t, s = len(out_tokens), len(src_tokens)
    cell = 0.18 + 0.02 * max(t, s)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(1.2 + cell * s * n_cols / 6 + 2 * n_cols,
                                                       1.0 + cell * t * n_rows / 6 + 2 * n_rows),
                             squeeze=False)
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

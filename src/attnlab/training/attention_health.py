"""Attention health at every validation (``attnlab.nn.health``), and its heat maps at the end."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from attnlab.core.specs import PositiveInt
from attnlab.nn import health

UNITS = {
    "entropy": "nats",
    "distance": "tokens or pixels",
    "first_token": "mass on key 0",
    "max_weight": "mean",
}


class AttentionHealth(L.Callback):
    """Log ``attn/<metric>/<layer>/h<head>``, ``attn/<metric>/<layer>`` and ``attn/<metric>``
    (``attnlab.nn.health``) at every validation; draw them as layer x head heat maps, a panel per
    metric, once fitting ends (``<plot_dir>/attention_health.png`` and W&B). The probe: the task's
    own forward of the first ``rows`` rows of the first validation batch (unshuffled, the same each
    time), on global rank 0, run eagerly (a compiled net's probe may round differently)."""

    def __init__(self, rows: PositiveInt = 8, plot_dir: str | None = None) -> None:
        self.rows, self.plot_dir = rows, plot_dir
        self._stack = ExitStack()
        self._records: list[health.AttentionRecord] | None = None
        self.last: dict[str, dict[str, Tensor]] = {}  # the last validation's per_head values

    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if batch_idx == dataloader_idx == 0 and trainer.is_global_zero and not trainer.sanity_checking:
            # a compiled net runs this batch eagerly: not compiled again for the recording
            self._stack.enter_context(torch.compiler.set_stance("force_eager"))
            self._records = self._stack.enter_context(health.recording(pl_module.net, self.rows))

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._records is None:
            return
        self._stack.close()
        records, self._records = self._records, None
        if records:
            self.last = health.per_head(records)
            pl_module.log_dict(health.flat(self.last), rank_zero_only=True, batch_size=1)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._stack.close()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.last or not trainer.is_global_zero:
            return
        from attnlab.training.plots import publish_figure  # matplotlib, once per run

        path = Path(self.plot_dir) / "attention_health.png" if self.plot_dir else None
        publish_figure(pl_module, "attn/heat_maps", heat_maps(self.last), path)


def heat_maps(values: dict[str, dict[str, Tensor]]) -> Any:
    """One panel per metric: its values ``{layer: (H,)}`` as layers (rows) x heads (columns)."""
    from attnlab.training.plots import plt

    metrics = [m for m, layers in values.items() if layers]
    names = list(dict.fromkeys(name for m in metrics for name in values[m]))
    n_heads = max(len(v) for m in metrics for v in values[m].values())
    # a fixed layout (inches), not tight_layout: each drawing of the figure is most of its cost
    left = 0.3 + 0.055 * max(map(len, names))
    panel = 1.3 + 0.3 * n_heads
    height = 1.0 + 0.25 * len(names)
    width = left + panel * len(metrics)
    fig, axes = plt.subplots(1, len(metrics), figsize=(width, height), squeeze=False)
    fig.subplots_adjust(
        left=left / width, right=1 - 0.4 / width, bottom=0.4 / height, top=1 - 0.3 / height, wspace=0.35
    )
    for ax, metric in zip(axes[0], metrics, strict=True):
        grid = torch.full((len(names), n_heads), float("nan"))
        for i, name in enumerate(names):
            v = values[metric].get(name, torch.empty(0))
            grid[i, : len(v)] = v
        image = ax.imshow(grid.numpy(), cmap="viridis", aspect="auto")
        ax.set_xticks(range(n_heads), [f"h{h}" for h in range(n_heads)], fontsize=7)
        ax.set_yticks(range(len(names)), names if ax is axes[0][0] else [], fontsize=7)
        ax.set_title(f"{metric} ({UNITS[metric]})", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.1, pad=0.04).ax.tick_params(labelsize=6)
    return fig

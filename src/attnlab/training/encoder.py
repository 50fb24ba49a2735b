"""What the BERT tasks share: the same metrics on the validation and test splits, the best
validation value tracked across resumes, and attention pictures of a few fixed validation
sentences (every layer and head, and [CLS]'s attention over the tokens)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics import MaxMetric, Metric, MinMetric

from attnlab.core.distributed import unsharded
from attnlab.training.base import CompileMode, CompileScope, Task

Batch = dict[str, Tensor]


class EncoderTask(Task):
    """A task around ``net.encoder`` (a ``Bert``) whose subclasses say which metrics to keep
    (``make_metrics``), how a batch updates them (``evaluate``) and which validation value is
    "best" (``best``: (name, "min" | "max")); logged as ``<stage>/<name>`` and ``val/<name>_best``.

    Args:
        net, optimizer, scheduler, weight_decay, compile, compile_mode: see ``Task``.
        plot_sentences: validation examples whose attention is drawn after each validation.
        plot_dir: where the pictures go (also to W&B).
    """

    best: tuple[str, str] = ("loss", "min")

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None,
        weight_decay: float,
        compile: CompileScope,
        init_from: str | None,
        plot_sentences: int,
        plot_dir: str | None,
        lr_decay: float | None = None,
        freeze: list[str] | None = None,
        compile_mode: CompileMode = "default",
    ) -> None:
        super().__init__(
            net, optimizer, scheduler, weight_decay, compile, init_from, lr_decay, freeze, compile_mode
        )
        self.plot_sentences, self.plot_dir = plot_sentences, plot_dir
        self.metrics = nn.ModuleDict({stage: nn.ModuleDict(self.make_metrics()) for stage in ("val", "test")})
        self.val_best = MinMetric() if self.best[1] == "min" else MaxMetric()
        self.val_best.persistent(True)  # resumed runs keep the best value seen so far

    def make_metrics(self) -> dict[str, Metric]:
        raise NotImplementedError

    def evaluate(self, batch: Batch, metrics: nn.ModuleDict) -> None:
        raise NotImplementedError

    def _log(self, stage: str) -> dict[str, Tensor]:
        values = {name: metric.compute() for name, metric in self.metrics[stage].items()}
        if "mlm_loss" in values:
            values["ppl"] = values["mlm_loss"].exp()
        for name, value in values.items():
            self.log(f"{stage}/{name}", value, prog_bar=name in ("loss", "acc", "mlm_acc"))
        for metric in self.metrics[stage].values():
            metric.reset()
        return values

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.evaluate(batch, self.metrics["val"])

    def on_validation_epoch_end(self) -> None:
        values = self._log("val")
        if not self.trainer.sanity_checking:
            name = self.best[0]
            self.val_best.update(values[name])
            self.log(f"val/{name}_best", self.val_best.compute())
            with unsharded(self.net):  # every process: a sharded net needs them all
                draw_attention(self, self.net.encoder, self.plot_sentences, self.plot_dir)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self.evaluate(batch, self.metrics["test"])

    def on_test_epoch_end(self) -> None:
        self._log("test")


@torch.no_grad()
def draw_attention(task: L.LightningModule, encoder: nn.Module, n: int, plot_dir: str | None) -> None:
    """Draw the first ``n`` validation examples of the task's data (``examples(n)``)."""
    if not n:
        return
    from attnlab.training.plots import alignment_figure, cls_attention_figure  # matplotlib only when plotting

    data = task.trainer.datamodule
    for i, (ids, segments, _) in enumerate(data.examples(n)):
        x = torch.tensor([ids], device=task.device)
        _, weights = encoder(x, torch.tensor([segments], device=task.device), need_weights=True)
        if not task.trainer.is_global_zero:
            continue
        tokens = [data.tokenizer.token(t) for t in ids]
        maps = {f"layer {layer}": w[0].float().cpu() for layer, w in enumerate(weights)}  # (H, T, T)
        cls = torch.stack([w[0, :, 0].mean(0) for w in weights]).float().cpu()  # (layers, T)
        figures = {"heads": alignment_figure(maps, tokens, tokens), "cls": cls_attention_figure(cls, tokens)}
        for kind, fig in figures.items():
            if plot_dir:
                path = Path(plot_dir) / f"step{task.global_step:06d}_sentence{i}_{kind}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                fig.savefig(path, dpi=80)
            for lg in task.loggers:
                if hasattr(lg, "log_image"):
                    lg.log_image(key=f"val/attention_{kind}_{i}", images=[fig], step=task.global_step)
        import matplotlib.pyplot as plt

        plt.close("all")

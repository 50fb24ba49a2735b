"""What the BERT tasks share: the same metrics on the validation and test splits, the best
validation value tracked across resumes, and attention pictures of a few fixed validation
sentences (every layer and head, and [CLS]'s attention over the tokens)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics import MaxMetric, Metric, MinMetric

from attnlab.core.distributed import unsharded
from attnlab.nn.flops import Count, Flops
from attnlab.training.base import Task
from attnlab.training.optim import Optimization

Batch = dict[str, Tensor]


class EncoderTask(Task):
    """A task around ``net.encoder`` (a ``Bert``) whose subclasses say which metrics to keep
    (``make_metrics``), the training loss (``train_loss``), how a batch updates the metrics
    (``evaluate``), what the net takes (``inputs``) and which validation value is
    "best" (``best``: (name, "min" | "max")); logged as ``<stage>/<name>`` and ``val/<name>_best``.

    Args:
        net, optim, init_from: see ``Task``; ``init_from``: a pre-training run's checkpoint gives a
            fine-tuned net its encoder (the head starts fresh) and, through the data, its tokenizer.
        plot_sentences: validation examples whose attention is drawn after each validation.
        plot_dir: where the pictures go (also to W&B).
    """

    best: tuple[str, str] = ("loss", "min")

    def __init__(
        self,
        net: nn.Module,
        optim: Optimization,
        init_from: str | None = None,
        plot_sentences: int = 2,
        plot_dir: str | None = None,
    ) -> None:
        super().__init__(net, optim, init_from)
        self.plot_sentences, self.plot_dir = plot_sentences, plot_dir
        self.metrics = nn.ModuleDict({stage: nn.ModuleDict(self.make_metrics()) for stage in ("val", "test")})
        self.val_best = MinMetric() if self.best[1] == "min" else MaxMetric()
        self.val_best.persistent(True)  # resumed runs keep the best value seen so far

    def make_metrics(self) -> dict[str, Metric]:
        raise NotImplementedError

    def train_loss(self, batch: Batch) -> Tensor:
        raise NotImplementedError

    def inputs(self, batch: Batch) -> tuple[Tensor, ...]:
        """What the net takes from ``batch``."""
        return batch["ids"], batch["segments"]

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self.train_loss(batch)
        self.log_train_loss(loss)
        return loss

    items = "tokens"  # what throughput counts (``attnlab.training.callbacks.Throughput``)

    def step_work(self, batch: Batch) -> tuple[Count, Flops]:
        """The tokens (padding left out) and the model FLOPs (``attnlab.nn.flops``) of a
        training step on ``batch``."""
        return (batch["ids"] != self.net.encoder.pad_id).sum(), self.net.flops(*self.inputs(batch))

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
    from attnlab.training.plots import alignment_figure, cls_attention_figure, publish_figure

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
            path = Path(plot_dir) / f"step{task.global_step:06d}_sentence{i}_{kind}.png" if plot_dir else None
            publish_figure(task, f"val/attention_{kind}_{i}", fig, path)

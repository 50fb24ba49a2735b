"""What the BERT tasks share: validation and test metrics, the best validation value kept across resumes,
attention pictures of a few validation sentences."""

from __future__ import annotations

from typing import Unpack

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from attnlab.core.distributed import unsharded
from attnlab.core.specs import Start
from attnlab.nn.flops import Count, Flops
from attnlab.training.base import Task, best_so_far
from attnlab.training.optim import Optimization

Batch = dict[str, Tensor]


class EncoderTask(Task):
    """A task around ``net.encoder`` (a ``Bert``); subclasses give ``make_metrics``, ``train_loss``,
    ``evaluate``, ``inputs`` and ``best`` (name, "min" | "max"), logged as ``val/<name>_best``."""

    best: tuple[str, str] = ("loss", "min")

    def __init__(
        self,
        net: nn.Module,
        optim: Optimization,
        plot_sentences: int = 2,
        plot_dir: str | None = None,
        **start: Unpack[Start],
    ) -> None:
        super().__init__(net, optim, **start)
        self.plot_sentences, self.plot_dir = plot_sentences, plot_dir
        self.metrics = nn.ModuleDict({stage: nn.ModuleDict(self.make_metrics()) for stage in ("val", "test")})
        self.val_best = best_so_far(self.best[1])

    def make_metrics(self) -> dict[str, Metric]:
        raise NotImplementedError

    def inputs(self, batch: Batch) -> tuple[Tensor, ...]:
        """What the net takes from ``batch``."""
        return batch["ids"], batch["segments"]

    items = "tokens"

    def step_work(self, batch: Batch) -> tuple[Count, Flops]:
        """The tokens (padding left out) and the model FLOPs (``attnlab.nn.flops``) of a training step."""
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
        self.log_best(self.best[0], self.val_best, values[self.best[0]])
        if not self.trainer.sanity_checking:
            with unsharded(self.net):  # every process: a sharded net needs them all
                draw_attention(self, self.net.encoder, self.plot_sentences)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self.evaluate(batch, self.metrics["test"])

    def on_test_epoch_end(self) -> None:
        self._log("test")


@torch.no_grad()
def draw_attention(task: Task, encoder: nn.Module, n: int) -> None:
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
            path = task.figure_path(f"step{task.global_step:06d}_sentence{i}_{kind}.png")
            publish_figure(task, f"val/attention_{kind}_{i}", fig, path)

"""Image classification: cross-entropy (label smoothing, mixup, DeiT distillation), top-1/5 and per-class
accuracy, a confusion matrix, attention pictures; ``multilabel``: BCE per class, accuracy, F1, exact match."""

from __future__ import annotations

import logging
from typing import Any, Unpack

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MultilabelAccuracy,
    MultilabelExactMatch,
    MultilabelF1Score,
)

from attnlab.core.errors import ConfigError
from attnlab.core.specs import DropRate, Start
from attnlab.models.contracts import PatchAttention
from attnlab.nn.flops import Count, Flops
from attnlab.training.base import Task, best_so_far
from attnlab.training.distillation import HardDistillation
from attnlab.training.optim import Optimization

log = logging.getLogger(__name__)

# (images, targets), or a dict with "image" and "target" (data=scenes data.target=labels)
Batch = tuple[Tensor, Tensor] | dict[str, Any]


def images_and_targets(batch: Batch) -> tuple[Tensor, Tensor]:
    return (batch["image"], batch["target"]) if isinstance(batch, dict) else batch


class ImageClassificationTask(Task):
    """Trains any ``net`` mapping images (B, C, H, W) to logits (B, K) on class ids or mixed label
    distributions; ``multilabel``: multi-hot targets, label smoothing towards 1/2."""

    def __init__(
        self,
        net: nn.Module,
        optim: Optimization,
        label_smoothing: DropRate = 0.0,
        distillation: HardDistillation | None = None,
        plot_images: int = 4,
        plot_dir: str | None = None,
        multilabel: bool = False,
        **start: Unpack[Start],
    ) -> None:
        super().__init__(net, optim, **start)
        if distillation is not None:
            if multilabel:
                raise ConfigError(
                    "model.distillation: DeiT's distillation is for one label per image, not model.multilabel"
                )
            distillation.check_student(net)
        self.label_smoothing, self.distillation = label_smoothing, distillation
        self.plot_images, self.plot_dir, self.multilabel = plot_images, plot_dir, multilabel
        k = net.num_classes
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_metrics = nn.ModuleDict(self._metrics(k))
        self.test_metrics = nn.ModuleDict(self._metrics(k))
        self.test_per_class = (
            MultilabelF1Score(k, average="none") if multilabel else MulticlassConfusionMatrix(k)
        )
        self.val_acc_best = best_so_far("max")

    def _metrics(self, k: int) -> dict[str, Metric]:
        """What validation and test score besides the loss, by name (logged as val/<name>)."""
        if self.multilabel:
            return {
                "acc": MultilabelAccuracy(k, average="micro"),
                "f1": MultilabelF1Score(k, average="macro"),
                "exact_match": MultilabelExactMatch(k),
            }
        return {
            "acc": MulticlassAccuracy(k, average="micro"),
            "acc_top5": MulticlassAccuracy(k, top_k=min(5, k), average="micro"),
        }

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        data = getattr(self.trainer, "datamodule", None) if self._trainer else None
        if getattr(data, "target", None) == "labels" and not self.multilabel:
            raise ConfigError(
                "data.target=labels gives several labels per image: train with model.multilabel=true "
                "(as experiment=perceiver_scenes)"
            )

    def loss(self, logits: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        """Cross-entropy over the classes, or with ``multilabel`` binary cross-entropy per class."""
        if self.multilabel:
            targets = targets.float() * (1 - label_smoothing) + label_smoothing / 2
            return F.binary_cross_entropy_with_logits(logits, targets)
        return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)

    def on_fit_start(self) -> None:
        if self.distillation is not None:  # held outside the module tree: not saved with the student
            self.distillation.teacher.to(self.device)

    def train_loss(self, batch: Batch) -> Tensor:
        images, targets = images_and_targets(batch)
        if self.distillation is None:
            return self.loss(self(images).float(), targets, self.label_smoothing)
        cls_logits, dist_logits = self.net.forward_heads(images)
        return self.distillation.loss(cls_logits, dist_logits, targets, images, self.label_smoothing)

    items = "images"

    def step_work(self, batch: Batch) -> tuple[Count, Flops]:
        """The images and the model FLOPs (``attnlab.nn.flops``) of a training step on ``batch``,
        a distillation teacher's forward included."""
        images, _ = images_and_targets(batch)
        f = self.net.flops(images)
        teacher = getattr(self.distillation, "teacher", None)
        if hasattr(teacher, "flops"):  # forward only
            f = f + teacher.flops(images, grad="none")
        return images.size(0), f

    def _evaluate(self, batch: Batch, loss_metric: MeanMetric, *metrics: Metric) -> None:
        images, labels = images_and_targets(batch)
        logits = self(images).float()
        loss_metric.update(self.loss(logits, labels), len(labels))
        if self.multilabel:  # probabilities: torchmetrics takes logits that happen to lie in [0, 1] for them
            logits, labels = logits.sigmoid(), labels.long()
        for metric in metrics:
            metric.update(logits, labels)

    def _log_metrics(self, split: str, loss: MeanMetric, metrics: nn.ModuleDict) -> Tensor:
        """Log and reset the loss and ``metrics`` of ``split``; return its accuracy."""
        acc = metrics["acc"].compute()
        self.log(f"{split}/loss", loss.compute(), prog_bar=split == "val")
        for name, metric in metrics.items():
            self.log(f"{split}/{name}", acc if name == "acc" else metric.compute(), prog_bar=name == "acc")
            metric.reset()
        loss.reset()
        return acc

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, *self.val_metrics.values())

    def on_validation_epoch_end(self) -> None:
        acc = self._log_metrics("val", self.val_loss, self.val_metrics)
        self.log_best("acc", self.val_acc_best, acc)
        if not self.trainer.sanity_checking:
            self._plot_attention()  # every process: a sharded net needs them all

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, *self.test_metrics.values(), self.test_per_class)

    def on_test_epoch_end(self) -> None:
        self._log_metrics("test", self.test_loss, self.test_metrics)
        classes = self._classes()
        per_class = self.test_per_class.compute().cpu()  # F1 per class, or the confusion matrix
        self.test_per_class.reset()
        key = "f1_class" if self.multilabel else "acc_class"
        scores = per_class if self.multilabel else per_class.diagonal() / per_class.sum(1).clamp_min(1)
        for name, score in zip(classes, scores.tolist(), strict=True):
            self.log(f"test/{key}/{name.replace('/', '-')}", score)
        if not self.multilabel and self.trainer.is_global_zero:
            self._save_confusion(per_class, classes)

    # -- what people look at ------------------------------------------------------------------------
    def _classes(self) -> list[str]:
        data = getattr(self.trainer, "datamodule", None)
        classes = getattr(data, "classes", None)
        return list(classes) if classes else [str(i) for i in range(self.net.num_classes)]

    def _save_confusion(self, matrix: Tensor, classes: list[str]) -> None:
        from attnlab.training.plots import confusion_matrix_figure, publish_figure  # matplotlib when plotting

        rows = [",".join(["true\\predicted", *classes])]
        rows += [",".join([name, *map(str, matrix[i].tolist())]) for i, name in enumerate(classes)]
        path = self.write_lines("confusion_matrix.csv", rows)
        fig = confusion_matrix_figure(matrix, classes)
        publish_figure(self, "test/confusion_matrix", fig, path.with_suffix(".png"), step=False)
        log.info("confusion matrix written to %s", path)

    @torch.no_grad()
    def _plot_attention(self) -> None:
        if not self.plot_images or self.multilabel or not isinstance(self.net, PatchAttention):
            return
        from attnlab.training.plots import attention_overlay_figure, publish_figure

        data = self.trainer.datamodule
        split = data.splits["val"]
        items = [split[i] for i in range(min(self.plot_images, len(split)))]  # the same ones every time
        raw = torch.stack([x for x, _ in items])
        images = data.normalize(raw.to(self.device))
        maps = {k: v.float().cpu() for k, v in self.net.patch_attention(images).items()}
        predicted = self.net(images).argmax(-1).tolist()
        if not self.trainer.is_global_zero:
            return
        classes = self._classes()
        captions = [f"{classes[int(y)]} -> {classes[p]}" for (_, y), p in zip(items, predicted, strict=True)]
        fig = attention_overlay_figure(raw.float() / 255, maps, captions)
        publish_figure(self, "val/attention", fig, self.figure_path(f"step{self.global_step:06d}.png"))

"""Image classification: cross-entropy (label smoothing, mixup targets, DeiT distillation),
top-1/top-5 accuracy, per-class accuracy and a confusion matrix, attention pictures."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from attnlab.tasks.base import Task
from attnlab.tasks.distillation import HardDistillation
from attnlab.utils.checks import check_probability

log = logging.getLogger(__name__)

Batch = tuple[Tensor, Tensor]


class ImageClassificationTask(Task):
    """Trains any ``net`` mapping images (B, C, H, W) to logits (B, num_classes).

    Logs ``train/loss``; ``val/loss``, ``val/acc``, ``val/acc_top5``, ``val/acc_best``; and at
    test ``test/loss``, ``test/acc``, ``test/acc_top5``, ``test/acc_class/<class>`` with the
    confusion matrix (``confusion_matrix.csv`` and a picture). Targets are class ids, or label
    distributions (B, K) when the data mixes images (mixup/cutmix).

    Args:
        net: the classifier (``VisionTransformer``, ``SwinTransformer``, ``TimmModel``, ...).
        optimizer, scheduler, weight_decay, compile: see ``Task``.
        label_smoothing: of the training targets.
        distillation: a ``HardDistillation`` (the net must have a distillation token).
        plot_images: validation images whose attention is drawn at each validation (nets with
            ``patch_attention``); 0 for none.
        plot_dir: where the pictures go (also to W&B).
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        weight_decay: float = 0.05,
        compile: bool = False,
        init_from: str | None = None,
        lr_decay: float | None = None,
        freeze: list[str] | None = None,
        label_smoothing: float = 0.0,
        distillation: HardDistillation | None = None,
        plot_images: int = 4,
        plot_dir: str | None = None,
    ) -> None:
        super().__init__(net, optimizer, scheduler, weight_decay, compile, init_from, lr_decay, freeze)
        check_probability("model", label_smoothing=label_smoothing)
        if distillation is not None:
            distillation.check_student(net)
        self.label_smoothing, self.distillation = label_smoothing, distillation
        self.plot_images, self.plot_dir = plot_images, plot_dir
        k = net.num_classes
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc, self.test_acc = (
            MulticlassAccuracy(k, average="micro"),
            MulticlassAccuracy(k, average="micro"),
        )
        self.val_acc5 = MulticlassAccuracy(k, top_k=min(5, k), average="micro")
        self.test_acc5 = MulticlassAccuracy(k, top_k=min(5, k), average="micro")
        self.test_confusion = MulticlassConfusionMatrix(k)
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def on_fit_start(self) -> None:
        if self.distillation is not None:  # held outside the module tree: not saved with the student
            self.distillation.teacher.to(self.device)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        images, targets = batch
        if self.distillation is not None:
            cls_logits, dist_logits = self.net.forward_heads(images)
            loss = self.distillation.loss(cls_logits, dist_logits, targets, images, self.label_smoothing)
        else:
            loss = F.cross_entropy(self(images).float(), targets, label_smoothing=self.label_smoothing)
        self.log_train_loss(loss)
        return loss

    def _evaluate(self, batch: Batch, loss_metric: MeanMetric, *accuracies: Any) -> Tensor:
        images, labels = batch
        logits = self(images).float()
        loss_metric.update(F.cross_entropy(logits, labels), labels.numel())
        for metric in accuracies:
            metric.update(logits, labels)
        return logits

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_acc, self.val_acc5)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()
        self.log("val/loss", self.val_loss.compute(), prog_bar=True)
        self.log("val/acc", acc, prog_bar=True)
        self.log("val/acc_top5", self.val_acc5.compute())
        for metric in (self.val_loss, self.val_acc, self.val_acc5):
            metric.reset()
        if not self.trainer.sanity_checking:
            self.val_acc_best.update(acc)
            self.log("val/acc_best", self.val_acc_best.compute())
            self._plot_attention()  # every process: a sharded net needs them all

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_acc, self.test_acc5, self.test_confusion)

    def on_test_epoch_end(self) -> None:
        matrix = self.test_confusion.compute().cpu()
        self.log("test/loss", self.test_loss.compute())
        self.log("test/acc", self.test_acc.compute())
        self.log("test/acc_top5", self.test_acc5.compute())
        classes = self._classes()
        per_class = matrix.diagonal() / matrix.sum(1).clamp_min(1)
        for name, acc in zip(classes, per_class.tolist(), strict=True):
            self.log(f"test/acc_class/{name.replace('/', '-')}", acc)
        for metric in (self.test_loss, self.test_acc, self.test_acc5, self.test_confusion):
            metric.reset()
        if self.trainer.is_global_zero:
            self._save_confusion(matrix, classes)

    # -- what people look at ------------------------------------------------------------------------
    def _classes(self) -> list[str]:
        data = getattr(self.trainer, "datamodule", None)
        classes = getattr(data, "classes", None)
        return list(classes) if classes else [str(i) for i in range(self.net.num_classes)]

    def _save_confusion(self, matrix: Tensor, classes: list[str]) -> None:
        from attnlab.plots import confusion_matrix_figure  # matplotlib only when plotting

        out = Path(self.trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        rows = [",".join(["true\\predicted", *classes])]
        rows += [",".join([name, *map(str, matrix[i].tolist())]) for i, name in enumerate(classes)]
        (out / "confusion_matrix.csv").write_text("\n".join(rows) + "\n")
        fig = confusion_matrix_figure(matrix, classes)
        fig.savefig(out / "confusion_matrix.png", dpi=100)
        for lg in self.loggers:
            if hasattr(lg, "log_image"):
                lg.log_image(key="test/confusion_matrix", images=[fig])
        import matplotlib.pyplot as plt

        plt.close(fig)
        log.info("confusion matrix written to %s", out / "confusion_matrix.csv")

    @torch.no_grad()
    def _plot_attention(self) -> None:
        if not self.plot_images or not hasattr(self.net, "patch_attention"):
            return
        from attnlab.plots import attention_overlay_figure

        data = self.trainer.datamodule
        split = data.splits["val"]
        n = min(self.plot_images, len(split))
        items = [split[i] for i in range(n)]  # the first validation images: the same ones every time
        raw = torch.stack([x for x, _ in items])
        images = data.normalize(raw.to(self.device))
        maps = {k: v.float().cpu() for k, v in self.net.patch_attention(images).items()}
        predicted = self.net(images).argmax(-1).tolist()
        if not self.trainer.is_global_zero:
            return
        classes = self._classes()
        captions = [
            f"{classes[t]} -> {classes[p]}"
            for t, p in zip([int(y) for _, y in items], predicted, strict=True)
        ]
        fig = attention_overlay_figure(raw.float() / 255, maps, captions)
        if self.plot_dir:
            path = Path(self.plot_dir) / f"step{self.global_step:06d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=90)
        for lg in self.loggers:
            if hasattr(lg, "log_image"):
                lg.log_image(key="val/attention", images=[fig], step=self.global_step)
        import matplotlib.pyplot as plt

        plt.close(fig)

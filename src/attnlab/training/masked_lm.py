"""BERT pre-training: masked-language-model and next-sentence-prediction losses and metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy

from attnlab.nn.flops import Count, Flops
from attnlab.training.base import CompileMode, CompileScope
from attnlab.training.encoder import Batch, EncoderTask


class MaskedLMTask(EncoderTask):
    """Trains a ``BertPreTraining`` net: loss = MLM cross-entropy over the chosen tokens + NSP
    cross-entropy.

    Logs ``train/loss``; ``val/loss``, ``val/mlm_loss``, ``val/mlm_acc``, ``val/ppl`` (of the MLM
    loss), ``val/nsp_acc``, ``val/loss_best``; the same under ``test/`` (documents held out for the
    test, apart from the validation ones that pick the checkpoint).

    Args:
        net: a ``BertPreTraining``.
        optimizer, scheduler, weight_decay, compile, compile_mode, plot_sentences, plot_dir: see
            ``EncoderTask``.
    """

    best = ("loss", "min")

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        weight_decay: float = 0.01,
        compile: CompileScope = False,
        init_from: str | None = None,
        lr_decay: float | None = None,
        freeze: list[str] | None = None,
        plot_sentences: int = 2,
        plot_dir: str | None = None,
        compile_mode: CompileMode = "default",
    ) -> None:
        super().__init__(
            net,
            optimizer,
            scheduler,
            weight_decay,
            compile,
            init_from,
            plot_sentences,
            plot_dir,
            lr_decay,
            freeze,
            compile_mode,
        )

    def make_metrics(self) -> dict[str, Metric]:
        return {
            "loss": MeanMetric(),
            "mlm_loss": MeanMetric(),
            "mlm_acc": MulticlassAccuracy(self.net.encoder.vocab_size, average="micro"),
            "nsp_acc": MulticlassAccuracy(2, average="micro"),
        }

    def _forward(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        masked = batch["mlm_labels"] != -100
        mlm_logits, nsp_logits = self.net(batch["ids"], batch["segments"], masked)
        targets = batch["mlm_labels"][masked]
        # a sum over the chosen tokens, so a batch where none was chosen adds zero, not NaN
        mlm_loss = F.cross_entropy(mlm_logits.float(), targets, reduction="sum") / max(targets.numel(), 1)
        nsp_loss = F.cross_entropy(nsp_logits.float(), batch["nsp_labels"])
        return mlm_loss, nsp_loss, mlm_logits, targets, nsp_logits

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        mlm_loss, nsp_loss, *_ = self._forward(batch)
        loss = mlm_loss + nsp_loss
        self.log_train_loss(loss)
        return loss

    items = "tokens"  # what throughput counts (``attnlab.training.callbacks.Throughput``)

    def step_work(self, batch: Batch) -> tuple[Count, Flops]:
        """The tokens (padding left out) and the model FLOPs (``attnlab.nn.flops``) of a
        training step on ``batch``."""
        ids = batch["ids"]
        flops = self.net.flops(ids, batch["segments"], batch["mlm_labels"] != -100)
        return (ids != self.net.encoder.pad_id).sum(), flops

    def evaluate(self, batch: Batch, metrics: nn.ModuleDict) -> None:
        mlm_loss, nsp_loss, mlm_logits, targets, nsp_logits = self._forward(batch)
        metrics["mlm_loss"].update(mlm_loss, targets.numel())
        metrics["loss"].update(mlm_loss + nsp_loss, batch["ids"].size(0))
        if targets.numel():
            metrics["mlm_acc"].update(mlm_logits, targets)
        metrics["nsp_acc"].update(nsp_logits, batch["nsp_labels"])

"""Fine-tuning a text encoder: a label per sentence (SST-2) or per token (tagging), cross-entropy,
accuracy and macro F1; the encoder optionally starts from a pre-training run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from attnlab.nn.flops import Count, Flops
from attnlab.training.base import CompileMode, CompileScope
from attnlab.training.encoder import Batch, EncoderTask

log = logging.getLogger(__name__)


class TextClassificationTask(EncoderTask):
    """Trains a net mapping (ids, segments) to logits (B, K) per sequence or (B, T, K) per token;
    labels of -100 are not scored.

    Logs ``train/loss``; ``val/loss``, ``val/acc``, ``val/f1`` (macro), ``val/acc_best``; and
    ``test/loss``, ``test/acc``, ``test/f1``.

    Args:
        net: a ``BertSequenceClassifier`` or ``BertTokenClassifier`` (anything with ``encoder``
            and ``num_classes``).
        optimizer, scheduler, weight_decay, compile, compile_mode, plot_sentences, plot_dir: see
            ``EncoderTask``.
        init_from: see ``Task``; a pre-training run's checkpoint gives its encoder (the head
            starts fresh) and, through the data, its tokenizer.
    """

    best = ("acc", "max")

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
        k = self.net.num_classes
        return {
            "loss": MeanMetric(),
            "acc": MulticlassAccuracy(k, average="micro", ignore_index=-100),
            "f1": MulticlassF1Score(k, average="macro", ignore_index=-100),
        }

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        return self.net(ids, segments)

    def _step(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        logits = self(batch["ids"], batch["segments"]).float()
        logits, labels = logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1)
        return F.cross_entropy(logits, labels, ignore_index=-100), logits, labels

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, _, _ = self._step(batch)
        self.log_train_loss(loss)
        return loss

    items = "tokens"  # what throughput counts (``attnlab.training.callbacks.Throughput``)

    def step_work(self, batch: Batch) -> tuple[Count, Flops]:
        """The tokens (padding left out) and the model FLOPs (``attnlab.nn.flops``) of a
        training step on ``batch``."""
        ids = batch["ids"]
        return (ids != self.net.encoder.pad_id).sum(), self.net.flops(ids, batch["segments"])

    def evaluate(self, batch: Batch, metrics: nn.ModuleDict) -> None:
        loss, logits, labels = self._step(batch)
        metrics["loss"].update(loss, (labels != -100).sum())
        metrics["acc"].update(logits, labels)
        metrics["f1"].update(logits, labels)

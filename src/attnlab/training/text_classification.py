"""Fine-tuning a text encoder: a label per sentence (SST-2) or per token (tagging), cross-entropy,
accuracy and macro F1; the encoder optionally starts from a pre-training run."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from attnlab.training.encoder import Batch, EncoderTask


class TextClassificationTask(EncoderTask):
    """Trains a net mapping (ids, segments) to logits per sequence (B, K) or per token (B, T, K);
    labels -100 are not scored; logs loss, accuracy, macro F1."""

    best = ("acc", "max")

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
        logits = logits.reshape(-1, logits.size(-1))
        labels = batch["labels"].reshape(-1)
        return F.cross_entropy(logits, labels, ignore_index=-100), logits, labels

    def train_loss(self, batch: Batch) -> Tensor:
        return self._step(batch)[0]

    def evaluate(self, batch: Batch, metrics: nn.ModuleDict) -> None:
        loss, logits, labels = self._step(batch)
        metrics["loss"].update(loss, (labels != -100).sum())
        metrics["acc"].update(logits, labels)
        metrics["f1"].update(logits, labels)

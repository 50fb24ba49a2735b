"""BERT pre-training: masked-language-model and next-sentence-prediction losses and metrics."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy

from attnlab.training.encoder import Batch, EncoderTask


class MaskedLMTask(EncoderTask):
    """Trains a ``BertPreTraining`` net: MLM cross-entropy over the chosen tokens + NSP cross-entropy;
    logs losses, MLM accuracy and perplexity, NSP accuracy."""

    def make_metrics(self) -> dict[str, Metric]:
        return {
            "loss": MeanMetric(),
            "mlm_loss": MeanMetric(),
            "mlm_acc": MulticlassAccuracy(self.net.encoder.vocab_size, average="micro"),
            "nsp_acc": MulticlassAccuracy(2, average="micro"),
        }

    def inputs(self, batch: Batch) -> tuple[Tensor, ...]:
        return batch["ids"], batch["segments"], batch["mlm_labels"] != -100  # the chosen tokens

    def _forward(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        ids, segments, masked = self.inputs(batch)
        mlm_logits, nsp_logits = self.net(ids, segments, masked)
        targets = batch["mlm_labels"][masked]
        # a sum over the chosen tokens, so a batch where none was chosen adds zero, not NaN
        mlm_loss = F.cross_entropy(mlm_logits.float(), targets, reduction="sum") / max(targets.numel(), 1)
        nsp_loss = F.cross_entropy(nsp_logits.float(), batch["nsp_labels"])
        return mlm_loss, nsp_loss, mlm_logits, targets, nsp_logits

    def train_loss(self, batch: Batch) -> Tensor:
        mlm_loss, nsp_loss, *_ = self._forward(batch)
        return mlm_loss + nsp_loss

    def evaluate(self, batch: Batch, metrics: nn.ModuleDict) -> None:
        mlm_loss, nsp_loss, mlm_logits, targets, nsp_logits = self._forward(batch)
        metrics["mlm_loss"].update(mlm_loss, targets.numel())
        metrics["loss"].update(mlm_loss + nsp_loss, batch["ids"].size(0))
        if targets.numel():
            metrics["mlm_acc"].update(mlm_logits, targets)
        metrics["nsp_acc"].update(nsp_logits, batch["nsp_labels"])

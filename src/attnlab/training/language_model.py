"""Causal language modelling: next-token cross-entropy, perplexity, sampling."""

from __future__ import annotations

from typing import Unpack

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from attnlab.core.specs import Start
from attnlab.nn.flops import Count, Flops
from attnlab.training.base import Task, best_so_far
from attnlab.training.optim import Optimization


class LanguageModelTask(Task):
    """Trains any ``net`` mapping token ids (B, T) to logits (B, T, V); logs loss and perplexity
    (token-weighted at test, also over sliding windows when the data gives them)."""

    def __init__(self, net: nn.Module, optim: Optimization, **start: Unpack[Start]) -> None:
        super().__init__(net, optim, **start)
        self.val_loss = MeanMetric()
        self.test_losses = nn.ModuleList([MeanMetric(), MeanMetric()])
        self.val_loss_best = best_so_far("min")

    def forward(self, idx: Tensor) -> Tensor:
        return self.net(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Mean cross-entropy over the scored targets (-100 marks targets not to score)."""
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=-100)
        return loss, (y != -100).sum()

    def train_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return self._loss(batch)[0]

    items = "tokens"

    def step_work(self, batch: tuple[Tensor, Tensor]) -> tuple[Count, Flops]:
        """The tokens and the model FLOPs (``attnlab.nn.flops``) of a training step on ``batch``."""
        return batch[0].numel(), self.net.flops(batch[0])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_loss.update(*self._loss(batch))

    def on_validation_epoch_end(self) -> None:
        loss = self.log_loss("val/loss", self.val_loss, prog_bar=True)
        self.log_best("loss", self.val_loss_best, loss)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.test_losses[dataloader_idx].update(*self._loss(batch))

    def on_test_epoch_end(self) -> None:
        # loader 0: non-overlapping windows; loader 1 (optional): sliding windows, see TextDataModule
        for metric, name in zip(self.test_losses, ("test/loss", "test/loss_sliding"), strict=True):
            if metric.update_called:
                self.log_loss(name, metric)
            metric.reset()

"""Causal language modelling: next-token cross-entropy, perplexity, sampling."""

from __future__ import annotations

from typing import Unpack

import torch
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

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log_train_loss(loss)
        return loss

    items = "tokens"  # what throughput counts (``attnlab.training.callbacks.Throughput``)

    def step_work(self, batch: tuple[Tensor, Tensor]) -> tuple[Count, Flops]:
        """The tokens and the model FLOPs (``attnlab.nn.flops``) of a training step on ``batch``."""
        x, _ = batch
        return x.numel(), self.net.flops(x)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, n = self._loss(batch)
        self.val_loss.update(loss, n)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss))
        if not self.trainer.sanity_checking:  # the sanity check must not count as the best
            self.log_best("loss", self.val_loss_best, loss)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        loss, n = self._loss(batch)
        self.test_losses[dataloader_idx].update(loss, n)

    def on_test_epoch_end(self) -> None:
        # loader 0: non-overlapping windows; loader 1 (optional): sliding windows, see TextDataModule
        for metric, name in zip(self.test_losses, ("test/loss", "test/loss_sliding"), strict=True):
            if metric.update_called:
                loss = metric.compute()
                self.log(name, loss)
                self.log(name.replace("loss", "ppl"), torch.exp(loss))
            metric.reset()

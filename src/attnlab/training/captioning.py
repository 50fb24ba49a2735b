"""Image captioning: cross-entropy with Show, Attend and Tell's doubly stochastic regulariser; BLEU-4,
CIDEr, exact match and grounding of decoded captions; attention pictures. Any ``Captioner`` trains here."""

from __future__ import annotations

import logging
from typing import Any, Unpack

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from attnlab.core.distributed import unsharded
from attnlab.core.specs import DropRate, NonNegativeFloat, PositiveInt, Start
from attnlab.inference.captioning import caption_batch
from attnlab.nn.flops import Count, Flops
from attnlab.training import caption_metrics
from attnlab.training.base import Task, best_so_far, gather_objects
from attnlab.training.optim import Optimization

log = logging.getLogger(__name__)


def doubly_stochastic_penalty(attn: Tensor, scored: Tensor) -> Tensor:
    """Xu et al.'s regulariser sum_s (1 - sum_t attn_ts)^2, averaged over captions: ``attn`` (B, T, S),
    ``scored`` (B, T) the caption's steps."""
    total = (attn.float() * scored[:, :, None]).sum(1)  # (B, S)
    return ((1.0 - total) ** 2).sum(1).mean()


class CaptioningTask(Task):
    """Trains a captioner on ``image``/``tokens``/``captions`` batches; logs loss, BLEU-4, CIDEr (their
    bests), exact match and grounding (scenes); greedy at validation, ``beam_size`` beams at test."""

    def __init__(
        self,
        net: nn.Module,
        optim: Optimization,
        attention_reg: NonNegativeFloat = 0.01,
        label_smoothing: DropRate = 0.0,
        beam_size: PositiveInt = 3,
        length_penalty: float = 0.0,
        max_len: PositiveInt = 32,
        plot_images: int = 2,
        plot_dir: str | None = None,
        **start: Unpack[Start],
    ) -> None:
        super().__init__(net, optim, **start)
        self.attention_reg, self.label_smoothing = attention_reg, label_smoothing
        self.beam_size, self.length_penalty, self.max_len = beam_size, length_penalty, max_len
        self.plot_images, self.plot_dir = plot_images, plot_dir
        names = ("loss", "exact_match", "grounding")
        self.scores = nn.ModuleDict({f"{s}_{n}": MeanMetric() for s in ("val", "test") for n in names})
        self.best = nn.ModuleDict({name: best_so_far("max") for name in ("bleu4", "cider")})
        self._pairs: list[tuple[int, str, str | list[str]]] = []  # (index, hypothesis, references)
        self._shown: Tensor | None = None
        self._captions: list[str] = []

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def _tokenizer(self) -> Any:
        return self.trainer.datamodule.tokenizer

    def _teacher_forced(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Logits (B, T-1, V) and attention (B, T-1, S) over the caption's words, the targets and
        which of them are scored (not padding)."""
        tokens = batch["tokens"]
        target = tokens[:, 1:]
        scored = target != self._tokenizer.pad_id
        logits, attn = self.net(batch["image"], tokens[:, :-1])
        return logits, attn, target, scored

    # -- loops -----------------------------------------------------------------------------------
    def train_loss(self, batch: dict[str, Any]) -> Tensor:
        logits, attn, target, scored = self._teacher_forced(batch)
        loss = F.cross_entropy(logits[scored].float(), target[scored], label_smoothing=self.label_smoothing)
        if self.attention_reg:
            reg = doubly_stochastic_penalty(attn, scored)
            loss = loss + self.attention_reg * reg
            if self.logs_this_step():
                self.log("train/attention_reg", reg)
        return loss

    items = "images"

    def step_work(self, batch: dict[str, Any]) -> tuple[Count, Flops]:
        """The images and the model FLOPs (``attnlab.nn.flops``) of a training step."""
        return batch["image"].size(0), self.net.flops(batch["image"], batch["tokens"][:, :-1])

    def _evaluate(self, batch: dict[str, Any], stage: str, beam: int) -> None:
        logits, attn, target, scored = self._teacher_forced(batch)
        if batch.get("repeat"):  # a copy that only keeps the processes' step counts equal
            return
        nll = F.cross_entropy(logits[scored].float(), target[scored])
        self.scores[f"{stage}_loss"].update(nll, scored.sum())
        if "boxes" in batch:
            self._ground(batch, attn, stage)
        tok = self._tokenizer
        with unsharded(self.net):
            out = caption_batch(
                self.net, batch["image"], tok.bos_id, tok.eos_id, self.max_len, beam, self.length_penalty
            )
        hyps = [tok.decode(ids) for ids, _ in out]
        if "relations" in batch:
            for hyp, items, relations in zip(hyps, batch["items"], batch["relations"], strict=True):
                self.scores[f"{stage}_exact_match"].update(
                    float(caption_metrics.scene_exact_match(hyp, items, relations))
                )
        idx = batch["idx"].tolist() if "idx" in batch else [len(self._pairs) + i for i in range(len(hyps))]
        self._pairs += zip(idx, hyps, batch["captions"], strict=True)  # a caption or a list of them

    def _ground(self, batch: dict[str, Any], attn: Tensor, stage: str) -> None:
        """For each named item: does the step that wrote its word look inside its box?"""
        canvas = batch["image"].size(-1)
        for i, (boxes, words) in enumerate(zip(batch["boxes"], batch["words"], strict=True)):
            for box, w in zip(boxes, words, strict=True):
                # tokens[w] is predicted by the step that reads tokens[w - 1]: attn[:, w - 1]
                hit = caption_metrics.grounding_hit(attn[i, w - 1].float(), self.net.grid, box, canvas)
                self.scores[f"{stage}_grounding"].update(float(hit))

    def _log_scores(self, stage: str) -> dict[str, float]:
        """Log the stage's metrics (the same on every process); returns BLEU-4 and CIDEr."""
        self.log(f"{stage}/loss", self.scores[f"{stage}_loss"].compute(), prog_bar=True)
        for name in ("exact_match", "grounding"):
            metric = self.scores[f"{stage}_{name}"]
            if metric.update_count:  # only scenes have them
                self.log(f"{stage}/{name}", metric.compute(), prog_bar=name == "exact_match")
        for metric in self.scores.values():
            metric.reset()
        pairs = sorted(gather_objects(self._pairs))
        self._pairs = []
        hyps, refs = [h for _, h, _ in pairs], [r for _, _, r in pairs]
        scores = {"bleu4": caption_metrics.bleu4(hyps, refs), "cider": caption_metrics.cider(hyps, refs)}
        for name, value in scores.items():
            self.log(f"{stage}/{name}", float(value))
        self._captions = hyps
        return scores

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if batch_idx == 0:  # the images whose attention is drawn: the same ones every validation
            self._shown = batch["image"][: self.plot_images]
        if not self.trainer.sanity_checking:
            self._evaluate(batch, "val", beam=1)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:  # nothing scored: validation_step skips the sanity check
            return
        for name, value in self._log_scores("val").items():
            self.log_best(name, self.best[name], torch.tensor(float(value)))
        self._plot_attention()  # every process: a sharded net needs them all

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test", beam=self.beam_size)

    def on_test_epoch_end(self) -> None:
        self._log_scores("test")
        if self.trainer.is_global_zero and self._captions:
            path = self.write_lines("test_captions.txt", self._captions)
            log.info("test captions written to %s", path)

    # -- what people look at ------------------------------------------------------------------------
    @torch.no_grad()
    def _plot_attention(self) -> None:
        if not self.plot_images or self._shown is None:
            return
        from attnlab.training.plots import caption_attention_figure, publish_figure, stretched

        tok = self._tokenizer
        images = self._shown
        with unsharded(self.net):
            out = caption_batch(self.net, images, tok.bos_id, tok.eos_id, self.max_len)
        if not self.trainer.is_global_zero:
            return
        figures, paths = [], []
        for i, (ids, attn) in enumerate(out):
            words = [tok.decode([t]) or "?" for t in ids]
            figures.append(caption_attention_figure(stretched(images[i]).cpu(), words, attn, self.net.grid))
            paths.append(self.figure_path(f"step{self.global_step:06d}_img{i}.png"))
        publish_figure(self, "val/caption_attention", figures, paths)

"""CLIP's training: the symmetric contrastive loss or SigLIP's sigmoid loss (against the global
batch under DDP), zero-shot classification through prompt templates, and image-text retrieval."""

from __future__ import annotations

import math
from typing import Literal, Unpack

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.nn.functional import all_gather
from torchmetrics.utilities.distributed import gather_all_tensors

from attnlab.core.specs import Start
from attnlab.inference.zeroshot import class_embeddings, zeroshot_accuracy
from attnlab.nn.flops import Count, Flops
from attnlab.training.base import Task, best_so_far
from attnlab.training.optim import Optimization

ContrastiveLoss = Literal["clip", "siglip"]
# SigLIP's start (Zhai et al. 2023, open_clip's init_logit_scale/init_logit_bias): scale 10, bias -10,
# so that the many non-matching pairs start near their target and do not swamp the first steps
SIGLIP_INIT_SCALE, SIGLIP_INIT_BIAS = math.log(10.0), -10.0


def gather_with_grad(x: Tensor) -> Tensor:
    """Every rank's (B, E) features concatenated in rank order, (world * B, E); gradients flow back
    to each rank's own part. The identity outside distributed runs."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return torch.cat(all_gather(x), dim=0)


def clip_loss(image_features: Tensor, text_features: Tensor, logit_scale: Tensor) -> Tensor:
    """Symmetric InfoNCE (Radford et al. 2021) over the (global) batch: the mean of the image->caption
    and caption->image cross-entropies; features (B, E) of unit length, ``logit_scale`` exp(t). Under
    DDP each rank scores the whole gathered batch; the gather's backward sums every rank's gradient
    into its part and DDP's averaging gives the global loss's (open_clip's ``gather_with_grad``)."""
    images, texts = gather_with_grad(image_features), gather_with_grad(text_features)
    logits = logit_scale * images.float() @ texts.float().t()  # (N, N): images x captions
    targets = torch.arange(logits.size(0), device=logits.device)
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2


def split_clip_loss(images: Tensor, texts: Tensor, scale: Tensor, chunk: int = 1024) -> Tensor:
    """``clip_loss`` of a whole split of N pairs, its (N, N) logits computed ``chunk`` rows at a time."""

    def one_way(queries: Tensor, keys: Tensor) -> Tensor:
        total = queries.new_zeros(())
        for start in range(0, len(queries), chunk):
            logits = scale * queries[start : start + chunk] @ keys.t()  # (chunk, N)
            targets = torch.arange(start, start + len(logits), device=logits.device)
            total = total + F.cross_entropy(logits, targets, reduction="sum")
        return total / len(queries)

    return (one_way(images, texts) + one_way(texts, images)) / 2


def siglip_loss(
    image_features: Tensor, text_features: Tensor, logit_scale: Tensor, logit_bias: Tensor
) -> Tensor:
    """SigLIP's pairwise sigmoid loss (Zhai et al. 2023) over the (global) batch, gathered as
    ``clip_loss``. open_clip's ``SigLipLoss`` passes captions between neighbour ranks instead, each
    rank scoring its own images' rows: its losses' mean over the ranks is this loss."""
    images, texts = gather_with_grad(image_features), gather_with_grad(text_features)
    return split_siglip_loss(images.float(), texts.float(), logit_scale, logit_bias, chunk=len(images))


def split_siglip_loss(
    images: Tensor, texts: Tensor, scale: Tensor, bias: Tensor, chunk: int = 1024
) -> Tensor:
    """Each of the N x N image-caption pairs a yes/no question (logit ``scale * cos + bias``; yes
    only for the i-th image with the i-th caption): the summed log-loss over N, ``chunk`` rows at a time."""
    total = images.new_zeros(())
    for start in range(0, len(images), chunk):
        logits = scale * images[start : start + chunk] @ texts.t() + bias  # (chunk, N)
        labels = -torch.ones_like(logits)
        labels.diagonal(start).fill_(1.0)  # row i is image start + i
        total = total - F.logsigmoid(labels * logits).sum()
    return total / len(images)


def recall_at_k(sim: Tensor, image_ids: Tensor, ks: tuple[int, ...] = (1, 5, 10)) -> dict[str, float]:
    """Retrieval recall from an (N images, U captions) similarity matrix, where image i's caption
    is ``image_ids[i]`` among the U distinct captions (identical captions are one caption, and any
    image carrying it is a right answer). image->text: is the image's caption among its top k;
    text->image: does any of a caption's top k images carry it (averaged over the N pairs)."""
    out = {}
    n, u = sim.shape
    i2t_rank = (sim > sim.gather(1, image_ids[:, None])).sum(1)  # captions scored above the right one
    owners = torch.zeros(u, n, dtype=torch.bool, device=sim.device)
    owners[image_ids, torch.arange(n, device=sim.device)] = True
    weights = owners.sum(1).float()  # each distinct caption counts as often as it occurs
    for k in ks:
        out[f"i2t_r{k}"] = (i2t_rank < k).float().mean().item()
        top = sim.t().topk(min(k, n), dim=1).indices  # (U, k) images per caption
        hit = owners.gather(1, top).any(1).float()
        out[f"t2i_r{k}"] = ((hit * weights).sum() / weights.sum()).item()
    return out


class ContrastiveTask(Task):
    """Trains a ``CLIP`` with the symmetric contrastive loss (``clip``) or SigLIP's sigmoid per pair
    with a learned bias (``siglip``, the scale starting at 10). Validation and test score the whole
    split (every image against every caption, however it is batched or shared out), zero-shot
    accuracy through the data's held-out prompt templates (when it has classes) and, at test,
    image<->text recall at 1/5/10 and a picture of the first ``plot_pairs`` pairs' similarities."""

    def __init__(
        self,
        net: nn.Module,
        optim: Optimization,
        loss: ContrastiveLoss = "clip",
        plot_pairs: int = 8,
        plot_dir: str | None = None,
        **start: Unpack[Start],
    ) -> None:
        if loss == "siglip":  # before init_from, whose scale takes precedence
            with torch.no_grad():
                net.logit_scale.fill_(SIGLIP_INIT_SCALE)
        super().__init__(net, optim, **start)
        self.loss, self.plot_pairs, self.plot_dir = loss, plot_pairs, plot_dir
        if loss == "siglip":  # the task's, not the net's: a CLIP exported to open_clip has none
            self.logit_bias = nn.Parameter(torch.full((1,), SIGLIP_INIT_BIAS))
        self.val_acc_best, self.val_loss_best = best_so_far("max"), best_so_far("min")
        self.classifier: Tensor | None = None
        self.outputs: dict[str, list[Tensor]] = {}

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.net(images, tokens)

    def train_loss(self, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        images, tokens, _ = batch
        image_features, text_features, scale = self(images, tokens)
        if self.loss == "siglip":
            loss = siglip_loss(image_features, text_features, scale, self.logit_bias)
        else:
            loss = clip_loss(image_features, text_features, scale)
        if self.logs_this_step():
            self.log("train/logit_scale", self.net.scale())
            if self.loss == "siglip":
                self.log("train/logit_bias", self.logit_bias.squeeze(0))
        return loss

    items = "images"  # image-caption pairs

    def step_work(self, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Count, Flops]:
        """The image-caption pairs and the model FLOPs (``attnlab.nn.flops``) of a training step."""
        images, tokens, _ = batch
        return images.size(0), self.net.flops(images, tokens)

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        images, tokens, labels = batch
        image_features, text_features, self.eval_scale = self(images, tokens)
        outputs = (image_features.float(), text_features.float(), tokens, labels)
        for key, x in zip(("images", "texts", "tokens", "labels"), outputs, strict=True):
            self.outputs.setdefault(key, []).append(x)

    def on_validation_epoch_start(self) -> None:
        self.outputs = {}
        data = self.trainer.datamodule
        self.classifier = None  # zero-shot: class embeddings (K, E) averaged over the prompt templates
        if getattr(data, "classes", None):
            self.classifier = class_embeddings(
                self.net, data.tokenizer, data.max_len, data.classes, data.templates
            )

    on_test_epoch_start = on_validation_epoch_start
    test_step = validation_step

    def _gathered(self, key: str) -> Tensor:
        """Every process's outputs under ``key``, concatenated (processes may hold different
        numbers of examples: the evaluation batches share a split out without repeats)."""
        x = torch.cat(self.outputs[key])
        return torch.cat(gather_all_tensors(x)) if self.trainer.world_size > 1 else x

    def _split_loss(self) -> Tensor:
        images, texts, scale = self._gathered("images"), self._gathered("texts"), self.eval_scale.float()
        if self.loss == "siglip":
            return split_siglip_loss(images, texts, scale, self.logit_bias.float())
        return split_clip_loss(images, texts, scale)

    def on_validation_epoch_end(self) -> None:
        loss = self._split_loss()
        self.log("val/loss", loss, prog_bar=True)
        self.log_best("loss", self.val_loss_best, loss)
        if self.classifier is not None:
            acc = zeroshot_accuracy(self._gathered("images"), self.classifier, self._gathered("labels"))
            self.log("val/zeroshot_acc", acc[1], prog_bar=True)
            self.log_best("zeroshot_acc", self.val_acc_best, acc[1])
        self.outputs = {}

    def on_test_epoch_end(self) -> None:
        self.log("test/loss", self._split_loss())
        images, texts, tokens = self._gathered("images"), self._gathered("texts"), self._gathered("tokens")
        if self.classifier is not None:
            acc = zeroshot_accuracy(images, self.classifier, self._gathered("labels"))
            self.log("test/zeroshot_acc", acc[1])
            self.log("test/zeroshot_acc_top5", acc[5])
        distinct, image_ids = torch.unique(tokens, dim=0, return_inverse=True)
        first = torch.full((len(distinct),), len(tokens), device=tokens.device)
        first.scatter_reduce_(0, image_ids, torch.arange(len(tokens), device=tokens.device), reduce="amin")
        for name, value in recall_at_k(images @ texts[first].t(), image_ids).items():
            self.log(f"test/{name}", value)
        if self.plot_pairs:
            self._plot_similarities()  # every process: a sharded net needs them all
        self.outputs = {}

    @torch.no_grad()
    def _plot_similarities(self) -> None:
        from attnlab.training.plots import publish_figure, similarity_figure

        data = self.trainer.datamodule
        split = data.splits["test"]
        items = [split[i] for i in range(min(self.plot_pairs, len(split)))]
        raw, tokens, _ = data.collate(items)
        images, texts, _ = self(data.normalize(raw.to(self.device)), tokens.to(self.device))
        if not self.trainer.is_global_zero:
            return
        fig = similarity_figure(
            raw.float() / 255, [c for _, c, _ in items], (images @ texts.t()).float().cpu()
        )
        publish_figure(self, "test/similarity", fig, self.figure_path("similarity.png"), step=False)

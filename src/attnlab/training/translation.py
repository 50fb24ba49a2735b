"""Translation: label-smoothed cross-entropy, sacreBLEU on decoded text, alignment plots."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Unpack

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.text import SacreBLEUScore

from attnlab.core.distributed import unsharded
from attnlab.core.specs import DropRate, PositiveInt, Start
from attnlab.inference.decoding import translate_batch
from attnlab.nn.flops import Count, Flops
from attnlab.training.base import Task, best_so_far, gather_objects
from attnlab.training.optim import Optimization

log = logging.getLogger(__name__)


def cross_entropy(logits: Tensor, target: Tensor, smoothing: float) -> Tensor:
    """Label-smoothed cross-entropy of (N, V) logits, in fp32."""
    return F.cross_entropy(logits.float(), target, label_smoothing=smoothing)


class TranslationTask(Task):
    """Trains an encoder-decoder ``net`` on a parallel corpus: label-smoothed loss, ppl, sacreBLEU (greedy
    at validation, ``beam_size`` beams at test), attention pictures and sample translations."""

    def __init__(
        self,
        net: nn.Module,
        optim: Optimization,
        label_smoothing: DropRate = 0.1,
        beam_size: PositiveInt = 5,
        length_penalty: float = 1.0,
        max_len_a: float = 1.5,
        max_len_b: int = 10,
        val_bleu: bool = True,
        plot_sentences: int = 3,
        plot_dir: str | None = None,
        compile_loss: bool = False,
        **start: Unpack[Start],
    ) -> None:
        super().__init__(net, optim, **start)
        self.compile_loss = compile_loss
        self._train_loss_fn = cross_entropy
        self.label_smoothing = label_smoothing
        self.beam_size, self.length_penalty = beam_size, length_penalty
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.val_bleu_on, self.plot_sentences, self.plot_dir = val_bleu, plot_sentences, plot_dir
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_bleu, self.test_bleu = SacreBLEUScore(), SacreBLEUScore()
        self.val_bleu_best = best_so_far("max")
        self._hyps: dict[int, str] = {}

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def _data(self) -> Any:
        return self.trainer.datamodule

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.compile_loss and stage == "fit":
            # dynamic: the number of scored tokens changes with every batch
            self._train_loss_fn = torch.compile(cross_entropy, dynamic=True)

    def _nll(
        self, batch: dict[str, Tensor], smoothing: float, loss_fn: Callable = cross_entropy
    ) -> tuple[Tensor, Tensor]:
        scored = batch["tgt_out"] != self.net.pad_id
        logits = self.net(batch["src"], batch["tgt_in"], scored)  # (N, V)
        return loss_fn(logits, batch["tgt_out"][scored], smoothing), scored.sum()

    def _evaluate(
        self,
        batch: dict[str, Tensor],
        stage: str,
        loss: MeanMetric,
        bleu: SacreBLEUScore | None,
        beam: int = 1,
    ) -> None:
        """Add ``batch`` to ``loss`` and, decoded with ``beam`` beams, to ``bleu``; a repeated batch (it keeps
        the processes' step counts equal: a sharded net needs all in a forward) is computed, not counted."""
        nll, n = self._nll(batch, 0.0)
        if not batch.get("repeat"):
            loss.update(nll, n)
        if bleu is None:
            return
        tok = self._data.tokenizer
        # gathered once (FSDP2): then each process decodes as many steps as its own batch needs
        with unsharded(self.net):
            if batch.get("repeat"):
                return
            lengths = (self.length_penalty, self.max_len_a, self.max_len_b)
            ids = translate_batch(self.net, batch["src"], tok.pad_id, tok.bos_id, tok.eos_id, beam, *lengths)
        hyps = [tok.decode(h) for h in ids]
        refs = self._data.references(stage)
        idx = batch["idx"].tolist()
        bleu.update(hyps, [[refs[i]] for i in idx])
        self._hyps.update(zip(idx, hyps, strict=True))

    # -- loops -----------------------------------------------------------------------------------
    def train_loss(self, batch: dict[str, Tensor]) -> Tensor:
        return self._nll(batch, self.label_smoothing, self._train_loss_fn)[0]

    items = "tokens"

    def step_work(self, batch: dict[str, Tensor]) -> tuple[Count, Flops]:
        """The source and target tokens (padding left out) and the model FLOPs of a training step."""
        scored = batch["tgt_out"] != self.net.pad_id
        tokens = (batch["src"] != self.net.pad_id).sum() + scored.sum()
        return tokens, self.net.flops(batch["src"], batch["tgt_in"], scored)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        bleu = self.val_bleu if self.val_bleu_on and not self.trainer.sanity_checking else None
        self._evaluate(batch, "val", self.val_loss, bleu)

    def on_validation_epoch_end(self) -> None:
        self.log_loss("val/loss", self.val_loss, prog_bar=True)
        if self.trainer.sanity_checking or not self.val_bleu_on:
            return
        bleu = 100 * self.val_bleu.compute()
        self.val_bleu.reset()
        self.log("val/bleu", bleu, prog_bar=True)
        self.log_best("bleu", self.val_bleu_best, bleu)
        # every process's translations of the shown sentences, by index (a collective call)
        first = range(min(self.plot_sentences, len(self._data.references("val"))))
        shown = dict(gather_objects([(i, self._hyps[i]) for i in first if i in self._hyps]))
        if self.trainer.is_global_zero:
            self._show_samples(first, shown)
        self._plot_alignments(shown)  # every process: a sharded net needs them all
        self._hyps = {}

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_loss, self.test_bleu, self.beam_size)

    def on_test_epoch_end(self) -> None:
        self.log_loss("test/loss", self.test_loss)
        self.log("test/bleu", 100 * self.test_bleu.compute())
        self.test_bleu.reset()
        hyps = dict(gather_objects(list(self._hyps.items())))
        if self.trainer.is_global_zero and hyps:
            path = self.write_lines("test_translations.txt", [hyps[i] for i in sorted(hyps)])
            refs = self._data.references("test")  # line by line beside them: attnlab-compare's paired test
            self.write_lines("test_references.txt", [refs[i] for i in sorted(hyps)])
            log.info("test translations written to %s", path)
        self._hyps = {}

    # -- what people look at ------------------------------------------------------------------------
    def _show_samples(self, first: range, hyps: dict[int, str]) -> None:
        sources, refs = self._data.sources("val"), self._data.references("val")
        rows = [(sources[i], refs[i], hyps.get(i, "")) for i in first]
        for src, ref, hyp in rows:
            log.info("src: %s\n    ref: %s\n    hyp: %s", src, ref, hyp)
        for lg in self.loggers:
            if hasattr(lg, "log_text"):
                lg.log_text(
                    key="val/samples",
                    columns=["source", "reference", "translation"],
                    data=[list(r) for r in rows],
                    step=self.global_step,
                )

    @torch.no_grad()
    def _plot_alignments(self, hyps: dict[int, str]) -> None:
        if not self.plot_sentences:
            return
        from attnlab.training.plots import alignment_figure, publish_figure  # matplotlib only when plotting

        tok = self._data.tokenizer
        split = self._data.splits["val"]
        figures, paths = [], []
        for i in range(min(self.plot_sentences, len(split))):
            hyp_ids = tok.encode(hyps[i]) if i in hyps else split.tgt[i]
            src = torch.tensor([split.src[i] + [tok.eos_id]], device=self.device)
            tgt_in = torch.tensor([[tok.bos_id] + hyp_ids], device=self.device)
            maps = self.net.alignments(src, tgt_in)  # name -> (1, H, T, S)
            if not self.trainer.is_global_zero:
                continue
            src_tokens = [tok.tokenizer.id_to_token(t) for t in src[0].tolist()]
            out_tokens = [tok.tokenizer.id_to_token(t) for t in hyp_ids] + ["<eos>"]
            maps = {k: v[0].float().cpu() for k, v in maps.items()}
            figures.append(alignment_figure(maps, src_tokens, out_tokens))
            paths.append(self.figure_path(f"step{self.global_step:06d}_sent{i}.png"))
        publish_figure(self, "val/alignments", figures, paths)

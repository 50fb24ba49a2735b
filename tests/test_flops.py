"""Every family's FLOP count (``net.flops``, ``attnlab.nn.flops``) against what PyTorch counts,
``torch.utils.flop_counter.FlopCounterMode``, on one real training step of its task (forward,
loss, backward) on a tiny config: within 5%.

The nets run the ``math`` attention path, whose backward is two matmuls per forward one, as the
count assumes. What a backward recomputes, ``FlopCounterMode`` counts and model FLOPs leave out:
the scores in ``F.scaled_dot_product_attention``'s fused backward
(``test_sdpa_adds_only_the_recomputed_scores``), linear attention's checkpointed chunk sums.
Causal attention is counted over the whole T x T matrix, masked half included, as PaLM and
nanoGPT count it and as ``FlopCounterMode`` counts the masked product and the fused kernels.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab.models import (
    CLIP,
    GPT,
    Bert,
    BertPreTraining,
    BertSequenceClassifier,
    BertTokenClassifier,
    ConvNet,
    DistilledVisionTransformer,
    Flamingo,
    Perceiver,
    Seq2Seq,
    ShowAttendTell,
    SwinTransformer,
    TextTransformer,
    TimmModel,
    Transformer,
    VisionTransformer,
)
from attnlab.nn import flops
from attnlab.training import (
    CaptioningTask,
    ContrastiveTask,
    ImageClassificationTask,
    LanguageModelTask,
    MaskedLMTask,
    TextClassificationTask,
    TranslationTask,
)
from attnlab.training.distillation import HardDistillation
from attnlab.training.optim import Optimization

ADAMW = Optimization(partial(torch.optim.AdamW, lr=1e-3))
V, PAD = 40, 0


def task_of(cls: type, net: torch.nn.Module, **kwargs: Any) -> Any:
    """A task around ``net`` whose ``training_step`` runs without a Trainer: logging off, and the
    captioning task's tokenizer (its padding id) where it looks for it."""
    task = cls(net, ADAMW, **kwargs)
    tokenizer = SimpleNamespace(pad_id=PAD)
    task._trainer = SimpleNamespace(log_every_n_steps=0, datamodule=SimpleNamespace(tokenizer=tokenizer))
    return task


def measured(task: Any, batch: Any) -> int:
    """What ``FlopCounterMode`` counts of one training step: forward, loss, backward."""
    counter = FlopCounterMode(display=False)
    with counter:
        task.training_step(batch, 0).backward()
    return counter.get_total_flops()


def assert_counted(task: Any, batch: Any, recomputed: int = 0) -> None:
    """The count of a step within 5% of the measured one, less what the backward recomputes;
    read after the step, as the callback reads it (Flamingo's feature cache says then which
    images it encoded)."""
    expected = measured(task, batch) - recomputed
    items, counted = task.step_work(batch)
    assert int(items) > 0
    assert int(counted.total) == pytest.approx(expected, rel=0.05)


def tokens(b: int, t: int, pad_from: int | None = None) -> torch.Tensor:
    ids = torch.randint(1, V, (b, t))
    if pad_from is not None:
        ids[0, pad_from:] = PAD
    return ids


def images(b: int = 4, side: int = 16, chans: int = 1) -> torch.Tensor:
    return torch.randn(b, chans, side, side)


def vit(num_classes: int = 10, **kwargs: Any) -> VisionTransformer:
    args = dict(patch_size=4, dim=32, depth=2, n_head=2, attn_impl="math") | kwargs
    return VisionTransformer(num_classes, 16, 1, **args)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"attention": "sliding", "window": 8},
        {"attention": "global_local", "window": 8, "n_global": 2},
        {"attention": "linear"},
        {"attention": "linear", "feature_map": "taylor"},
        {"positions": "none"},  # a start token: one more position through the blocks
        {"positions": "t5"},
    ],
    ids=lambda v: "-".join(map(str, v.values())) or "full",
)
def test_gpt_and_its_attention_variants(variant):
    net = GPT(V, max_len=32, depth=2, n_head=2, dim=32, attn_impl="math", **variant)
    x = tokens(3, 32)
    recomputed = 0
    if variant.get("attention") == "linear":  # its chunk sums are checkpointed: redone in the backward
        recomputed = sum(int(flops.scores(block.attn, 3, 32).forward) for block in net.blocks)
    assert_counted(task_of(LanguageModelTask, net), (x, torch.roll(x, -1, 1)), recomputed)


def test_sdpa_adds_only_the_recomputed_scores():
    """Through SDPA, FlopCounterMode also counts the fused backward's recomputation of q k^T:
    the count plus that, exactly."""
    net = GPT(V, max_len=32, depth=2, n_head=2, dim=32, attn_impl="sdpa")
    x = tokens(3, 32)
    task = task_of(LanguageModelTask, net)
    recomputed = 2 * flops.product(3 * 2, 32, 16, 32).forward  # q k^T again, in each of two blocks
    assert task.step_work((x, x))[1].total + recomputed == measured(task, (x, x))


def test_bert_pretraining_counts_the_masked_positions():
    net = BertPreTraining(Bert(V, dim=32, depth=2, n_head=2, max_len=24, attn_impl="math"))
    ids = tokens(4, 24, pad_from=18)
    labels = torch.where(torch.rand(4, 24) < 0.15, ids, -100)
    batch = {
        "ids": ids,
        "segments": torch.zeros_like(ids),
        "mlm_labels": labels,
        "nsp_labels": torch.ones(4).long(),
    }
    assert_counted(task_of(MaskedLMTask, net), batch)


@pytest.mark.parametrize("head", [BertSequenceClassifier, BertTokenClassifier])
def test_bert_classifiers(head):
    net = head(Bert(V, dim=32, depth=2, n_head=2, max_len=24, attn_impl="math"), num_classes=3)
    ids = tokens(4, 24, pad_from=18)
    labels = torch.randint(3, (4,) if head is BertSequenceClassifier else (4, 24))
    assert_counted(
        task_of(TextClassificationTask, net),
        {"ids": ids, "segments": torch.zeros_like(ids), "labels": labels},
    )


def translation_batch() -> dict[str, torch.Tensor]:
    tgt = tokens(4, 19, pad_from=12)
    return {"src": tokens(4, 20, pad_from=14), "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


def test_transformer():
    net = Transformer(V, dim=32, n_head=2, enc_depth=2, dec_depth=2, attn_impl="math")
    assert_counted(task_of(TranslationTask, net), translation_batch())


@pytest.mark.parametrize(("attention", "rnn"), [("additive", "gru"), ("general", "lstm"), ("dot", "gru")])
def test_rnn_seq2seq_bahdanau_and_luong(attention, rnn):
    sizes = (
        {"enc_hidden": 16, "dec_hidden": 32} if attention == "dot" else {"enc_hidden": 24, "dec_hidden": 32}
    )
    net = Seq2Seq(V, attention=attention, rnn=rnn, dim=16, attn_dim=20, enc_depth=2, **sizes)
    assert_counted(task_of(TranslationTask, net), translation_batch())


@pytest.mark.parametrize("stem", ["patch", "conv"])
def test_vit(stem):
    assert_counted(task_of(ImageClassificationTask, vit(stem=stem)), (images(), torch.randint(10, (4,))))


def test_deit_with_its_teachers_forward():
    net = DistilledVisionTransformer(10, 16, 1, patch_size=4, dim=32, depth=2, n_head=2, attn_impl="math")
    teacher = ConvNet(10, 16, 1, widths=(8, 16))
    task = task_of(ImageClassificationTask, net, distillation=HardDistillation(teacher))
    assert_counted(task, (images(), torch.randint(10, (4,))))


def test_swin():
    net = SwinTransformer(
        10, 32, 3, patch_size=2, dim=16, depths=(2, 2), n_head=(2, 4), window_size=4, attn_impl="math"
    )
    assert_counted(task_of(ImageClassificationTask, net), (images(2, 32, 3), torch.randint(10, (2,))))


def test_perceiver():
    net = Perceiver(10, 16, 1, n_latents=8, dim=32, depth=1, repeats=3, n_head=2, attn_impl="math")
    assert_counted(task_of(ImageClassificationTask, net), (images(), torch.randint(10, (4,))))


def test_convnet():
    net = ConvNet(10, 16, 1, widths=(8, 16))
    assert_counted(task_of(ImageClassificationTask, net), (images(), torch.randint(10, (4,))))


def test_timm_models_are_measured_on_the_meta_device():
    net = TimmModel("resnet18", 10, 32, 3)
    assert_counted(task_of(ImageClassificationTask, net), (images(2, 32, 3), torch.randint(10, (2,))))
    assert all(p.device.type == "cpu" for p in net.parameters())  # the net itself untouched


def test_clip():
    text = TextTransformer(V, max_len=12, dim=32, depth=2, n_head=2, attn_impl="math")
    net = CLIP(vit(num_classes=0), text, embed_dim=16)
    assert_counted(task_of(ContrastiveTask, net), (images(), tokens(4, 12, pad_from=8), torch.zeros(4)))


def captions(b: int = 4, t: int = 12) -> torch.Tensor:
    return tokens(b, t, pad_from=9)


def test_show_attend_tell():
    net = ShowAttendTell(V, 16, 1, enc_dim=32, enc_depth=2, dim=16, hidden=32, attn_dim=16)
    assert_counted(task_of(CaptioningTask, net), {"image": images(), "tokens": captions()})


@pytest.mark.parametrize("feature_cache", [0, 100])
def test_flamingo_frozen_parts_and_feature_cache(feature_cache):
    """The frozen encoder runs forward only, and not at all for the images its cache holds; the
    frozen GPT passes gradients back to the gated blocks but computes none for its weights."""
    lm = partial(GPT, max_len=16, depth=2, n_head=2, dim=32, attn_impl="math")
    net = Flamingo(
        partial(ConvNet, 0, widths=(8, 16)), lm, V, 16, 1, n_latents=4, n_head=2, feature_cache=feature_cache
    )
    task = task_of(CaptioningTask, net, attention_reg=0.0)
    batch = {"image": images(), "tokens": captions()}
    task.training_step(batch, 0)  # the cache fills
    assert_counted(task, batch)

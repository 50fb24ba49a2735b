"""The declared contracts (``attnlab.models.contracts``): every decoder, image backbone and
attention-map net follows its Protocol, and the searches written once against ``Decoder`` decode
what recomputing the whole sequence at every step decodes."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from attnlab.inference.decoding import beam_search, generate, greedy_decode
from attnlab.models import (
    GPT,
    ConvNet,
    DistilledVisionTransformer,
    Flamingo,
    Perceiver,
    Seq2Seq,
    ShowAttendTell,
    SwinTransformer,
    TimmModel,
    Transformer,
    VisionTransformer,
)
from attnlab.models.contracts import (
    Alignments,
    Captioner,
    Decoder,
    DistillationHeads,
    ImageBackbone,
    PatchAttention,
)

V, PAD, BOS, EOS = 30, 0, 1, 2


def decoders() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    vision = partial(VisionTransformer, num_classes=0, patch_size=4, dim=16, depth=1, n_head=2)
    lm = partial(GPT, max_len=16, depth=2, n_head=2, dim=16)
    return {
        "gpt": GPT(V, max_len=16, depth=2, n_head=2, dim=16),
        "seq2seq": Seq2Seq(V, PAD, dim=16, enc_hidden=16, dec_hidden=16, attn_dim=16),
        "transformer": Transformer(V, PAD, dim=16, n_head=2, enc_depth=1, dec_depth=1, max_len=32),
        "show_attend_tell": ShowAttendTell(V, 16, 1, enc_dim=8, enc_depth=2, dim=8, hidden=8, attn_dim=8),
        "flamingo": Flamingo(vision, lm, V, 16, 1, n_latents=2, resampler_depth=1, n_head=2),
    }


def backbones() -> dict[str, torch.nn.Module]:
    return {
        "vit": VisionTransformer(10, 16, 1, patch_size=4, dim=16, depth=1, n_head=2),
        "deit": DistilledVisionTransformer(10, 16, 1, patch_size=4, dim=16, depth=1, n_head=2),
        "swin": SwinTransformer(10, 16, 1, 2, 8, [1, 1], [1, 2], 4),
        "perceiver": Perceiver(10, 16, 1, n_latents=4, dim=16, depth=1, repeats=1, n_head=2),
        "convnet": ConvNet(10, 16, 1, widths=(8, 16)),
        "timm": TimmModel("resnet18", 10, 16, 1),
    }


def test_every_decoder_follows_the_decoder_contract():
    nets = decoders()
    assert all(isinstance(net, Decoder) for net in nets.values())
    assert {name for name, net in nets.items() if isinstance(net, Captioner)} == {
        "show_attend_tell",
        "flamingo",
    }
    assert {name for name, net in nets.items() if isinstance(net, Alignments)} == {"seq2seq", "transformer"}


def test_every_image_backbone_follows_its_contract():
    nets = backbones()
    images = torch.randn(2, 1, 16, 16)
    for name, net in nets.items():
        assert isinstance(net, ImageBackbone), name
        pooled = net.eval().forward_head(net.forward_features(images), pre_logits=True)
        assert pooled.shape == (2, net.num_features), name
        assert not isinstance(net, Decoder), name
    assert {n for n, net in nets.items() if isinstance(net, PatchAttention)} == {
        "vit",
        "deit",
        "swin",
        "perceiver",
    }
    assert {n for n, net in nets.items() if isinstance(net, DistillationHeads)} == {"deit"}


def recomputed_greedy(net: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation without the contract: the whole window through ``forward`` each time."""
    for _ in range(n):
        idx = torch.cat([idx, net(idx[:, -net.max_len :])[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@torch.no_grad()
def test_greedy_sampling_through_the_contract_equals_recomputing():
    """Past max_len too, where GPT's window slides and its caches are rebuilt."""
    net = decoders()["gpt"].eval()
    prompt = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(net, prompt, 20, temperature=0), recomputed_greedy(net, prompt, 20))


@torch.no_grad()
def test_greedy_decode_through_the_contract_equals_teacher_forced_argmax():
    """An encoder-decoder: each greedy token is the argmax of a full teacher-forced pass over the
    tokens chosen so far; beam search with one beam picks the same."""
    net = decoders()["transformer"].eval()
    src = torch.randint(3, V, (3, 6), generator=torch.Generator().manual_seed(2))
    ids = greedy_decode(net, src, BOS, EOS, max_len=8)
    tokens = torch.full((3, 1), BOS)
    for _ in range(8):
        tokens = torch.cat([tokens, net(src, tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected = [row[: row.index(EOS)] if EOS in row else row for row in tokens[:, 1:].tolist()]
    assert ids == expected
    assert beam_search(net, src, BOS, EOS, max_len=8, beam_size=1) == expected


@pytest.mark.parametrize("name", ["seq2seq", "show_attend_tell", "flamingo"])
@torch.no_grad()
def test_reorder_then_step_equals_stepping_the_kept_rows(name: str):
    """The contract's reorder keeps rows: stepping a reordered state gives the logits of those rows."""
    net = decoders()[name].eval()
    src = torch.randint(3, V, (3, 5)) if name == "seq2seq" else torch.randn(3, 1, 16, 16)
    tokens = torch.full((3,), BOS)
    logits, state = net.step(tokens, net.start(src))
    index = torch.tensor([2, 2, 0])
    kept, _ = net.step(logits.argmax(-1)[index], net.reorder(state, index))
    again, _ = net.step(logits.argmax(-1), net.step(tokens, net.start(src))[1])
    torch.testing.assert_close(kept, again[index])

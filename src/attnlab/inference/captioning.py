"""Captioning images with a trained captioner (the ``Captioner`` contract): greedy or beam search
(``attnlab.inference.decoding``, the translation's), and the attention each word of the caption
paid to the image.

The attention of the chosen words comes from one teacher-forced pass over them afterwards (the
net's ``forward``), which gives the step-by-step weights exactly (``tests/test_captioning.py``):
no search has to carry a map per hypothesis.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.inference.decoding import beam_search, greedy_decode
from attnlab.models.contracts import Captioner


@torch.no_grad()
def caption_batch(
    net: Captioner,
    images: Tensor,
    bos: int,
    eos: int,
    max_len: int,
    beam_size: int = 1,
    alpha: float = 0.0,
) -> list[tuple[list[int], Tensor]]:
    """Per image of (B, C, H, W) normalised ``images``: the caption's tokens (without BOS and EOS,
    at most ``max_len``) and the (L, S) attention each of its L words paid to the image's S
    positions. ``beam_size`` 1 is greedy decoding; beams rank finished captions by log-probability
    over GNMT's length penalty of ``alpha`` (0: total log-probability)."""
    if beam_size == 1:
        ids = greedy_decode(net, images, bos, eos, max_len)
    else:
        ids = beam_search(net, images, bos, eos, max_len, beam_size, alpha)
    return list(zip(ids, word_attention(net, images, ids, bos), strict=True))


def word_attention(net: Captioner, images: Tensor, captions: list[list[int]], bos: int) -> list[Tensor]:
    """The (L, S) attention of each caption's L words, by teacher forcing ``[BOS] + caption``."""
    longest = max((len(c) for c in captions), default=0)
    tokens = torch.full((len(captions), longest + 1), bos, dtype=torch.long, device=images.device)
    for i, c in enumerate(captions):  # after a caption's end: BOS, read by no step that is kept
        tokens[i, 1 : len(c) + 1] = torch.tensor(c, dtype=torch.long)
    _, attn = net(images, tokens)  # (B, T, S)
    return [attn[i, : len(c)].float().cpu() for i, c in enumerate(captions)]

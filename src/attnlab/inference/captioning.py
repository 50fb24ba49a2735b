"""Captioning images with a trained ``Captioner``, with each word's attention."""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.inference.decoding import decode
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
    """Per image: the caption's tokens (no BOS/EOS, at most ``max_len``) and its words' (L, S)
    attention; beams ranked with GNMT's length penalty ``alpha``."""
    ids = decode(net, images, bos, eos, max_len, beam_size, alpha)
    return list(zip(ids, word_attention(net, images, ids, bos), strict=True))


def word_attention(net: Captioner, images: Tensor, captions: list[list[int]], bos: int) -> list[Tensor]:
    """The (L, S) attention of each caption's L words, from one teacher-forced pass."""
    longest = max((len(c) for c in captions), default=0)
    tokens = torch.full((len(captions), longest + 1), bos, dtype=torch.long, device=images.device)
    for i, c in enumerate(captions):  # after a caption's end: BOS, read by no step that is kept
        tokens[i, 1 : len(c) + 1] = torch.tensor(c, dtype=torch.long)
    _, attn = net(images, tokens)  # (B, T, S)
    return [attn[i, : len(c)].float().cpu() for i, c in enumerate(captions)]

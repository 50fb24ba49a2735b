"""Captioning images with a trained ``Captioner``, with each word's attention."""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.data.batching import pad
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
    # padded with BOS after a caption's end: read by no step that is kept
    _, attn = net(images, pad([[bos, *c] for c in captions], bos).to(images.device))  # (B, T, S)
    return [attn[i, : len(c)].float().cpu() for i, c in enumerate(captions)]

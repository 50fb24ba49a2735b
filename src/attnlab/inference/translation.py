"""Translating raw sentences with a trained encoder-decoder."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from attnlab.data.batching import TokenBatchSampler, pad
from attnlab.data.text.tokenizers import SubwordTokenizer
from attnlab.inference.decoding import translate_batch

log = logging.getLogger(__name__)


@torch.no_grad()
def translate_sentences(
    net: nn.Module,
    tokenizer: SubwordTokenizer,
    sentences: list[str],
    beam_size: int = 5,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    max_src_len: int = 128,
    max_tokens: int = 8192,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Translations of ``sentences``, in order, sources cut to ``max_src_len`` tokens; ``progress(n)``
    as each batch of ``n`` is done."""
    ids = tokenizer.encode_batch(sentences)
    long = sum(len(s) > max_src_len - 1 for s in ids)
    if long:
        log.warning("truncated %d of %d sentences to %d tokens", long, len(ids), max_src_len)
    ids = [s[: max_src_len - 1] + [tokenizer.eos_id] for s in ids]
    out: list[str] = [""] * len(ids)
    for batch in TokenBatchSampler([len(s) for s in ids], max_tokens, shuffle=False):
        src = pad([ids[i] for i in batch], tokenizer.pad_id).to(device)
        special = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
        hyps = translate_batch(net, src, *special, beam_size, length_penalty, max_len_a, max_len_b)
        for i, h in zip(batch, hyps, strict=True):
            out[i] = tokenizer.decode(h)
        if progress is not None:
            progress(len(batch))
    return out

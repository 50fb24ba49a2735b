"""Filling masks and classifying sentences with trained BERT runs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from attnlab.core.errors import DataError
from attnlab.data.batching import pad
from attnlab.data.text.tokenizers import WordPieceTokenizer

MASK = "[MASK]"


def encode_sentence(tokenizer: WordPieceTokenizer, text: str, max_len: int) -> list[int]:
    """``[CLS] text [SEP]`` cut to ``max_len`` tokens. ``[MASK]`` in the text becomes the mask
    token (WordPiece alone would split it into "[", "mask", "]")."""
    ids = [tokenizer.cls_id]
    for k, part in enumerate(text.split(MASK)):
        if k:
            ids.append(tokenizer.mask_id)
        ids += tokenizer.encode(part)
    return ids[: max_len - 1] + [tokenizer.sep_id]


@torch.no_grad()
def fill_mask(
    net: nn.Module, tokenizer: WordPieceTokenizer, text: str, top_k: int, max_len: int
) -> list[list[tuple[str, float]]]:
    """For each ``[MASK]`` in ``text``, the ``top_k`` most likely tokens and their probabilities."""
    if MASK not in text:
        raise DataError(f"text={text!r} has no {MASK} to fill")
    ids = torch.tensor([encode_sentence(tokenizer, text, max_len)], device=next(net.parameters()).device)
    masked = ids == tokenizer.mask_id
    if not masked.any():
        raise DataError(f"text={text!r}: every {MASK} lies beyond the model's {max_len} tokens")
    logits, _ = net(ids, torch.zeros_like(ids), masked)  # (N, V)
    probs = logits.float().softmax(-1)
    specials = [getattr(tokenizer, f"{s}_id") for s in ("pad", "unk", "cls", "sep", "mask")]
    probs[:, specials] = 0.0  # a filling is a word piece, not a special
    top = probs.topk(min(top_k, probs.size(-1)), dim=-1)
    return [
        [(tokenizer.token(i), p) for i, p in zip(ix.tolist(), pv.tolist(), strict=True)]
        for ix, pv in zip(top.indices, top.values, strict=True)
    ]


@torch.no_grad()
def classify_sentences(
    net: nn.Module,
    tokenizer: WordPieceTokenizer,
    sentences: list[str],
    classes: list[str],
    max_len: int,
    batch_size: int = 64,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[str, float]]:
    """The most likely class of each sentence and its probability; ``progress(n)`` as each batch of
    ``n`` is done."""
    out: list[tuple[str, float]] = []
    for start in range(0, len(sentences), batch_size):
        rows = [encode_sentence(tokenizer, s, max_len) for s in sentences[start : start + batch_size]]
        ids = pad(rows, tokenizer.pad_id).to(next(net.parameters()).device)
        probs = net(ids, torch.zeros_like(ids)).float().softmax(-1)
        p, k = probs.max(-1)
        out += [(classes[i], v) for i, v in zip(k.tolist(), p.tolist(), strict=True)]
        if progress is not None:
            progress(len(rows))
    return out

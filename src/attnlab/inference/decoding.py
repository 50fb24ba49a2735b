"""Greedy and batched beam-search decoding for encoder-decoder models (used by the translation
task's validation and test, and by ``attnlab-translate``).

A model decodes through three methods: ``start(src) -> state``, ``step(tokens, state) ->
logits`` (the next-token logits (B, V) after the newest tokens (B,)) and ``reorder(state,
index)`` (keep the rows at ``index``). ``Transformer`` and ``Seq2Seq`` both provide them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def max_output_len(src: Tensor, pad_id: int, a: float, b: int, cap: int) -> int:
    """Longest output allowed for this batch: ``a * longest source + b``, at most ``cap``."""
    longest = int((src != pad_id).sum(1).max())
    return max(1, min(cap, int(a * longest + b)))


@torch.no_grad()
def greedy_decode(net: nn.Module, src: Tensor, bos: int, eos: int, max_len: int) -> list[list[int]]:
    """The most likely next token at each step, until <eos> or ``max_len`` tokens."""
    b = src.size(0)
    state = net.start(src)
    tokens = torch.full((b,), bos, dtype=torch.long, device=src.device)
    out = torch.zeros(b, 0, dtype=torch.long, device=src.device)
    done = torch.zeros(b, dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        tokens = net.step(tokens, state).argmax(-1)
        out = torch.cat([out, tokens[:, None]], dim=1)
        done |= tokens == eos
        if done.all():
            break
    return [_until_eos(row, eos) for row in out.tolist()]


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ((5 + |Y|) / 6)^alpha; alpha 0 ranks hypotheses by total log-probability."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(
    net: nn.Module, src: Tensor, bos: int, eos: int, max_len: int, beam_size: int = 5, alpha: float = 1.0
) -> list[list[int]]:
    """Batched beam search; returns the best hypothesis of each source, without <eos>.

    Each step extends the ``beam_size`` live hypotheses of every sentence by the ``2 * beam_size``
    best (hypothesis, token) pairs; those ending in <eos> among the top ``beam_size`` are set
    aside as finished (scored with the length penalty), the best ``beam_size`` others live on.
    A sentence is done when it has ``beam_size`` finished hypotheses. With ``beam_size=1`` this
    is exactly greedy decoding.
    """
    b, k, dev = src.size(0), beam_size, src.device
    state = net.start(src)
    net.reorder(state, torch.arange(b, device=dev).repeat_interleave(k))
    scores = torch.full((b, k), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # all beams start identical: keep one
    seqs = torch.zeros(b, k, 0, dtype=torch.long, device=dev)
    tokens = torch.full((b * k,), bos, dtype=torch.long, device=dev)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    for t in range(max_len):
        logp = torch.log_softmax(net.step(tokens, state).float(), dim=-1)  # (B*K, V)
        v = logp.size(-1)
        cand = (scores[:, :, None] + logp.view(b, k, v)).view(b, k * v)
        top_scores, top_idx = cand.topk(2 * k, dim=1)  # (B, 2K)
        top_beam, top_tok = top_idx // v, top_idx % v
        is_eos = top_tok == eos
        for i, j in (is_eos[:, :k] & torch.isfinite(top_scores[:, :k])).nonzero().tolist():
            if len(finished[i]) < k:
                hyp = seqs[i, top_beam[i, j]].tolist()
                finished[i].append((top_scores[i, j].item() / length_penalty(t + 1, alpha), hyp))
        # live on: the best k candidates not ending in <eos> (at most k of the 2k do)
        alive = top_scores.masked_fill(is_eos, float("-inf"))
        scores, pick = alive.topk(k, dim=1)  # (B, K)
        beam = top_beam.gather(1, pick)
        tokens = top_tok.gather(1, pick)
        kept = seqs.gather(1, beam[:, :, None].expand(-1, -1, seqs.size(2)))  # (B, K, t)
        seqs = torch.cat([kept, tokens[:, :, None]], dim=2)
        net.reorder(state, (beam + torch.arange(b, device=dev)[:, None] * k).view(-1))
        tokens = tokens.view(-1)
        if all(len(f) >= k for f in finished):
            break
    for i in range(b):  # sentences that ran out of length: their live hypotheses count too
        if len(finished[i]) < k:
            for j in range(k):
                if torch.isfinite(scores[i, j]):
                    finished[i].append(
                        (scores[i, j].item() / length_penalty(seqs.size(2), alpha), seqs[i, j].tolist())
                    )
    return [max(f, key=lambda x: x[0])[1] for f in finished]


def translate_batch(
    net: nn.Module,
    src: Tensor,
    pad: int,
    bos: int,
    eos: int,
    beam_size: int = 1,
    alpha: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
) -> list[list[int]]:
    """Greedy (``beam_size`` 1) or beam-search translations of a padded source batch (B, S), at
    most ``a * source length + b`` tokens long and within the positions the model has."""
    cap = getattr(net, "max_len", 256) - 1
    max_len = max_output_len(src, pad, max_len_a, max_len_b, cap)
    if beam_size == 1:
        return greedy_decode(net, src, bos, eos, max_len)
    return beam_search(net, src, bos, eos, max_len, beam_size, alpha)

"""Greedy decoding, batched beam search and sampling, written once against the ``Decoder`` contract
(``start``, ``step``, ``reorder``) that every decoder follows."""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.models.contracts import Decoder


@torch.no_grad()
def greedy_decode(net: Decoder, src: Tensor, bos: int, eos: int, max_len: int) -> list[list[int]]:
    """The most likely next token at each step, until <eos> or ``max_len`` tokens."""
    b = src.size(0)
    state = net.start(src)
    tokens = torch.full((b,), bos, dtype=torch.long, device=src.device)
    out = torch.zeros(b, 0, dtype=torch.long, device=src.device)
    done = torch.zeros(b, dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        logits, state = net.step(tokens, state)
        tokens = logits.argmax(-1)
        out = torch.cat([out, tokens[:, None]], dim=1)
        done |= tokens == eos
        if done.all():
            break
    return [row[: row.index(eos)] if eos in row else row for row in out.tolist()]


def decode(
    net: Decoder, src: Tensor, bos: int, eos: int, max_len: int, beam_size: int = 1, alpha: float = 1.0
) -> list[list[int]]:
    """``greedy_decode`` (``beam_size`` 1) or ``beam_search``."""
    if beam_size == 1:
        return greedy_decode(net, src, bos, eos, max_len)
    return beam_search(net, src, bos, eos, max_len, beam_size, alpha)


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ((5 + |Y|) / 6)^alpha; alpha 0 ranks hypotheses by total log-probability."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(
    net: Decoder, src: Tensor, bos: int, eos: int, max_len: int, beam_size: int = 5, alpha: float = 1.0
) -> list[list[int]]:
    """Each source's best hypothesis (without <eos>), finished ones scored with GNMT's length penalty."""
    b, k = src.size(0), beam_size
    dev = src.device
    state = net.reorder(net.start(src), torch.arange(b, device=dev).repeat_interleave(k))
    scores = torch.full((b, k), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # all beams start identical: keep one
    seqs = torch.zeros(b, k, 0, dtype=torch.long, device=dev)
    tokens = torch.full((b * k,), bos, dtype=torch.long, device=dev)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    for t in range(max_len):
        logits, state = net.step(tokens, state)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B*K, V)
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
        state = net.reorder(state, (beam + torch.arange(b, device=dev)[:, None] * k).view(-1))
        tokens = tokens.view(-1)
        if all(len(f) >= k for f in finished):
            break
    penalty = length_penalty(seqs.size(2), alpha)
    for i in range(b):  # sentences that ran out of length: their live hypotheses count too
        if len(finished[i]) < k:
            live = [j for j in range(k) if torch.isfinite(scores[i, j])]
            finished[i] += [(scores[i, j].item() / penalty, seqs[i, j].tolist()) for j in live]
    return [max(f, key=lambda x: x[0])[1] for f in finished]


def translate_batch(
    net: Decoder,
    src: Tensor,
    pad: int,
    bos: int,
    eos: int,
    beam_size: int = 1,
    alpha: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
) -> list[list[int]]:
    """Translations of a padded source batch (B, S), at most ``a * longest source + b`` tokens long
    and within the positions the model has."""
    cap = getattr(net, "max_len", 256) - 1
    max_len = max(1, min(cap, int(max_len_a * int((src != pad).sum(1).max()) + max_len_b)))
    return decode(net, src, bos, eos, max_len, beam_size, alpha)


@torch.no_grad()
def generate(
    net: Decoder,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``idx`` (B, T) and ``max_new_tokens`` sampled tokens (``use_cache`` False: window recomputed)."""
    state = net.start(idx[:, :-1], use_cache=use_cache)
    tokens = idx[:, -1]
    for _ in range(max_new_tokens):
        logits, state = net.step(tokens, state)
        tokens = sample_next(logits, temperature, top_k, top_p, generator)[:, 0]
        idx = torch.cat([idx, tokens[:, None]], dim=1)
    return idx


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample one token id per row of ``logits`` (B, V), (B, 1); temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token once the ones before it already cover top_p (always keep the first)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)

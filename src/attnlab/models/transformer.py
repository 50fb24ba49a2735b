"""The Transformer encoder-decoder of "Attention is all you need" (Vaswani et al. 2017).

Post-LN as in the paper (``norm_first=False``) or pre-LN; sinusoidal or learned positions;
embeddings optionally shared between source, target and output (a joint vocabulary).
The decoding interface (``start`` / ``step`` / ``reorder``) is what greedy and beam search use.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import ConfigError
from attnlab.nn.attention import AttentionImpl, KVCache, MultiHeadAttention
from attnlab.nn.dropout import Dropout


class SinusoidalPositions(nn.Module):
    """Fixed sin/cos position encodings: PE[pos, 2i] = sin(pos / 10000^(2i/d)), cos for 2i+1."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        pos = torch.arange(max_len)[:, None]
        freq = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, t: int, start: int = 0) -> Tensor:
        return self.pe[start : start + t]  # (T, C)


class LearnedPositions(nn.Module):
    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(max_len, d_model)

    def forward(self, t: int, start: int = 0) -> Tensor:
        return self.emb(torch.arange(start, start + t, device=self.emb.weight.device))


class FeedForward(nn.Module):
    """Position-wise ReLU MLP. No dropout inside: the paper drops only sub-layer outputs and
    the embeddings."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Residual(nn.Module):
    """x + dropout(f(norm(x))) for pre-LN, norm(x + dropout(f(x))) for post-LN."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.norm, self.drop, self.norm_first = nn.LayerNorm(d_model), Dropout(dropout), norm_first

    def forward(self, x: Tensor, f: Any) -> tuple[Tensor, Any]:
        y, extra = f(self.norm(x) if self.norm_first else x)
        x = x + self.drop(y)
        return (x if self.norm_first else self.norm(x)), extra


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float, attn_dropout: float,
                 norm_first: bool, attn_impl: AttentionImpl) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_head, attn_dropout, impl=attn_impl)
        self.ff = FeedForward(d_model, d_ff)
        self.res1 = Residual(d_model, dropout, norm_first)
        self.res2 = Residual(d_model, dropout, norm_first)

    def forward(self, x: Tensor, src_pad: Tensor) -> Tensor:
        x, _ = self.res1(x, lambda h: self.self_attn(h, key_padding_mask=src_pad))
        x, _ = self.res2(x, lambda h: (self.ff(h), None))
        return x


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float, attn_dropout: float,
                 norm_first: bool, attn_impl: AttentionImpl) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_head, attn_dropout, impl=attn_impl)
        self.cross_attn = MultiHeadAttention(d_model, n_head, attn_dropout, impl=attn_impl)
        self.ff = FeedForward(d_model, d_ff)
        self.res1 = Residual(d_model, dropout, norm_first)
        self.res2 = Residual(d_model, dropout, norm_first)
        self.res3 = Residual(d_model, dropout, norm_first)

    def forward(self, x: Tensor, memory: Tensor, src_pad: Tensor, cache: KVCache | None = None,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Returns the new states and, with ``need_weights``, the cross-attention (B, H, T, S)."""
        x, _ = self.res1(x, lambda h: self.self_attn(h, causal=True, cache=cache))
        x, weights = self.res2(x, lambda h: self.cross_attn(
            h, memory, key_padding_mask=src_pad, need_weights=need_weights))
        x, _ = self.res3(x, lambda h: (self.ff(h), None))
        return x, weights


class Transformer(nn.Module):
    """Encoder-decoder Transformer over a joint vocabulary.

    Args:
        vocab_size, pad_id: from the data's tokenizer.
        d_model, n_head, d_ff: width, heads and feed-forward width.
        n_enc_layers, n_dec_layers: depth of each stack.
        dropout: on embeddings and residual branches.
        attn_dropout: on the attention weights.
        norm_first: pre-LN (True) or the paper's post-LN (False).
        positions: "sinusoidal" (the paper) or "learned".
        max_len: longest sequence the positions cover.
        share_embeddings: one embedding matrix for source, target and the output layer.
        attn_impl: "auto", "sdpa" or "math" (see ``attnlab.nn.attention``).
    """

    def __init__(
        self,
        vocab_size: int,
        pad_id: int = 0,
        d_model: int = 256,
        n_head: int = 8,
        n_enc_layers: int = 3,
        n_dec_layers: int = 3,
        d_ff: int = 1024,
        dropout: float = 0.1,
        attn_dropout: float = 0.0,
        norm_first: bool = False,
        positions: str = "sinusoidal",
        max_len: int = 256,
        share_embeddings: bool = True,
        attn_impl: AttentionImpl = "auto",
    ) -> None:
        super().__init__()
        if positions not in ("sinusoidal", "learned"):
            raise ConfigError(f"model.net.positions must be 'sinusoidal' or 'learned', got {positions!r}")
        for name, v in [("vocab_size", vocab_size), ("d_ff", d_ff), ("max_len", max_len),
                        ("n_enc_layers", n_enc_layers), ("n_dec_layers", n_dec_layers)]:
            if v <= 0:
                raise ConfigError(f"model.net.{name} must be positive, got {v}")
        self.pad_id, self.d_model, self.max_len = pad_id, d_model, max_len
        self.src_emb = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.tgt_emb = (
            self.src_emb if share_embeddings else nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        )
        pos_cls = SinusoidalPositions if positions == "sinusoidal" else LearnedPositions
        self.pos = pos_cls(d_model, max_len)
        self.drop = Dropout(dropout)
        args = (d_model, n_head, d_ff, dropout, attn_dropout, norm_first, attn_impl)
        self.encoder = nn.ModuleList(EncoderLayer(*args) for _ in range(n_enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(*args) for _ in range(n_dec_layers))
        # pre-LN stacks end un-normalised; post-LN layers already end with a norm
        self.enc_norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()
        self.out = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights()
        if share_embeddings:
            self.out.weight = self.tgt_emb.weight

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1 and "emb" not in name:
                nn.init.xavier_uniform_(p)
        for emb in {self.src_emb, self.tgt_emb}:
            # scaled by sqrt(d) in _embed, so the inputs start at unit scale
            nn.init.normal_(emb.weight, std=self.d_model**-0.5)
            with torch.no_grad():
                emb.weight[self.pad_id].zero_()

    def _embed(self, emb: nn.Embedding, tokens: Tensor, start: int = 0) -> Tensor:
        t = tokens.size(1)
        if start + t > self.max_len:
            raise ValueError(
                f"sequence of {start + t} tokens is longer than model.net.max_len={self.max_len}"
            )
        return self.drop(emb(tokens) * math.sqrt(self.d_model) + self.pos(t, start))

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """Source ids (B, S) -> memory (B, S, C) and its padding mask (B, S), True at padding."""
        src_pad = src == self.pad_id
        x = self._embed(self.src_emb, src)
        for layer in self.encoder:
            x = layer(x, src_pad)
        return self.enc_norm(x), src_pad

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor, caches: list[KVCache] | None = None,
               start: int = 0, need_weights: bool = False) -> tuple[Tensor, list[Tensor]]:
        """Target ids (B, T) -> decoder states (B, T, C), which ``self.out`` maps to logits, and,
        with ``need_weights``, the cross-attention of each layer."""
        x = self._embed(self.tgt_emb, tgt_in, start)
        weights = []
        for i, layer in enumerate(self.decoder):
            x, w = layer(x, memory, src_pad, None if caches is None else caches[i], need_weights)
            if w is not None:
                weights.append(w)
        return self.dec_norm(x), weights

    def forward(self, src: Tensor, tgt_in: Tensor, scored: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V), or (N, V) at the N positions where ``scored`` (B, T)
        is True: skipping padding saves much of the output layer and the loss."""
        memory, src_pad = self.encode(src)
        x, _ = self.decode(tgt_in, memory, src_pad)
        return self.out(x if scored is None else x[scored])

    def alignments(self, src: Tensor, tgt_in: Tensor) -> dict[str, Tensor]:
        """Cross-attention weights (B, H, T, S) of every decoder layer, for plots."""
        memory, src_pad = self.encode(src)
        _, weights = self.decode(tgt_in, memory, src_pad, need_weights=True)
        return {f"layer {i}": w for i, w in enumerate(weights)}

    # -- incremental decoding -------------------------------------------------------------------
    def start(self, src: Tensor) -> dict[str, Any]:
        memory, src_pad = self.encode(src)
        return {"memory": memory, "src_pad": src_pad, "caches": [KVCache() for _ in self.decoder], "t": 0}

    def step(self, tokens: Tensor, state: dict[str, Any]) -> Tensor:
        """Logits (B, V) of the next token after ``tokens`` (B,), the newest output; updates ``state``."""
        memory, src_pad = state["memory"], state["src_pad"]
        x, _ = self.decode(tokens[:, None], memory, src_pad, state["caches"], state["t"])
        state["t"] += 1
        return self.out(x[:, -1])

    def reorder(self, state: dict[str, Any], index: Tensor) -> None:
        """Keep the hypotheses at ``index`` (beam search)."""
        state["memory"] = state["memory"][index]
        state["src_pad"] = state["src_pad"][index]
        for c in state["caches"]:
            if c.k is not None:
                c.k, c.v = c.k[index], c.v[index]

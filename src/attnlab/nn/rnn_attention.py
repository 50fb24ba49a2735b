"""Attention for RNN encoder-decoders: a query (B, Q) over keys (B, S, K) with a padding mask (B, S),
True at padding, gives the context (B, K) and the weights (B, S). Additive (Bahdanau et al. 2015):
v^T tanh(W s + U h); multiplicative (Luong et al. 2015): "general" s^T W h or "dot" s^T h."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _RNNAttention(nn.Module):
    def prepare(self, keys: Tensor) -> Tensor:
        """The keys' projection (B, S, A): computed once per source, not once per output step."""
        return self.key_proj(keys)

    def forward(
        self, query: Tensor, keys: Tensor, pad: Tensor, prepared: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        scores = self.score(query, self.prepare(keys) if prepared is None else prepared)  # (B, S)
        weights = F.softmax(scores.masked_fill(pad, float("-inf")), dim=-1)  # (B, S)
        return torch.bmm(weights[:, None, :], keys).squeeze(1), weights  # (B, K)


class AdditiveAttention(_RNNAttention):
    def __init__(self, query_dim: int, key_dim: int, attn_dim: int) -> None:
        super().__init__()
        self.query_proj = nn.Linear(query_dim, attn_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, attn_dim, bias=True)
        self.v = nn.Linear(attn_dim, 1, bias=False)

    def score(self, query: Tensor, uh: Tensor) -> Tensor:
        return self.v(torch.tanh(self.query_proj(query)[:, None, :] + uh)).squeeze(-1)


class MultiplicativeAttention(_RNNAttention):
    def __init__(self, query_dim: int, key_dim: int, kind: Literal["general", "dot"] = "general") -> None:
        super().__init__()
        if kind == "dot" and query_dim != key_dim:
            raise ValueError(
                f"dot attention needs the decoder state size ({query_dim}) to equal the encoder "
                f"output size ({key_dim}); use 'general' or change the sizes"
            )
        self.kind = kind
        self.key_proj = nn.Linear(key_dim, query_dim, bias=False) if kind == "general" else nn.Identity()

    def score(self, query: Tensor, wh: Tensor) -> Tensor:
        return torch.bmm(wh, query[:, :, None]).squeeze(-1)

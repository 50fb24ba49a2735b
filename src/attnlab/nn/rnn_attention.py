"""Attention for RNN encoder-decoders: one decoder state attends over all encoder states.

- ``AdditiveAttention`` (Bahdanau et al. 2015): score(s, h) = v^T tanh(W s + U h).
- ``MultiplicativeAttention`` (Luong et al. 2015): "general" score(s, h) = s^T W h, or "dot"
  score(s, h) = s^T h (needs equal sizes).

Both take a query (B, Q), keys (B, S, K) and a mask (B, S), True at padding, and return the
context (B, K) and the weights (B, S), which sum to one and are zero at padding.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _attend(scores: Tensor, values: Tensor, pad: Tensor) -> tuple[Tensor, Tensor]:
    weights = F.softmax(scores.masked_fill(pad, float("-inf")), dim=-1)  # (B, S)
    context = torch.bmm(weights[:, None, :], values).squeeze(1)  # (B, K)
    return context, weights


class AdditiveAttention(nn.Module):
    def __init__(self, query_dim: int, key_dim: int, attn_dim: int) -> None:
        super().__init__()
        self.query_proj = nn.Linear(query_dim, attn_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, attn_dim, bias=True)
        self.v = nn.Linear(attn_dim, 1, bias=False)

    def prepare(self, keys: Tensor) -> Tensor:
        """U h for every key (B, S, A): computed once per source, not once per output step."""
        return self.key_proj(keys)

    def forward(
        self, query: Tensor, keys: Tensor, pad: Tensor, prepared: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        uh = self.prepare(keys) if prepared is None else prepared
        scores = self.v(torch.tanh(self.query_proj(query)[:, None, :] + uh)).squeeze(-1)  # (B, S)
        return _attend(scores, keys, pad)


class MultiplicativeAttention(nn.Module):
    def __init__(self, query_dim: int, key_dim: int, kind: Literal["general", "dot"] = "general") -> None:
        super().__init__()
        if kind == "dot" and query_dim != key_dim:
            raise ValueError(
                f"dot attention needs the decoder state size ({query_dim}) to equal the encoder "
                f"output size ({key_dim}); use 'general' or change the sizes"
            )
        self.kind = kind
        self.key_proj = nn.Linear(key_dim, query_dim, bias=False) if kind == "general" else nn.Identity()

    def prepare(self, keys: Tensor) -> Tensor:
        """W h for every key (B, S, Q): computed once per source."""
        return self.key_proj(keys)

    def forward(
        self, query: Tensor, keys: Tensor, pad: Tensor, prepared: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        wh = self.prepare(keys) if prepared is None else prepared
        scores = torch.bmm(wh, query[:, :, None]).squeeze(-1)  # (B, S)
        return _attend(scores, keys, pad)

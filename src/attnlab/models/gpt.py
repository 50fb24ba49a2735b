"""GPT: a decoder-only Transformer language model (Radford et al. 2018/2019).

Laid out like nanoGPT's ``model.py`` (token + learned position embeddings, pre-LN blocks,
GELU MLP, tied input/output embeddings); the attention is ``attnlab.nn.MultiHeadAttention``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.errors import ConfigError
from attnlab.nn import KVCache, MultiHeadAttention
from attnlab.nn.attention import AttentionImpl


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN Transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float, bias: bool, attn_impl: AttentionImpl
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = MultiHeadAttention(n_embd, n_head, dropout=dropout, bias=bias, impl=attn_impl)
        self.attn_dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        y, _ = self.attn(self.ln_1(x), causal=True, cache=cache)
        x = x + self.attn_dropout(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Causal language model over a vocabulary of ``vocab_size`` tokens.

    Args:
        vocab_size: number of token ids (filled in from the data's tokenizer when left ``???``).
        block_size: longest context the model sees (learned positions).
        n_layer: number of blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: model width.
        dropout: dropout on embeddings, attention weights and residual branches.
        bias: biases in Linear and LayerNorm layers (nanoGPT's char recipe uses none).
        attn_impl: "auto", "sdpa" or "math" attention (see ``attnlab.nn.attention``).
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = False,
        attn_impl: AttentionImpl = "auto",
    ) -> None:
        super().__init__()
        for name, value in [("vocab_size", vocab_size), ("block_size", block_size),
                            ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)]:
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.net.{name} must be a positive integer, got {value!r}")
        if n_embd % n_head != 0:
            raise ConfigError(
                f"model.net.n_embd ({n_embd}) must be divisible by model.net.n_head ({n_head})"
            )
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"model.net.dropout must be in [0, 1), got {dropout}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(
            Block(n_embd, n_head, dropout, bias, attn_impl) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("attn.out_proj.weight", "c_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings excluded by default, as in nanoGPT."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T).

        With ``caches`` (one per block), ``idx`` holds only the new positions, which follow the
        cached ones; their keys and values are appended to the caches.
        """
        offset = len(caches[0]) if caches else 0
        t = idx.size(1)
        if offset + t > self.block_size:
            raise ValueError(f"sequence of {offset + t} tokens exceeds block_size {self.block_size}")
        pos = torch.arange(offset, offset + t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.h):
            x = block(x, caches[i] if caches else None)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens.

        Past ``block_size`` the context window slides, which moves every token to a new
        position, so the cache is rebuilt from the window: output equals cache-free decoding.
        """
        caches: list[KVCache] | None = None
        for _ in range(max_new_tokens):
            if caches is not None and len(caches[0]) < self.block_size:
                logits = self(idx[:, -1:], caches)
            else:
                caches = [KVCache() for _ in self.h] if use_cache else None
                logits = self(idx[:, -self.block_size :], caches)
            next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample one token id per row of ``logits`` (B, V); temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token once the ones before it already cover top_p (always keep the first)
        drop_sorted = cum - sorted_logits.softmax(dim=-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)

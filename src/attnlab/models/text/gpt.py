"""GPT: a decoder-only Transformer language model (Radford et al. 2018/2019).

nanoGPT's model (token + learned position embeddings, pre-LN blocks with a GELU MLP, tied
input/output embeddings), built from the shared blocks of ``attnlab.nn``:

- ``TokenEmbedding`` (nn/embedding.py): token table + ``LearnedPositions`` + dropout; its table
  is also the output layer (``logits = x @ tokens.weight.T``).
- ``TransformerBlock`` (nn/blocks.py): ``x + attn(ln(x))`` then ``x + mlp(ln(x))`` (pre-LN),
  with ``MultiHeadAttention`` (nn/attention.py: causal here, SDPA or explicit softmax, a
  ``KVCache`` for generation) and ``MLP`` (Linear, GELU, Linear).

The forward pass reads top-down: embed, the blocks in order, a final LayerNorm, the tied head.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn

from attnlab.nn import KVCache, LearnedPositions, MultiHeadAttention, TokenEmbedding, TransformerBlock
from attnlab.nn.attention import AttentionImpl
from attnlab.utils.checks import check_choice, check_positive, check_positive_number, check_probability


class GPT(nn.Module):
    """Causal language model over a vocabulary of ``vocab_size`` tokens.

    Args:
        vocab_size: number of token ids (filled in from the data's tokenizer when left ``???``).
        max_len: longest context the model sees (its learned position table; the data's
            ``block_size`` window must fit in it).
        depth: number of blocks.
        n_head: attention heads per block; must divide ``dim``.
        dim: model width.
        mlp_ratio: MLP hidden width over ``dim`` (GPT-2's 4).
        dropout: dropout on embeddings, attention weights and residual branches.
        bias: biases in Linear and LayerNorm layers (nanoGPT's char recipe uses none).
        attn_impl: "auto", "sdpa" or "math" attention (see ``attnlab.nn.attention``).
        gelu: the MLP's GELU, "exact" (nanoGPT) or "tanh" (GPT-2's approximation, for its weights).
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int = 64,
        depth: int = 4,
        n_head: int = 4,
        dim: int = 128,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        bias: bool = False,
        attn_impl: AttentionImpl = "auto",
        gelu: Literal["exact", "tanh"] = "exact",
    ) -> None:
        super().__init__()
        check_positive(
            "model.net",
            vocab_size=vocab_size,
            max_len=max_len,
            depth=depth,
            n_head=n_head,
            dim=dim,
        )
        check_positive_number("model.net", mlp_ratio=mlp_ratio)
        check_probability("model.net", dropout=dropout)
        check_choice("model.net", "gelu", gelu, ("exact", "tanh"))
        self.vocab_size, self.max_len = vocab_size, max_len
        self.embed = TokenEmbedding(vocab_size, dim, LearnedPositions(dim, max_len), dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim,
                n_head,
                int(mlp_ratio * dim),
                dropout=dropout,
                attn_dropout=dropout,
                bias=bias,
                attn_layer=partial(MultiHeadAttention, impl=attn_impl),
                norm_layer=partial(nn.LayerNorm, bias=bias),
                act_layer=partial(nn.GELU, approximate="none" if gelu == "exact" else "tanh"),
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim, bias=bias)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * depth)
        for name, p in self.named_parameters():
            if name.endswith(("attn.out_proj.weight", "mlp.fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def no_weight_decay(self) -> set[str]:
        """Nothing beyond biases and norms (which are never decayed): nanoGPT decays the
        position table too, and the recipes here follow it."""
        return set()

    def forward(self, idx: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T).

        With ``caches`` (one per block), ``idx`` holds only the new positions, which follow the
        cached ones; their keys and values are appended to the caches.
        """
        offset = len(caches[0]) if caches else 0
        x = self.embed(idx, offset)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x, _ = block(x, causal=True, cache=caches[i] if caches else None)
        return self.embed.unembed(self.norm(x))

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

        Past ``max_len`` the context window slides, which moves every token to a new
        position, so the cache is rebuilt from the window: output equals cache-free decoding.
        """
        caches: list[KVCache] | None = None
        for _ in range(max_new_tokens):
            if caches is not None and len(caches[0]) < self.max_len:
                logits = self(idx[:, -1:], caches)
            else:
                caches = [KVCache() for _ in self.blocks] if use_cache else None
                logits = self(idx[:, -self.max_len :], caches)
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

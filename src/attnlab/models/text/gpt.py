"""GPT: a decoder-only Transformer language model (Radford et al. 2018/2019).

nanoGPT's model (token + learned position embeddings, pre-LN blocks with a GELU MLP, tied
input/output embeddings), built from the shared blocks of ``attnlab.nn``:

- ``TokenEmbedding`` (nn/embedding.py): token table + ``LearnedPositions`` + dropout; its table
  is also the output layer (``logits = x @ tokens.weight.T``).
- ``TransformerBlock`` (nn/blocks.py): ``x + attn(ln(x))`` then ``x + mlp(ln(x))`` (pre-LN),
  with ``MultiHeadAttention`` (nn/attention.py: causal here, SDPA or explicit softmax, a
  ``KVCache`` for generation) and ``MLP`` (Linear, GELU, Linear).

The forward pass reads top-down: embed, the blocks in order, a final LayerNorm, the tied head.

Positions and the attention pattern are chosen by name (docs/positions.md): ``positions`` learned
(nanoGPT's), sinusoidal (both added to the embeddings), rope, alibi, t5 (inside the attention,
``nn/positions.py``) or none; ``attention`` full, sliding, global_local (``nn/local_attention.py``)
or linear (``nn/linear_attention.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from attnlab.core.checks import check_choice, check_positive, check_positive_number, check_probability
from attnlab.core.errors import ConfigError
from attnlab.nn import (
    LearnedPositions,
    MultiHeadAttention,
    SinusoidalPositions,
    TokenEmbedding,
    TransformerBlock,
    flops,
)
from attnlab.nn.attention import AttentionImpl, KVCache
from attnlab.nn.blocks import Activation, activation
from attnlab.nn.flops import Flops, Grad
from attnlab.nn.linear_attention import FEATURE_MAPS, LinearAttention, LinearAttentionState
from attnlab.nn.local_attention import GlobalLocalAttention, SlidingWindowAttention
from attnlab.nn.positions import Positions, relative_positions

Attention = Literal["full", "sliding", "global_local", "linear"]
ATTENTIONS = get_args(Attention)
Cache = KVCache | LinearAttentionState


def causal_attention_layer(
    attention: Attention, window: int, n_global: int, impl: AttentionImpl, feature_map: str = "elu"
) -> Callable[..., nn.Module]:
    """The attention layer ``attention`` names, as a constructor for ``TransformerBlock``."""
    check_choice("model.net", "attention", attention, ATTENTIONS)
    check_choice("model.net", "feature_map", feature_map, tuple(FEATURE_MAPS))
    if attention == "sliding":
        return partial(SlidingWindowAttention, window=window, impl=impl)
    if attention == "global_local":
        return partial(GlobalLocalAttention, window=window, n_global=n_global, impl=impl)
    if attention == "linear":
        return partial(LinearAttention, feature_map=feature_map)
    return partial(MultiHeadAttention, impl=impl)


class GPT(nn.Module):
    """Causal language model over a vocabulary of ``vocab_size`` tokens.

    Args:
        vocab_size: number of token ids (filled in from the data's tokenizer when left ``???``).
        max_len: the context it is trained on and generates with (the learned position table;
            the data's ``block_size`` follows it). Every other ``positions`` runs on longer inputs.
        depth: number of blocks.
        n_head: attention heads per block; must divide ``dim``.
        dim: model width.
        mlp_ratio: MLP hidden width over ``dim`` (GPT-2's 4).
        dropout: dropout on embeddings, attention weights and residual branches.
        bias: biases in Linear and LayerNorm layers (nanoGPT's char recipe uses none).
        attn_impl: "auto", "sdpa", "flex" or "math" attention (see ``attnlab.nn.attention``).
        act: the MLP's activation: "gelu" (nanoGPT), "gelu_tanh" (GPT-2's approximation, for
            its weights) or "quick_gelu".
        positions: "learned", "sinusoidal", "rope", "alibi", "t5" or "none" (NoPE: causal
            attention tells a token how many came before it, counted from a learned start token).
        attention: "full", "sliding" (the last ``window`` tokens), "global_local" (those and the
            first ``n_global``) or "linear" (a kernel's features, a recurrent state).
        window: keys each token sees under sliding and global_local attention, itself included.
        n_global: global tokens of global_local attention.
        feature_map: linear attention's: "elu" (elu + 1, Katharopoulos et al.) or "taylor"
            (exp to its second order, Based: closer to softmax, more features per head).
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
        act: Activation = "gelu",
        positions: Positions = "learned",
        attention: Attention = "full",
        window: int = 32,
        n_global: int = 4,
        feature_map: str = "elu",
    ) -> None:
        super().__init__()
        check_positive(
            "model.net",
            vocab_size=vocab_size,
            max_len=max_len,
            depth=depth,
            n_head=n_head,
            dim=dim,
            window=window,
            n_global=n_global,
        )
        check_positive_number("model.net", mlp_ratio=mlp_ratio)
        check_probability("model.net", dropout=dropout)
        self.vocab_size, self.max_len = vocab_size, max_len
        absolute = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}.get(positions)
        # fixed sinusoids (amplitude 1) would drown token vectors of GPT's small init: the
        # Transformer paper's sqrt(dim) scale on the tokens keeps both heard
        self.embed = TokenEmbedding(
            vocab_size,
            dim,
            absolute(dim, max_len) if absolute else None,
            dropout,
            scale=positions == "sinusoidal",
        )
        # one instance for every block (T5 shares its bias table across layers)
        self.positions = relative_positions(positions, dim // n_head, n_head, causal=True)
        if attention == "linear" and positions in ("alibi", "t5"):
            raise ConfigError(
                f"model.net.positions={positions} biases attention scores, which linear attention "
                "never forms: use learned, sinusoidal, rope or none"
            )
        attn_layer = causal_attention_layer(attention, window, n_global, attn_impl, feature_map)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim,
                n_head,
                int(mlp_ratio * dim),
                dropout=dropout,
                attn_dropout=dropout,
                bias=bias,
                attn_layer=attn_layer,
                norm_layer=partial(nn.LayerNorm, bias=bias),
                act_layer=activation("model.net", act),
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim, bias=bias)
        # NoPE: a window cut mid-text gives the causal mask nothing to count from, so a learned
        # start token (the BOS that NoPE studies' sequences begin with) opens each sequence; the
        # share of attention it draws falls with the position, which later layers can read
        self.start_token = nn.Parameter(torch.zeros(dim)) if positions == "none" else None
        self.apply(self._init_weights)
        if self.start_token is not None:
            nn.init.normal_(self.start_token, mean=0.0, std=0.02)
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

    def new_caches(self) -> list[Cache]:
        """One empty cache per block, of the kind its attention decodes with (KV or state)."""
        return [block.attn.new_cache() for block in self.blocks]

    def embed_input(self, idx: Tensor, offset: int = 0) -> Tensor:
        """Token ids (B, T) that follow ``offset`` earlier positions -> the blocks' input (B, T, C),
        led by the start token, (B, 1 + T, C), where a sequence begins (offset 0) and the model
        has one (positions "none")."""
        x = self.embed(idx, offset)
        if self.start_token is not None and offset == 0:
            x = torch.cat([self.start_token.expand(x.size(0), 1, -1), x], dim=1)
        return x

    def logits(self, x: Tensor, n: int) -> Tensor:
        """The blocks' output (B, T', C) -> logits (B, n, vocab_size) of its last ``n`` positions
        (the start token's predicts nothing)."""
        return self.embed.unembed(self.norm(x[:, x.size(1) - n :]))

    def forward(self, idx: Tensor, caches: list[Cache] | None = None) -> Tensor:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T).

        With ``caches`` (one per block, ``new_caches``), ``idx`` holds only the new positions,
        which follow the cached ones; their keys and values (or state) go into the caches.
        """
        x = self.embed_input(idx, caches[0].seen if caches else 0)  # (B, T or 1 + T, C)
        for i, block in enumerate(self.blocks):
            x, _ = block(x, causal=True, cache=caches[i] if caches else None, positions=self.positions)
        return self.logits(x, idx.size(1))

    def flops(self, idx: Tensor, grad: Grad = "all") -> Flops:
        """Model FLOPs of a training step on token ids ``idx`` (B, T) (``attnlab.nn.flops``): the
        blocks over T tokens (1 + T with a start token), attention over the full T x T even
        though causal (as PaLM and nanoGPT count it), and the tied output layer. ``grad="input"``:
        frozen, gradients passing through (Flamingo's language model)."""
        b, t = idx.shape
        t_in = t + (self.start_token is not None)
        return flops.blocks(self.blocks, b, t_in, grad) + flops.linear(
            b * t, self.norm.normalized_shape[0], self.vocab_size, grad
        )

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
        caches: list[Cache] | None = None
        for _ in range(max_new_tokens):
            if caches is not None and caches[0].seen - (self.start_token is not None) < self.max_len:
                logits = self(idx[:, -1:], caches)
            else:
                caches = self.new_caches() if use_cache else None
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

"""GPT: a decoder-only Transformer language model (Radford et al. 2018/2019), as nanoGPT writes
it: pre-LN blocks, a final LayerNorm, the output layer tied to the token embedding. Positions and
the attention pattern are chosen by name (docs/positions.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, Unpack

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, PositiveFloat, PositiveInt
from attnlab.nn import (
    LearnedPositions,
    SinusoidalPositions,
    TokenEmbedding,
    TransformerBlock,
    flops,
)
from attnlab.nn.attention import AttentionSpec, KVCache, attention_layer
from attnlab.nn.blocks import Activation, activation
from attnlab.nn.flops import Flops, Grad
from attnlab.nn.linear_attention import FeatureMap, LinearAttention, LinearAttentionState
from attnlab.nn.local_attention import GlobalLocalAttention, SlidingWindowAttention
from attnlab.nn.positions import Positions, relative_positions

Attention = Literal["full", "sliding", "global_local", "linear"]
Cache = KVCache | LinearAttentionState


def causal_attention_layer(
    attention: Attention, window: int, n_global: int, feature_map: FeatureMap = "elu", **attn: Any
) -> Callable[..., nn.Module]:
    """The attention layer ``attention`` names, as a ``TransformerBlock``'s ``attn_layer``."""
    if attention == "sliding":
        return attention_layer(SlidingWindowAttention, window=window, **attn)
    if attention == "global_local":
        return attention_layer(GlobalLocalAttention, window=window, n_global=n_global, **attn)
    if attention == "linear":
        return attention_layer(LinearAttention, feature_map=feature_map, **attn)
    return attention_layer(**attn)


def init_normal(module: nn.Module) -> None:
    """GPT's and BERT's: normal(0, 0.02) weights, zero biases and padding rows."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        module.weight.data[module.padding_idx].zero_()


class GPT(nn.Module):
    """Causal language model with a context of ``max_len`` (the data's follows it; every
    ``positions`` but "learned" runs longer); ``positions``, ``attention`` and their settings:
    docs/positions.md. ``**attn``: ``AttentionSpec`` (attn_dropout: ``dropout`` unless set)."""

    def __init__(
        self,
        vocab_size: PositiveInt,
        max_len: PositiveInt = 64,
        depth: PositiveInt = 4,
        n_head: PositiveInt = 4,
        dim: PositiveInt = 128,
        mlp_ratio: PositiveFloat = 4.0,
        dropout: DropRate = 0.0,
        bias: bool = False,
        act: Activation = "gelu",
        positions: Positions = "learned",
        attention: Attention = "full",
        window: PositiveInt = 32,
        n_global: PositiveInt = 4,
        feature_map: FeatureMap = "elu",
        **attn: Unpack[AttentionSpec],
    ) -> None:
        super().__init__()
        if attention == "linear" and positions in ("alibi", "t5"):
            raise ValueError(
                f"positions: {positions} biases attention scores, which linear attention never "
                "forms: use learned, sinusoidal, rope or none"
            )
        self.vocab_size, self.max_len = vocab_size, max_len
        absolute = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}.get(positions)
        table = absolute(dim, max_len) if absolute else None
        # fixed sinusoids (amplitude 1) would drown token vectors of GPT's small init: the
        # Transformer paper's sqrt(dim) scale on the tokens keeps both heard
        self.embed = TokenEmbedding(vocab_size, dim, table, dropout, scale=positions == "sinusoidal")
        # one instance for every block (T5 shares its bias table across layers)
        self.positions = relative_positions(positions, dim // n_head, n_head, causal=True)
        block = partial(
            TransformerBlock,
            dim,
            n_head,
            int(mlp_ratio * dim),
            dropout=dropout,
            bias=bias,
            attn_layer=causal_attention_layer(
                attention, window, n_global, feature_map, **{"attn_dropout": dropout, **attn}
            ),
            norm_layer=partial(nn.LayerNorm, bias=bias),
            act_layer=activation(act),
        )
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.norm = nn.LayerNorm(dim, bias=bias)
        # NoPE: a window cut mid-text gives the causal mask nothing to count from, so a learned
        # start token (the BOS that NoPE studies' sequences begin with) opens each sequence; the
        # share of attention it draws falls with the position, which later layers can read
        self.start_token = nn.Parameter(torch.zeros(dim)) if positions == "none" else None
        self._init_weights(depth)

    def _init_weights(self, depth: int) -> None:
        """nanoGPT's: ``init_normal``, the residual projections scaled by 1/sqrt(2 * depth). No
        ``no_weight_decay``: nanoGPT decays the position table too."""
        self.apply(init_normal)
        if self.start_token is not None:
            nn.init.normal_(self.start_token, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith(("attn.out_proj.weight", "mlp.fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * depth))

    def new_caches(self) -> list[Cache]:
        """One empty cache per block, of the kind its attention decodes with (KV or state)."""
        return [block.attn.new_cache() for block in self.blocks]

    def embed_input(self, idx: Tensor, offset: int = 0) -> Tensor:
        """Token ids (B, T) after ``offset`` earlier positions -> the blocks' input (B, T, C), or
        (B, 1 + T, C) led by the start token where a sequence begins and the model has one."""
        x = self.embed(idx, offset)
        if self.start_token is not None and offset == 0:
            x = torch.cat([self.start_token.expand(x.size(0), 1, -1), x], dim=1)
        return x

    def logits(self, x: Tensor, n: int) -> Tensor:
        """The blocks' output (B, T', C) -> logits (B, n, vocab_size) of its last ``n`` positions."""
        return self.embed.unembed(self.norm(x[:, x.size(1) - n :]))

    def forward(self, idx: Tensor, caches: list[Cache] | None = None) -> Tensor:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T); with ``caches`` (``new_caches``),
        ``idx`` holds only the positions after the cached ones, which go into the caches."""
        x = self.embed_input(idx, caches[0].seen if caches else 0)  # (B, T or 1 + T, C)
        for i, block in enumerate(self.blocks):
            x, _ = block(x, causal=True, cache=caches[i] if caches else None, positions=self.positions)
        return self.logits(x, idx.size(1))

    def flops(self, idx: Tensor, grad: Grad = "all") -> Flops:
        """Model FLOPs of a training step on ``idx`` (B, T) (``attnlab.nn.flops``): causal
        attention counted over the full T x T (as PaLM and nanoGPT count it)."""
        b, t = idx.shape
        t_in = t + (self.start_token is not None)
        logits = flops.linear(b * t, self.norm.normalized_shape[0], self.vocab_size, grad)
        return flops.blocks(self.blocks, b, t_in, grad) + logits

    # -- decoding (the ``Decoder`` contract; ``attnlab.inference.decoding`` samples with it) ------
    def start(self, idx: Tensor, use_cache: bool = True) -> dict[str, Any]:
        """Decoding after the context ``idx`` (B, T), T >= 0; the first step reads the context and
        its token in one pass. ``use_cache=False`` recomputes the window at every step."""
        return {"idx": idx, "caches": None, "use_cache": use_cache}

    def step(self, tokens: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """Logits (B, V) after ``tokens`` (B,). Past ``max_len`` the window slides, moving every
        token to a new position, so the caches are rebuilt from it (as cache-free decoding)."""
        idx = torch.cat([state["idx"], tokens[:, None]], dim=1)[:, -self.max_len :]
        caches = state["caches"]
        if caches is not None and caches[0].seen - (self.start_token is not None) < self.max_len:
            logits = self(tokens[:, None], caches)
        else:
            caches = self.new_caches() if state["use_cache"] else None
            logits = self(idx, caches)
        return logits[:, -1], {**state, "idx": idx, "caches": caches}

    def reorder(self, state: dict[str, Any], index: Tensor) -> dict[str, Any]:
        for cache in state["caches"] or []:
            cache.reorder(index)
        return {**state, "idx": state["idx"][index]}

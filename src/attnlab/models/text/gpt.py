"""GPT: a decoder-only Transformer language model (Radford et al. 2018/2019), nanoGPT's: token +
learned position embeddings (``TokenEmbedding``, its table also the output layer), pre-LN
``TransformerBlock``s (causal ``MultiHeadAttention`` with a ``KVCache`` for generation, GELU
``MLP``), a final LayerNorm, the tied head.

Positions and the attention pattern are chosen by name (docs/positions.md): ``positions`` learned,
sinusoidal, rope, alibi, t5 (``nn/positions.py``) or none; ``attention`` full, sliding,
global_local (``nn/local_attention.py``) or linear (``nn/linear_attention.py``).
"""

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
from attnlab.nn.linear_attention import LinearAttention, LinearAttentionState
from attnlab.nn.local_attention import GlobalLocalAttention, SlidingWindowAttention
from attnlab.nn.positions import Positions, relative_positions

Attention = Literal["full", "sliding", "global_local", "linear"]
FeatureMap = Literal["elu", "taylor"]  # the keys of nn.linear_attention.FEATURE_MAPS
Cache = KVCache | LinearAttentionState


def causal_attention_layer(
    attention: Attention, window: int, n_global: int, feature_map: FeatureMap = "elu", **attn: Any
) -> Callable[..., nn.Module]:
    """The attention layer ``attention`` names, with the ``AttentionSpec`` ``attn``, as a
    constructor for ``TransformerBlock``."""
    if attention == "sliding":
        return attention_layer(SlidingWindowAttention, window=window, **attn)
    if attention == "global_local":
        return attention_layer(GlobalLocalAttention, window=window, n_global=n_global, **attn)
    if attention == "linear":
        return attention_layer(LinearAttention, feature_map=feature_map, **attn)
    return attention_layer(**attn)


def init_normal(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


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
        **attn: ``attnlab.nn.AttentionSpec`` (attn_dropout: ``dropout`` unless set).
    """

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
        """nanoGPT's: normal(0, 0.02) weights, zero biases, the residual projections scaled by
        1/sqrt(2 * depth) (GPT-2)."""
        self.apply(init_normal)
        if self.start_token is not None:
            nn.init.normal_(self.start_token, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith(("attn.out_proj.weight", "mlp.fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * depth))

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

    # -- decoding (the ``Decoder`` contract; ``attnlab.inference.decoding`` samples with it) ------
    def start(self, idx: Tensor, use_cache: bool = True) -> dict[str, Any]:
        """Decoding after the context ``idx`` (B, T), T >= 0. Nothing runs yet: the first step
        reads the context and its token in one pass. ``use_cache`` False recomputes the window
        at every step."""
        return {"idx": idx, "caches": None, "use_cache": use_cache}

    def step(self, tokens: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """Logits (B, V) after ``tokens`` (B,). Past ``max_len`` the context window slides, which
        moves every token to a new position, so the caches are rebuilt from the window: output
        equals cache-free decoding."""
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

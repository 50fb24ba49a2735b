"""The Transformer encoder-decoder of "Attention is all you need" (Vaswani et al. 2017), post-LN
as in the paper or pre-LN, the output layer tied to the target embedding."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal, Unpack

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, PositiveFloat, PositiveInt
from attnlab.nn import (
    KVCache,
    LearnedPositions,
    SinusoidalPositions,
    TokenEmbedding,
    TransformerBlock,
    flops,
)
from attnlab.nn.attention import AttentionSpec, attention_layer
from attnlab.nn.flops import Flops


class Transformer(nn.Module):
    """Encoder-decoder Transformer over a joint vocabulary; ``share_embeddings``: one table for
    source and target. ``**attn``: ``attnlab.nn.AttentionSpec``, for every attention."""

    def __init__(
        self,
        vocab_size: PositiveInt,
        pad_id: int = 0,
        dim: PositiveInt = 256,
        n_head: PositiveInt = 8,
        enc_depth: PositiveInt = 3,
        dec_depth: PositiveInt = 3,
        mlp_ratio: PositiveFloat = 4.0,
        dropout: DropRate = 0.1,
        norm_first: bool = False,
        positions: Literal["sinusoidal", "learned"] = "sinusoidal",
        max_len: PositiveInt = 256,
        share_embeddings: bool = True,
        **attn: Unpack[AttentionSpec],
    ) -> None:
        super().__init__()
        self.pad_id, self.dim, self.max_len = pad_id, dim, max_len
        pos_cls = SinusoidalPositions if positions == "sinusoidal" else LearnedPositions
        embed = partial(TokenEmbedding, vocab_size, dim, dropout=dropout, scale=True, padding_idx=pad_id)
        self.src_embed = embed(pos_cls(dim, max_len))
        self.tgt_embed = self.src_embed if share_embeddings else embed(pos_cls(dim, max_len))
        block = partial(
            TransformerBlock,
            dim,
            n_head,
            int(mlp_ratio * dim),
            dropout=dropout,
            norm_first=norm_first,
            attn_layer=attention_layer(**attn),
            act_layer=nn.ReLU,
        )
        self.encoder = nn.ModuleList(block() for _ in range(enc_depth))
        self.decoder = nn.ModuleList(block(cross_attention=True) for _ in range(dec_depth))
        # pre-LN stacks end un-normalised; post-LN layers already end with a norm
        self.enc_norm = nn.LayerNorm(dim) if norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(dim) if norm_first else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                nn.init.xavier_uniform_(p)
        for embed in {self.src_embed, self.tgt_embed}:
            # scaled by sqrt(d) in the embedding, so the inputs start at unit scale
            nn.init.normal_(embed.weight, std=self.dim**-0.5)
            with torch.no_grad():
                embed.weight[self.pad_id].zero_()

    def no_weight_decay(self) -> set[str]:
        """Learned position tables are not decayed (as timm's ``pos_embed``)."""
        return {n for n, _ in self.named_parameters() if ".positions." in n}

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """Source ids (B, S) -> memory (B, S, C) and its padding mask (B, S), True at padding."""
        src_pad = src == self.pad_id
        x = self.src_embed(src)
        for block in self.encoder:
            x, _ = block(x, padding_mask=src_pad)
        return self.enc_norm(x), src_pad

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor | None,
        src_pad: Tensor,
        caches: list[tuple[KVCache, KVCache]] | None = None,
        start: int = 0,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Target ids (B, T) -> decoder states (B, T, C) and, with ``need_weights``, each layer's
        cross-attention (B, H, T, S); with each layer's (self, cross) ``caches``, no ``memory``."""
        x = self.tgt_embed(tgt_in, start)
        weights = []
        for i, block in enumerate(self.decoder):
            cache, cross_cache = caches[i] if caches is not None else (None, None)
            x, w = block(
                x,
                causal=True,
                cache=cache,
                memory=memory,
                memory_padding_mask=src_pad,
                cross_cache=cross_cache,
                need_weights=need_weights,
            )
            if need_weights:
                weights.append(w.cross_attn)
        return self.dec_norm(x), weights

    def logits(self, x: Tensor) -> Tensor:
        return self.tgt_embed.unembed(x)

    def forward(self, src: Tensor, tgt_in: Tensor, scored: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V), or (N, V) at the N positions where ``scored`` (B, T)
        is True: skipping padding saves much of the output layer and the loss."""
        memory, src_pad = self.encode(src)
        x, _ = self.decode(tgt_in, memory, src_pad)
        return self.logits(x if scored is None else x[scored])

    def flops(self, src: Tensor, tgt_in: Tensor, scored: Tensor | None = None) -> Flops:
        """Model FLOPs of a training step (``attnlab.nn.flops``) over the padded source and target,
        causal attention counted in full, the output layer at the scored positions."""
        (b, s), t = src.shape, tgt_in.size(1)
        n = b * t if scored is None else scored.sum()
        return (
            flops.blocks(self.encoder, b, s)
            + flops.blocks(self.decoder, b, t, memory=s)
            + flops.linear(n, self.dim, self.tgt_embed.weight.size(0))
        )

    def alignments(self, src: Tensor, tgt_in: Tensor) -> dict[str, Tensor]:
        """Cross-attention weights (B, H, T, S) of every decoder layer."""
        memory, src_pad = self.encode(src)
        _, weights = self.decode(tgt_in, memory, src_pad, need_weights=True)
        return {f"layer {i}": w for i, w in enumerate(weights)}

    # -- decoding (the ``Decoder`` contract) ---------------------------------------------------
    def start(self, src: Tensor) -> dict[str, Any]:
        """Encode once and project each layer's cross-attention keys and values."""
        memory, src_pad = self.encode(src)
        caches = [(KVCache(), KVCache.of_memory(block.cross_attn, memory)) for block in self.decoder]
        return {"src_pad": src_pad, "caches": caches, "t": 0}

    def step(self, tokens: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """Logits (B, V) of the next token after ``tokens`` (B,); the caches grow in place."""
        x, _ = self.decode(tokens[:, None], None, state["src_pad"], state["caches"], state["t"])
        return self.logits(x[:, -1]), {**state, "t": state["t"] + 1}

    def reorder(self, state: dict[str, Any], index: Tensor) -> dict[str, Any]:
        for self_cache, cross_cache in state["caches"]:
            self_cache.reorder(index)
            cross_cache.reorder(index)
        return {**state, "src_pad": state["src_pad"][index]}

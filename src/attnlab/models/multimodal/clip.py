"""CLIP (Radford et al. 2021): an image tower and a text tower, each projected into one shared
space where a matching image and caption should be the most similar pair of their batch."""

from __future__ import annotations

import math
from typing import Literal, Unpack

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.specs import DropRate, PositiveFloat, PositiveInt
from attnlab.nn import LearnedPositions, TokenEmbedding, TransformerBlock, flops
from attnlab.nn.attention import AttentionSpec, attention_layer
from attnlab.nn.blocks import Activation, activation
from attnlab.nn.flops import Flops

TextPool = Literal["last", "argmax"]

INIT_LOGIT_SCALE = math.log(1 / 0.07)  # CLIP's initial temperature
MAX_LOGIT_SCALE = math.log(100.0)  # the scale exp(t) is clamped at 100, as in CLIP


class TextTransformer(nn.Module):
    """CLIP's text tower: a causal Transformer over right-padded captions, read at the end-of-text
    token, found as the last non-padding one (``pool="last"``) or the highest id ("argmax":
    open_clip's, where padding may share an id with a real token)."""

    def __init__(
        self,
        vocab_size: PositiveInt,
        max_len: PositiveInt = 32,
        dim: PositiveInt = 128,
        depth: PositiveInt = 4,
        n_head: PositiveInt = 4,
        mlp_ratio: PositiveFloat = 4.0,
        dropout: DropRate = 0.0,
        pad_id: int = 0,
        act: Activation = "gelu",
        pool: TextPool = "last",
        **attn: Unpack[AttentionSpec],
    ) -> None:
        super().__init__()
        self.vocab_size, self.max_len, self.dim, self.pad_id = vocab_size, max_len, dim, pad_id
        self.pool = pool
        self.embed = TokenEmbedding(vocab_size, dim, LearnedPositions(dim, max_len), dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim,
                n_head,
                int(dim * mlp_ratio),
                dropout=dropout,
                attn_layer=attention_layer(**attn),
                act_layer=activation(act),
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.init_weights(dim, depth)

    def init_weights(self, dim: int, depth: int) -> None:
        """open_clip's: small embeddings; projections scaled by the width, residual outputs also
        by the depth."""
        nn.init.normal_(self.embed.tokens.weight, std=0.02)
        nn.init.normal_(self.embed.positions.emb.weight, std=0.01)
        attn_std, proj_std, fc_std = dim**-0.5, dim**-0.5 * (2 * depth) ** -0.5, (2 * dim) ** -0.5
        for block in self.blocks:
            nn.init.normal_(block.attn.in_proj.weight, std=attn_std)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.normal_(block.mlp.fc1.weight, std=fc_std)
            nn.init.normal_(block.mlp.fc2.weight, std=proj_std)

    def no_weight_decay(self) -> set[str]:
        return {"embed.positions.emb.weight"}

    def forward(self, tokens: Tensor) -> Tensor:
        """(B, T) right-padded token ids -> (B, dim) caption features."""
        x = self.embed(tokens)  # (B, T, D)
        for block in self.blocks:
            x, _ = block(x, causal=True)
        x = self.norm(x)
        # (B,) the end-of-text position
        last = tokens.argmax(1) if self.pool == "argmax" else (tokens != self.pad_id).sum(1).clamp(min=1) - 1
        return x[torch.arange(x.size(0), device=x.device), last]

    def flops(self, tokens: Tensor) -> Flops:
        """Model FLOPs of a training step on ``tokens`` (B, T) (``attnlab.nn.flops``)."""
        return flops.blocks(self.blocks, *tokens.shape)


class CLIP(nn.Module):
    """Two towers (``image``: any ``ImageBackbone``), their projections into an ``embed_dim``
    space, and a learnable logit scale (the log of the inverse temperature)."""

    def __init__(self, image: nn.Module, text: TextTransformer, embed_dim: PositiveInt = 128) -> None:
        super().__init__()
        self.image, self.text, self.embed_dim = image, text, embed_dim
        self.image_proj = nn.Linear(image.num_features, embed_dim, bias=False)
        self.text_proj = nn.Linear(text.dim, embed_dim, bias=False)
        # (1,), not a scalar as in open_clip: FSDP2 shards only parameters with a dimension
        self.logit_scale = nn.Parameter(torch.full((1,), INIT_LOGIT_SCALE))

    def encode_image(self, images: Tensor, normalize: bool = True) -> Tensor:
        """(B, C, H, W) -> (B, embed_dim), unit length unless ``normalize=False``."""
        x = self.image_proj(self.image.forward_head(self.image.forward_features(images), pre_logits=True))
        return F.normalize(x, dim=-1) if normalize else x

    def encode_text(self, tokens: Tensor, normalize: bool = True) -> Tensor:
        """(B, T) token ids -> (B, embed_dim), unit length unless ``normalize=False``."""
        x = self.text_proj(self.text(tokens))
        return F.normalize(x, dim=-1) if normalize else x

    def scale(self) -> Tensor:
        """exp(logit_scale), clamped at 100."""
        return self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp().squeeze(0)

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Unit image features (B, E), unit text features (B, E) and the logit scale (a scalar)."""
        return self.encode_image(images), self.encode_text(tokens), self.scale()

    def flops(self, images: Tensor, tokens: Tensor) -> Flops:
        """Model FLOPs of a training step on B pairs, the loss's B x B similarities included."""
        b = images.size(0)
        image = self.image.flops(images, head=False) + flops.linear_layer(self.image_proj, b)
        text = self.text.flops(tokens) + flops.linear_layer(self.text_proj, b)
        return image + text + flops.product(1, b, self.embed_dim, b)

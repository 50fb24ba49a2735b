"""BERT (Devlin et al. 2019): a post-LN Transformer encoder over ``[CLS] A [SEP] B [SEP]``,
pre-trained by masked-language modelling (MLM) and next-sentence prediction (NSP), fine-tuned with
a head. Laid out as Hugging Face's ``BertModel`` (eps 1e-12, exact GELU) for its weights."""

from __future__ import annotations

from functools import partial
from typing import Literal, Unpack

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, PositiveFloat, PositiveInt
from attnlab.models.text.gpt import init_normal
from attnlab.nn import Dropout, LearnedPositions, TokenEmbedding, TransformerBlock, flops
from attnlab.nn.attention import AttentionSpec, attention_layer
from attnlab.nn.flops import Flops
from attnlab.nn.positions import relative_positions

LayerNorm = partial(nn.LayerNorm, eps=1e-12)


class BertEmbeddings(nn.Module):
    """Token + learned position (if ``learned_positions``) + segment embeddings, LayerNorm, dropout."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        max_len: int,
        n_segments: int,
        dropout: float,
        pad_id: int,
        learned_positions: bool = True,
    ) -> None:
        super().__init__()
        positions = LearnedPositions(dim, max_len) if learned_positions else None
        self.tokens = TokenEmbedding(vocab_size, dim, positions, padding_idx=pad_id)
        self.segments = nn.Embedding(n_segments, dim)
        self.norm = LayerNorm(dim)
        self.drop = Dropout(dropout)

    def forward(self, ids: Tensor, segments: Tensor) -> Tensor:
        """(B, T) ids and segment ids -> (B, T, C)."""
        return self.drop(self.norm(self.tokens(ids) + self.segments(segments)))


class Bert(nn.Module):
    """The BERT encoder. ``positions``: "learned" (BERT's) or relative, both ways (docs/positions.md);
    ``**attn``: ``attnlab.nn.AttentionSpec`` (attn_dropout 0.1 unless set, as BERT's)."""

    def __init__(
        self,
        vocab_size: PositiveInt,
        pad_id: int = 0,
        dim: PositiveInt = 256,
        depth: PositiveInt = 4,
        n_head: PositiveInt = 4,
        mlp_ratio: PositiveFloat = 4.0,
        max_len: PositiveInt = 128,
        n_segments: PositiveInt = 2,
        dropout: DropRate = 0.1,
        positions: Literal["learned", "rope", "alibi", "t5"] = "learned",
        **attn: Unpack[AttentionSpec],
    ) -> None:
        super().__init__()
        self.vocab_size, self.pad_id, self.dim, self.max_len = vocab_size, pad_id, dim, max_len
        self.embed = BertEmbeddings(
            vocab_size, dim, max_len, n_segments, dropout, pad_id, learned_positions=positions == "learned"
        )
        self.positions = relative_positions(positions, dim // n_head, n_head, causal=False)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim,
                n_head,
                int(mlp_ratio * dim),
                dropout=dropout,
                norm_first=False,
                attn_layer=attention_layer(**{"attn_dropout": 0.1, **attn}),
                norm_layer=LayerNorm,
            )
            for _ in range(depth)
        )
        self.pooler = nn.Linear(dim, dim)
        self.apply(init_normal)

    def no_weight_decay(self) -> set[str]:
        """The position tables (learned, T5's) and the segment table."""
        return {n for n, _ in self.named_parameters() if "positions." in n} | {"embed.segments.weight"}

    def forward(
        self, ids: Tensor, segments: Tensor | None = None, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor]]:
        """(B, T) token ids (and segment ids, 0 by default) -> states (B, T, C), and with
        ``need_weights`` each block's attention weights (B, H, T, T). Padding is never attended."""
        if segments is None:
            segments = ids.new_zeros(ids.shape)
        padding = ids == self.pad_id  # (B, T), True at padding
        x = self.embed(ids, segments)
        weights = []
        for block in self.blocks:
            x, w = block(x, padding_mask=padding, need_weights=need_weights, positions=self.positions)
            weights.append(w.self_attn)
        return x, weights if need_weights else []

    def pool(self, x: Tensor) -> Tensor:
        """States (B, T, C) -> the sentence vector (B, C): tanh(W h_[CLS] + b)."""
        return self.pooler(x[:, 0]).tanh()

    def flops(self, ids: Tensor, segments: Tensor | None = None, pooled: bool = False) -> Flops:
        """Model FLOPs of a training step on ``ids`` (B, T) (``attnlab.nn.flops``), padding included
        (it is computed, then masked); with ``pooled`` the pooler on [CLS]."""
        b, t = ids.shape
        f = flops.blocks(self.blocks, b, t)
        return f + flops.linear(b, self.dim, self.dim) if pooled else f


class MaskedLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> logits through the (tied) token embedding, plus a bias."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.act = nn.GELU()
        self.norm = LayerNorm(dim)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, x: Tensor, embed: TokenEmbedding) -> Tensor:
        """States (..., C) -> logits (..., V) through ``embed``'s table (the encoder's own)."""
        return embed.unembed(self.norm(self.act(self.dense(x)))) + self.bias


class BertPreTraining(nn.Module):
    """The encoder with its two pre-training heads: MLM over the vocabulary (tied to the token
    embedding) at the masked positions, and NSP (is B the segment that followed A?) on [CLS]."""

    def __init__(self, encoder: Bert) -> None:
        super().__init__()
        self.encoder = encoder
        self.mlm = MaskedLMHead(encoder.dim, encoder.vocab_size)
        self.nsp = nn.Linear(encoder.dim, 2)
        init_normal(self.mlm.dense)
        init_normal(self.nsp)

    def forward(self, ids: Tensor, segments: Tensor, masked: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """MLM logits (B, T, V), or (N, V) at the N positions where ``masked`` (B, T) is True
        (skipping the others saves most of the output layer), and NSP logits (B, 2)."""
        x, _ = self.encoder(ids, segments)
        h = x if masked is None else x[masked]
        return self.mlm(h, self.encoder.embed.tokens), self.nsp(self.encoder.pool(x))

    def flops(self, ids: Tensor, segments: Tensor, masked: Tensor | None = None) -> Flops:
        """Model FLOPs of a training step (``attnlab.nn.flops``); the count of masked positions stays
        on the device."""
        b, t = ids.shape
        n = b * t if masked is None else masked.sum()
        c, v = self.encoder.dim, self.encoder.vocab_size
        mlm = flops.linear(n, c, c) + flops.linear(n, c, v)
        return self.encoder.flops(ids, pooled=True) + mlm + flops.linear(b, c, 2)


class BertClassifier(nn.Module):
    """The encoder, dropout and a linear layer to ``num_classes``, reading the pooled [CLS] state
    or, unless ``pooled``, every token's."""

    pooled = True

    def __init__(self, encoder: Bert, num_classes: PositiveInt, dropout: DropRate = 0.1) -> None:
        super().__init__()
        self.encoder, self.num_classes = encoder, num_classes
        self.drop = Dropout(dropout)
        self.head = nn.Linear(encoder.dim, num_classes)
        init_normal(self.head)

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        x, _ = self.encoder(ids, segments)
        return self.head(self.drop(self.encoder.pool(x) if self.pooled else x))

    def flops(self, ids: Tensor, segments: Tensor | None = None) -> Flops:
        n = ids.size(0) if self.pooled else ids.numel()
        head = flops.linear(n, self.encoder.dim, self.num_classes)
        return self.encoder.flops(ids, pooled=self.pooled) + head


class BertSequenceClassifier(BertClassifier):
    """A sentence (or sentence-pair) label: (B, T) ids -> logits (B, num_classes)."""


class BertTokenClassifier(BertClassifier):
    """A label per token (tagging, NER): (B, T) ids -> logits (B, T, num_classes)."""

    pooled = False

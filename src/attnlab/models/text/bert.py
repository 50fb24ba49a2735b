"""BERT (Devlin et al. 2019): a Transformer encoder read in both directions, pre-trained by
masked-language modelling (MLM) and next-sentence prediction (NSP), then fine-tuned with a head.

The input is ``[CLS] A [SEP] B [SEP]``: token + segment + learned position embeddings, a
LayerNorm, post-LN blocks (``attnlab.nn.TransformerBlock``), and a tanh "pooler" on [CLS] for
sentence-level heads. The layout follows Hugging Face's ``BertModel`` (LayerNorm eps 1e-12,
exact GELU) so that ``attnlab.weights.bert`` maps its weights onto ours.
"""

from __future__ import annotations

from functools import partial
from typing import Literal, Unpack

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, PositiveFloat, PositiveInt
from attnlab.nn import Dropout, LearnedPositions, TokenEmbedding, TransformerBlock, flops
from attnlab.nn.attention import AttentionSpec, attention_layer
from attnlab.nn.flops import Flops
from attnlab.nn.positions import relative_positions

LayerNorm = partial(nn.LayerNorm, eps=1e-12)


def init_bert(module: nn.Module) -> None:
    """Normal(0, 0.02) weights, zero biases (BERT's initialisation)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            module.weight.data[module.padding_idx].zero_()


class BertEmbeddings(nn.Module):
    """Token + learned position (unless ``learned_positions`` is off) + segment embeddings, then
    LayerNorm and dropout."""

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
    """The BERT encoder.

    Args:
        vocab_size, pad_id: from the data's tokenizer.
        dim: model width (BERT's hidden_size).
        depth: number of blocks.
        n_head: attention heads; must divide ``dim``.
        mlp_ratio: MLP hidden width over ``dim`` (intermediate_size / hidden_size: 4 in BERT).
        max_len: longest input, in tokens.
        n_segments: segment ids (2: sentence A and B).
        dropout: on the embeddings and each residual branch.
        positions: "learned" (BERT's), or relative ones inside the attention (docs/positions.md):
            "rope", "alibi" (symmetric: the distance either way) or "t5" (buckets both ways).
        **attn: ``attnlab.nn.AttentionSpec`` (attn_dropout 0.1 unless set, as BERT's).
    """

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
        self.apply(init_bert)

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
        """Model FLOPs of a training step of the encoder on ``ids`` (B, T) (``attnlab.nn.flops``):
        its blocks over the padded length, padding included (it is computed, masked), and with
        ``pooled`` the pooler on [CLS]."""
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
        init_bert(self.mlm.dense)
        init_bert(self.nsp)

    def forward(self, ids: Tensor, segments: Tensor, masked: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """MLM logits (B, T, V), or (N, V) at the N positions where ``masked`` (B, T) is True
        (skipping the others saves most of the output layer), and NSP logits (B, 2)."""
        x, _ = self.encoder(ids, segments)
        h = x if masked is None else x[masked]
        return self.mlm(h, self.encoder.embed.tokens), self.nsp(self.encoder.pool(x))

    def flops(self, ids: Tensor, segments: Tensor, masked: Tensor | None = None) -> Flops:
        """Model FLOPs of a training step (``attnlab.nn.flops``): the encoder, the MLM head at
        the masked positions (their count stays on the device) and NSP on the pooled [CLS]."""
        b, t = ids.shape
        n = b * t if masked is None else masked.sum()
        c, v = self.encoder.dim, self.encoder.vocab_size
        mlm = flops.linear(n, c, c) + flops.linear(n, c, v)
        return self.encoder.flops(ids, pooled=True) + mlm + flops.linear(b, c, 2)


class BertClassifier(nn.Module):
    """The encoder, dropout and a linear layer to ``num_classes``; the subclasses say what it reads."""

    def __init__(self, encoder: Bert, num_classes: PositiveInt, dropout: DropRate = 0.1) -> None:
        super().__init__()
        self.encoder, self.num_classes = encoder, num_classes
        self.drop = Dropout(dropout)
        self.head = nn.Linear(encoder.dim, num_classes)
        init_bert(self.head)


class BertSequenceClassifier(BertClassifier):
    """A sentence (or sentence-pair) label from the pooled [CLS] state."""

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        """(B, T) ids -> logits (B, num_classes)."""
        x, _ = self.encoder(ids, segments)
        return self.head(self.drop(self.encoder.pool(x)))

    def flops(self, ids: Tensor, segments: Tensor | None = None) -> Flops:
        """Model FLOPs of a training step (``attnlab.nn.flops``): the encoder, pooler and head."""
        return self.encoder.flops(ids, pooled=True) + flops.linear(
            ids.size(0), self.encoder.dim, self.num_classes
        )


class BertTokenClassifier(BertClassifier):
    """A label per token (tagging, NER) from each token's state."""

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        """(B, T) ids -> logits (B, T, num_classes)."""
        x, _ = self.encoder(ids, segments)
        return self.head(self.drop(x))

    def flops(self, ids: Tensor, segments: Tensor | None = None) -> Flops:
        """Model FLOPs of a training step (``attnlab.nn.flops``): the encoder and the head at every token."""
        return self.encoder.flops(ids) + flops.linear(ids.numel(), self.encoder.dim, self.num_classes)
